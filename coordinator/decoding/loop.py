"""The draft-verify loop, engine-agnostic.

Each round asks the policy for a window k (bounded by the tokens still
allowed), lets the drafter propose k tokens, asks the target to verify them in
one forward pass (it returns the accepted prefix plus one token of its own),
and yields what was emitted. With k = 0 the round is plain decoding. For
sampled requests the draft also returns its logits, the coordinator sends the
draft's distribution q as log-probabilities and the target verifies by
rejection sampling, so the output is distributed exactly as the target's.
Every engine call gets a seed of its own (``call_seed``) and is timed for the
policy's cost model. Engines are awaited, so many requests interleave their
rounds on one coordinator.

The named steps, in the order a request meets them:

* ``plan_round``: which drafter and window (the policy prices the candidates
  the drafter offers; the draft model only once its catch-up pays and is done);
* ``plain_stretch``: when the policy plans plain decoding (the first round, a
  fallback until the next probe, or no drafter at all) the target is asked for
  the whole stretch in one streamed call (at most ``plain_stretch`` tokens):
  one round trip instead of one per token;
* the draft's warm-up (coordinator/drafters/warmup.py) starts after the first
  plain stretch of a greedy request;
* ``speculative_round``: propose, verify, read the outcome
  (coordinator/verification/outcome.py).

The end of a sequence is found from the token counts, not from the end token
itself: TensorRT-LLM neither returns nor counts it, so a call that reached
the end returns fewer tokens than it otherwise must (none of the target's
own). An engine that does return the end token is handled too.

A draft call that raises, or does not answer within ``draft_timeout`` seconds,
switches the request to target-only decoding (``policy.draft_failed``); the
late call is left to finish in the background and its answer is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from coordinator.rounds import Round
from coordinator.drafters import registry
from coordinator.drafters.base import Drafter, Proposal
from coordinator.drafters.draft_model import ModelDrafter
from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.drafters.warmup import DraftWarmUp
from coordinator.engines.contract import Engine, EngineError
from coordinator.engines.deadline import with_deadline
from coordinator.policy.speculation import Mode, SpeculationPolicy
from coordinator.sampling.params import SamplingParams, call_seed
from coordinator.verification.outcome import (before_end, common_prefix_length, reached_end_by_count,
                                              score_alternatives)

log = logging.getLogger(__name__)

# Plain tokens per call while the draft prefills the prompt in the background:
# short, so speculation starts soon after the draft is ready.
WARMUP_STRETCH = 2


@dataclass
class Decoding:
    """One request's decoding so far, and what stays fixed while it runs."""

    context: list[int]
    max_new_tokens: int
    target: Engine
    policy: SpeculationPolicy
    sampling: SamplingParams
    end_ids: Collection[int]
    clock: Callable[[], float]
    produced: int = 0
    # Whether the target had processed the context up to its last round: a call
    # that has to catch up on more (the prompt prefill) is not a steady-state sample.
    target_seen: int = 0
    free_drafter: bool = field(default=False)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.produced

    def take(self, tokens: Sequence[int]) -> None:
        self.context += tokens
        self.produced += len(tokens)

    def report(self, round_: Round) -> Round:
        """The round as the cost model and the policy took it in."""
        self.policy.costs.observe(round_)
        return self.policy.observe(round_)


async def speculative_decode(
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    target: Engine,
    policy: SpeculationPolicy,
    sampling: SamplingParams,
    end_ids: Collection[int],
    draft: Engine | None = None,
    drafter: Drafter | None = None,
    draft_sampling: SamplingParams | None = None,
    clock: Callable[[], float] = time.perf_counter,
    draft_timeout: float | None = None,
    plain_stretch: int = 1,
    draft_distribution: bool = True,
) -> AsyncIterator[Round]:
    """``drafter`` proposes the drafts (coordinator/drafters/); without it, the
    ``draft`` engine does, sampling as ``draft_sampling`` (defaults to
    ``sampling``; another temperature stays lossless because the target is told q).
    ``draft_timeout``: seconds a draft engine call may take (None or 0: no deadline).
    ``plain_stretch``: most tokens one plain call may generate (1: a call per token).
    ``draft_distribution``: a sampled request's drafts are verified against the
    draft's distribution q (rejection sampling); False: by token matching (also
    lossless, usually fewer tokens accepted)."""
    if drafter is None:
        if draft is None:
            raise ValueError("speculative_decode needs a drafter or a draft engine")
        drafter = ModelDrafter(draft, draft_sampling or sampling, tuple(end_ids), policy.max_window + 1,
                               deadline=lambda call: with_deadline(call, draft_timeout), clock=clock)
    state = Decoding(list(prompt_ids), max_new_tokens, target, policy, sampling, end_ids, clock,
                     free_drafter=any(registry.is_free(name) for name in drafter.uses))
    warm_up = DraftWarmUp(drafter, policy, lambda: state.remaining, clock)
    distribution = draft_distribution and not sampling.greedy
    try:
        while state.remaining > 0:
            chosen, k = await plan_round(state, drafter, warm_up)
            if k > 0:
                round_ = await speculative_round(state, drafter, chosen, k, distribution)
                yield round_
                if round_.finished:
                    return
                continue
            stretch = plain_stretch_length(state, warm_up, plain_stretch)
            reason = plain_reason(state.policy, warm_up, drafter, state.remaining)
            ended = False
            async for round_ in plain_stretch_rounds(state, stretch, reason):  # read to its end: it releases the call
                ended = round_.finished
                yield round_
            if ended:
                return
            warm_up.start_if_wanted(state.context, sampling)
    finally:
        warm_up.close()


async def plan_round(state: Decoding, drafter: Drafter, warm_up: DraftWarmUp) -> tuple[str, int]:
    """The drafter and window of the next round (k = 0: plain decoding)."""
    policy = state.policy
    candidates = drafter.candidates(state.context)
    if DRAFT_MODEL in candidates and state.produced > 0 and not warm_up.pays(len(state.context)):
        candidates = tuple(name for name in candidates if name != DRAFT_MODEL)
    if DRAFT_MODEL in candidates and (warm_up.deferred or not await warm_up.ready()):  # not caught up yet
        candidates = tuple(name for name in candidates if name != DRAFT_MODEL)
    chosen, k = policy.plan(len(state.context), candidates)
    k = min(k, state.remaining - 1)
    error = warm_up.failure()
    if error is not None:
        log.warning("draft failed, continuing with the target alone: %s", error)
        policy.draft_failed(error)
        if chosen == DRAFT_MODEL:
            k = 0
    return chosen, k


def plain_stretch_length(state: Decoding, warm_up: DraftWarmUp, most: int) -> int:
    """How many tokens the next plain call asks for: up to the policy's next
    planned speculative round, short while the draft warms up."""
    planned = state.policy.plain_rounds_planned(state.free_drafter, draft_model=warm_up.verdict is not False)
    stretch = min(state.remaining, most, planned)
    return min(stretch, WARMUP_STRETCH) if warm_up.running or warm_up.deferred else stretch


def plain_reason(policy: SpeculationPolicy, warm_up: DraftWarmUp, drafter: Drafter, remaining: int) -> str:
    """Why the next round decodes plainly (coordinator/rounds.py PLAIN_REASONS), first cause first."""
    if policy.max_window <= 0:
        return "not_requested"
    if remaining <= 1:
        return "last_token"
    if policy.draft_model_failed:
        return "draft_failed"
    if policy.held_back:
        return "load_governor"
    if DRAFT_MODEL in drafter.uses:
        if warm_up.verdict is False:
            return "catch_up_not_worth_it"
        if warm_up.running or warm_up.deferred:
            return "draft_catching_up"
    if policy.first_round_pending:
        return "first_round"
    if policy.mode is Mode.FALLBACK:
        return "low_acceptance"
    return "cost_model"


async def plain_stretch_rounds(state: Decoding, stretch: int, reason: str = "") -> AsyncIterator[Round]:
    """A stretch of plain decoding in one call, a reported Round per chunk (``reason``: why, PLAIN_REASONS)."""
    plain = _plain_rounds(state.target, state.context, stretch, state.sampling, state.end_ids, state.clock,
                          steady=state.target_seen > 0)
    async with aclosing(plain):
        async for round_ in plain:
            state.target_seen = len(state.context)
            state.take(round_.tokens)
            yield state.report(replace(round_, finished=round_.finished or state.remaining <= 0, plain_reason=reason))
            if round_.finished:
                return


async def speculative_round(state: Decoding, drafter: Drafter, chosen: str, k: int, distribution: bool) -> Round:
    """Propose ``k`` tokens with ``chosen`` and verify them in one target call."""
    context, sampling, clock, policy = state.context, state.sampling, state.clock, state.policy
    position = len(context)  # of the first new token: the calls' seeds depend on it
    started = clock()
    try:
        proposal = await drafter.propose(context, k, call_seed(sampling.seed, position, "draft"), distribution, chosen)
    except Exception as error:  # the request goes on without the draft
        log.warning("draft failed, continuing with the target alone: %s", error)
        policy.draft_failed(error)
        proposal = Proposal(chosen, [])
    draft_seconds = clock() - started
    drafts = proposal.tokens[:k]
    requested = len(drafts) + 1
    started = clock()
    verified = await state.target.generate(
        context, requested, replace(sampling, seed=call_seed(sampling.seed, position, "target")),
        draft_tokens=drafts, draft_logits=proposal.log_probs if drafts else None,
    )
    target_seconds = clock() - started
    steady = state.target_seen > 0  # the target caught up on one round's tokens at most
    state.target_seen = position
    if drafts:
        drafter.verified(position)
    returned = [int(t) for t in verified.tokens]
    if len(returned) > requested:
        raise EngineError(f"target returned {len(returned)} tokens for a round of {len(drafts)} draft tokens")
    matched = common_prefix_length(returned, drafts)
    emitted = before_end(returned[:state.remaining], state.end_ids)
    # an engine that returns the end token, or one that stops before it
    ended = len(emitted) < len(returned[:state.remaining]) or reached_end_by_count(
        len(returned), matched, requested, verified=bool(drafts))
    round_ = Round(emitted, len(drafts), min(matched, len(emitted)),
                   ended or state.produced + len(emitted) >= state.max_new_tokens,
                   draft_seconds, target_seconds, drafter=proposal.drafter if drafts else "",
                   context=position, draft_sample=proposal.seconds if drafts else None,
                   target_sample=target_seconds if steady else None,
                   alternatives=score_alternatives(proposal.alternatives, emitted) if drafts else (),
                   log_probs=_aligned(verified.log_probs, len(emitted), sampling),
                   plain_reason="" if drafts else ("draft_failed" if policy.draft_model_failed else "nothing_proposed"))
    state.take(emitted)
    return state.report(round_)


async def _plain_rounds(target: Engine, context: list[int], stretch: int, sampling: SamplingParams,
                        end_ids: Collection[int], clock, steady: bool):
    """A stretch of plain decoding in one streamed call: a Round per chunk of
    tokens as they arrive (``finished`` set when the end was reached)."""
    seed = call_seed(sampling.seed, len(context), "target")
    start = len(context)  # the caller extends ``context`` with each round this yields
    started = last = clock()
    got = 0
    ended = False
    async with aclosing(target.stream(context, stretch, replace(sampling, seed=seed))) as chunks:
        async for chunk in chunks:
            if ended or got >= stretch:
                continue  # read the stream to its final response: that releases the engine's request at once
            now = clock()
            tokens = [int(t) for t in chunk.tokens][: stretch - got]
            emitted = before_end(tokens, end_ids)
            ended = len(emitted) < len(tokens)
            got += len(tokens)
            # the first chunk carries the call's round trip (and any prefill); later ones one forward each
            sample = now - last if steady or got > len(tokens) else None
            if emitted or ended:
                yield Round(emitted, 0, 0, ended, 0.0, now - last, context=start + got - len(tokens),
                            target_sample=sample, log_probs=_aligned(chunk.log_probs, len(emitted), sampling))
            last = now
    if not ended and got < stretch:  # fewer tokens than asked and no end token: the engine stopped at the end
        yield Round([], 0, 0, True, 0.0, clock() - started if got == 0 else 0.0, context=start + got)


def _aligned(log_probs, count: int, sampling: SamplingParams) -> tuple[float, ...] | None:
    """The first ``count`` log probabilities of a call that was asked for them."""
    if not sampling.log_probs:
        return None
    if log_probs is None or len(log_probs) < count:
        raise EngineError(f"the target returned {0 if log_probs is None else len(log_probs)} log probabilities "
                          f"for {count} tokens")
    return tuple(float(p) for p in log_probs[:count])
