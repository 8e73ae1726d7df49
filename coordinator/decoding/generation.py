"""One request from prompt to text chunks: tokenise, run the loop, detokenise,
apply stop words, keep the statistics. What the Triton model sends is a
direct mapping of the chunks this yields."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from coordinator.request.api import Statistics
from coordinator.settings import CoordinatorSettings
from coordinator.policy.costmodel import CostModel
from coordinator.drafters import registry
from coordinator.drafters.base import DrafterOptions
from coordinator.drafters.registry import PROMPT_LOOKUP
from coordinator.drafters.draft_model import ModelDrafter
from coordinator.policy.governor import LoadGovernor
from coordinator.engines.contract import Engine, for_prompt
from coordinator.decoding.loop import speculative_decode
from coordinator.engines.deadline import with_deadline
from coordinator.response.metrics import RequestMetrics
from coordinator.policy.speculation import SpeculationPolicy
from coordinator.request.parse import GenerationRequest, check_context, check_end_id, check_prompt_size
from coordinator.rounds import Round
from coordinator.response.text import CompletionText
from coordinator.request.tokenizer import Codec

class Stats(Statistics):
    """Per-request statistics (the public ones, coordinator/request/api.py), sent with the final response."""

    def add(self, round_: Round) -> None:
        self.draft_tokens += round_.drafted
        self.accepted_draft_tokens += round_.accepted
        self.acceptance_rate = self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0
        self.completion_tokens += len(round_.tokens)
        self.draft_seconds += round_.draft_seconds
        if round_.drafted:
            self.speculative_rounds += 1
            self.rejected_rounds += round_.rejected
            self.verify_seconds += round_.target_seconds
            if round_.drafter == PROMPT_LOOKUP:
                self.lookup_draft_tokens += round_.drafted
        else:
            self.plain_rounds += 1
            self.plain_seconds += round_.target_seconds


class RequestCancelled(Exception):
    """The client cancelled the request; generation stopped after the current round."""


@dataclass(frozen=True)
class Chunk:
    text: str
    final: bool
    stats: Stats
    log_probs: list[float] | None = None  # the final chunk's, when the request asked for them


async def generate_text(
    request: GenerationRequest,
    codec: Codec,
    *,
    draft: Engine,
    target: Engine,
    settings: CoordinatorSettings,
    costs: CostModel | None = None,
    governor: LoadGovernor | None = None,
    metrics: RequestMetrics | None = None,
    cancelled: Callable[[], bool] | None = None,
    on_round: Callable[[Round], None] | None = None,
) -> AsyncIterator[Chunk]:
    """Yield text deltas; the last chunk has ``final`` set and carries the stats.

    ``costs`` is the server-wide cost model shared by all requests, ``governor``
    the server-wide switch that measures whether speculation pays at the load.
    ``cancelled`` is asked after every round; when it says yes, no further
    engine call is made and ``RequestCancelled`` is raised. ``on_round`` sees
    every round as the policy took it in (the adapter's tracing)."""
    check_prompt_size(codec.text_bytes(request.prompt), codec.max_token_bytes, settings)
    prompt_ids = codec.encode(request.prompt)
    check_context(len(prompt_ids), request.max_tokens, settings)
    check_end_id(request.end_id, codec.vocab_size)
    costs = costs if costs is not None else CostModel()
    policy = SpeculationPolicy(
        request.speculation_window,
        settings.fallback_threshold,
        costs=costs,
        adaptive=request.adaptive_window,
        settings=settings.policy,
        # a request that asked for a fixed window (or none) gets it: the load switch belongs to the adaptive mode
        governor=governor if request.adaptive_window and request.speculation_window > 0 else None,
    )
    rounds = _rounds(request, codec, prompt_ids, policy, draft=draft, target=target, settings=settings)
    text = CompletionText(codec.decode, request.stop_words)
    stats = Stats(arm=request.arm)
    if metrics is not None:
        metrics.arm = request.arm  # its latencies are counted under its arm of the traffic split
    log_probs: list[float] | None = [] if request.return_log_probs else None
    costs.streams += 1  # the load the cost model plans for
    prefilling = governor is not None  # until the first round: the prompt's prefill
    if prefilling:
        governor.prefill_started()
    try:
        async with aclosing(rounds):
            async for round_ in rounds:
                stats.add(round_)
                if log_probs is not None:
                    log_probs += round_.log_probs or ()
                if prefilling:
                    prefilling = False
                    governor.prefill_ended()
                elif policy.governor is not None:
                    policy.governor.emitted(len(round_.tokens), costs.streams,
                                            round_.draft_seconds + round_.target_seconds)
                stats.fallback_reason = policy.reason
                if metrics is not None:
                    metrics.round(round_)
                if on_round is not None:
                    on_round(round_)
                if cancelled is not None and not round_.finished and cancelled():
                    raise RequestCancelled()
                delta = text.append(round_.tokens, final=round_.finished)
                if text.stopped or round_.finished:
                    yield Chunk(delta, True, stats, log_probs)
                    return
                if delta:
                    yield Chunk(delta, False, stats)
    finally:
        costs.streams -= 1
        if prefilling:  # the request ended before its first token
            governor.prefill_ended()
    yield Chunk(text.append([], final=True), True, stats, log_probs)  # budget of 0 rounds cannot happen; kept for safety


def _rounds(request: GenerationRequest, codec: Codec, prompt_ids: list[int], policy: SpeculationPolicy, *,
            draft: Engine, target: Engine, settings: CoordinatorSettings) -> AsyncIterator[Round]:
    """The request's decoding loop, with the drafter it named (or the server's)."""
    sampling, draft_sampling = engine_sampling(request, codec, len(prompt_ids))
    end_ids = codec.special.eos_token_ids if request.end_id is None else (request.end_id,)
    drafter = registry.build(request.drafter or settings.drafter, DrafterOptions(
        model=lambda: ModelDrafter(draft, draft_sampling or sampling, tuple(end_ids),
                                   catch_up_after=policy.max_window + 1,
                                   deadline=lambda call: with_deadline(call, settings.draft_timeout_seconds)),
        max_ngram=settings.prompt_lookup_max_ngram,
        min_ngram=settings.prompt_lookup_min_ngram,
        min_match=settings.hybrid_min_match,
    ))
    return speculative_decode(
        prompt_ids,
        request.max_tokens,
        drafter=drafter,
        target=for_prompt(target, len(prompt_ids)),
        policy=policy,
        sampling=sampling,
        end_ids=end_ids,
        plain_stretch=settings.plain_stretch_tokens if settings.engine_decoupled else 1,
        draft_distribution=request.draft_distribution,
    )


def engine_sampling(request: GenerationRequest, codec: Codec, prompt_length: int):
    """The request's target and draft sampling as the engines get them: its
    penalties attached (bad words tokenized, min_length counted from the end
    of the prompt; the draft samples with the same ones, so its drafts follow
    the target's processed distribution), log probabilities asked of the
    target alone."""
    sampling, draft = request.sampling, request.draft_sampling
    penalties = replace(request.penalties, prompt_length=prompt_length,
                        bad_words=tuple(tuple(codec.encode_words(w)) for w in request.bad_word_texts))
    if penalties.active:
        sampling = replace(sampling, penalties=penalties)
        draft = None if draft is None else replace(draft, penalties=penalties)
    if request.return_log_probs:
        draft = draft or sampling
        sampling = replace(sampling, log_probs=True)
    return sampling, draft
