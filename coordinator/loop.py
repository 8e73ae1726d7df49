"""The draft-verify loop, engine-agnostic.

Each round asks the policy for a window k (bounded by the tokens still
allowed), lets the draft propose k tokens, asks the target to verify them in
one forward pass (it returns the accepted prefix plus one token of its own),
and yields what was emitted. With k = 0 the round is one plain target step.
For sampled requests the draft also returns its logits, the coordinator sends
the draft's distribution q as log-probabilities and the target verifies by
rejection sampling, so the output is distributed exactly as the target's.
Every engine call gets a seed of its own (``call_seed``). Every engine call is
timed for the policy's cost model. Engines are awaited, so many requests
interleave their rounds on one coordinator.

The end of a sequence is found from the token counts, not from the end token
itself: TensorRT-LLM neither returns nor counts it, so a call that reached
the end returns fewer tokens than it otherwise must (none of the target's
own). An engine that does return the end token is handled too.

When the policy plans a stretch of plain decoding (the first round, a
fallback until the next probe, or no draft at all) the target is asked for
the whole stretch in one streamed call (at most ``plain_stretch`` tokens):
one round trip instead of one per token. For a greedy request the draft
prefills the prompt in the background after the first round, while the
target goes on plainly, so the draft's prefill delays neither the first token
nor a speculative round; it goes in calls of at most 128 tokens, the first
of only 32 on a prompt over 256 (drafters.catch_up_ends), and a request that ends first, or
whose calls so far show the rest cannot pay, issues no further call. Which
rounds speculate then depends on timing, which greedy output does not; a
sampled request keeps a schedule that depends only on its seed (the draft
prefills in its first speculative round), so a seeded request repeats its
text. Before the draft model first catches up on a prompt the policy prices
that catch-up (measured seconds per token of earlier warm-ups) against what
speculation is predicted to save over the tokens left: a long prompt with a
short completion decodes without the draft model.

A draft call that raises, or does not answer within ``draft_timeout`` seconds,
switches the request to target-only decoding (``policy.draft_failed``); the
late call is left to finish in the background and its answer is dropped. The
greedy background prefill has no deadline (it delays no token): the request
drafts once it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from coordinator.drafters import DRAFT_MODEL, FREE_DRAFTERS, Drafter, ModelDrafter, Proposal
from coordinator.engine_semantics import before_end, common_prefix_length
from coordinator.policy import Mode, SpeculationPolicy
from coordinator.rounds import Round
from coordinator.sampling import SamplingParams, call_seed

log = logging.getLogger(__name__)

# Plain tokens per call while the draft prefills the prompt in the background:
# short, so speculation starts soon after the draft is ready.
WARMUP_STRETCH = 2


@dataclass(frozen=True)
class EngineOutput:
    tokens: list[int]  # end token excluded or not: the loop copes with both
    logits: np.ndarray | None = None  # [len(tokens), vocab] raw logits, when asked for
    log_probs: list[float] | None = None  # each token's (sampling.log_probs), aligned with tokens


class Engine(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        draft_tokens: Sequence[int] = (),
        draft_logits: np.ndarray | None = None,
        return_logits: bool = False,
    ) -> EngineOutput:
        """Generate up to ``max_new_tokens`` after ``input_ids``; with
        ``draft_tokens`` (k of them, max_new_tokens = k + 1) verify them (by
        rejection sampling against softmax(``draft_logits``) [k, vocab] when
        given) and return the accepted prefix plus one token. ``sampling.seed``
        seeds this call alone."""
        ...

    def stream(self, input_ids: Sequence[int], max_new_tokens: int,
               sampling: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Plain decoding in one call: the tokens (and log probabilities) as they are generated."""
        ...


class EngineError(RuntimeError):
    """An engine failed or answered outside its contract."""


class DraftTimeout(EngineError):
    """The draft did not answer within the coordinator's draft_timeout_seconds."""


def reached_end_by_count(returned: int, accepted: int, requested: int, verified: bool) -> bool:
    """Whether a target call that returned ``returned`` tokens (``accepted``
    of them draft tokens) for ``requested`` stopped at the end token, which a
    TensorRT-LLM engine does not return.

    No token of the target's own after the accepted drafts: the next one was
    the end. A plain call that returned fewer than requested: the end. A
    verification that returned exactly one token of its own is a normal
    rejection on an engine that stops after the correction token; on one that
    keeps decoding to ``request_output_len`` it may also mean the end came
    right after it, and then the next round's call returns no token: correct
    either way, one call later at most. More than one own token but fewer
    than requested happens only on an engine that keeps decoding: the end."""
    own = returned - accepted
    if own <= 0:
        return True
    if returned >= requested:
        return False
    return not verified or own > 1


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
    """``drafter`` proposes the drafts (coordinator/drafters.py); without it, the
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
    want_distribution = draft_distribution and not sampling.greedy
    costs = policy.costs
    free_drafter = any(name in FREE_DRAFTERS for name in drafter.uses)
    context = list(prompt_ids)
    produced = 0
    # Whether the target had processed the context up to its last round: a call
    # that has to catch up on more (the prompt prefill) is not a steady-state sample.
    target_seen = 0
    warmup: asyncio.Task | None = None  # the draft model's prompt prefill, in the background
    warmed = False
    draft_pays: bool | None = None  # whether the draft model's catch-up on the prompt pays (priced once)
    request_over = False  # the background warm-up issues no further engine call once set

    def draft_model_pays(remaining: int) -> bool:
        nonlocal draft_pays
        if draft_pays is None:
            draft_pays = policy.catch_up_pays(len(context), remaining)
        return draft_pays

    async def timed_warm_up(work, at: int) -> None:
        """Run the warm-up and price it by the time it ran: an upper bound of what it
        costs the request (the target decodes meanwhile, the slower where they share
        cores), so the pricing errs towards plain decoding, never towards a loss. A
        warm-up stopped early is priced by the part it did."""
        started = clock()
        done = await work
        if done:
            costs.observe_draft_prefill(done, clock() - started, at)

    def catch_up_wanted(tokens: int) -> Callable[[int], bool]:
        """Asked before each call of the draft's catch-up on ``tokens`` tokens: the request
        is still running, and the rest still pays at the rate its calls so far went."""
        started = clock()

        def wanted(done: int) -> bool:
            nonlocal draft_pays
            if request_over or policy.held_back:  # the server measured plain decoding faster at this load
                return False
            if done == 0 or policy.rest_of_catch_up_pays(tokens, tokens - done, max_new_tokens - produced,
                                                         (clock() - started) / done):
                return True
            draft_pays = False  # the draft model sits out the rest of the request
            return False

        return wanted

    def report(round_: Round) -> Round:
        """The round as the cost model and the policy took it in."""
        costs.observe(round_)
        return policy.observe(round_)

    try:
        while produced < max_new_tokens:
            remaining = max_new_tokens - produced
            candidates = drafter.candidates(context)
            if DRAFT_MODEL in candidates and produced > 0 and not draft_model_pays(remaining):
                candidates = tuple(name for name in candidates if name != DRAFT_MODEL)
            if DRAFT_MODEL in candidates and warmup is not None and not warmup.done():
                await asyncio.sleep(0)  # let a warm-up that is about to finish finish
                if not warmup.done():  # the draft is still prefilling the prompt: not a candidate yet
                    candidates = tuple(name for name in candidates if name != DRAFT_MODEL)
            chosen, k = policy.plan(len(context), candidates)
            k = min(k, remaining - 1)
            position = len(context)  # of the first new token: the calls' seeds depend on it
            if warmup is not None and warmup.done() and not warmup.cancelled() and warmup.exception() is not None:
                error, warmup = warmup.exception(), None  # handled once (warmed keeps it from restarting)
                log.warning("draft failed, continuing with the target alone: %s", error)
                policy.draft_failed(error)
                if chosen == DRAFT_MODEL:
                    k = 0
            if k <= 0:
                stretch = min(remaining, plain_stretch,
                              policy.plain_rounds_planned(free_drafter, draft_model=draft_pays is not False))
                if warmup is not None and not warmup.done():
                    stretch = min(stretch, WARMUP_STRETCH)
                plain = _plain_rounds(target, context, stretch, sampling, end_ids, clock, steady=target_seen > 0)
                async with aclosing(plain):
                    async for round_ in plain:
                        target_seen = len(context)
                        context += round_.tokens
                        produced += len(round_.tokens)
                        finished = round_.finished or produced >= max_new_tokens
                        yield report(replace(round_, finished=finished))
                        if round_.finished:
                            return
                if (not warmed and sampling.greedy and policy.max_window > 0 and produced < max_new_tokens
                        and policy.mode is not Mode.DRAFT_FAILED and not policy.held_back
                        and DRAFT_MODEL in drafter.uses and draft_model_pays(max_new_tokens - produced)):
                    warmed = True
                    work = drafter.warm_up(context, call_seed(sampling.seed, len(context), "draft"),
                                           wanted=catch_up_wanted(len(context)))
                    if work is not None:
                        warmup = asyncio.ensure_future(timed_warm_up(work, len(context)))
                continue
            started = clock()
            try:
                proposal = await drafter.propose(context, k, call_seed(sampling.seed, position, "draft"),
                                                 want_distribution, chosen)
            except Exception as error:  # the request goes on without the draft
                log.warning("draft failed, continuing with the target alone: %s", error)
                policy.draft_failed(error)
                proposal = Proposal(chosen, [])
            draft_seconds = clock() - started
            drafts = proposal.tokens[:k]
            requested = len(drafts) + 1
            started = clock()
            verified = await target.generate(
                context, requested, replace(sampling, seed=call_seed(sampling.seed, position, "target")),
                draft_tokens=drafts, draft_logits=proposal.log_probs if drafts else None,
            )
            target_seconds = clock() - started
            steady = target_seen > 0  # the target caught up on one round's tokens at most
            target_seen = len(context)
            if drafts:
                drafter.verified(len(context))
            returned = [int(t) for t in verified.tokens]
            if len(returned) > requested:
                raise EngineError(f"target returned {len(returned)} tokens for a round of {len(drafts)} draft tokens")
            matched = common_prefix_length(returned, drafts)
            emitted = before_end(returned[:remaining], end_ids)
            accepted = min(matched, len(emitted))
            log_probs = _aligned(verified.log_probs, len(emitted), sampling)
            # an engine that returns the end token, or one that stops before it
            ended = len(emitted) < len(returned[:remaining]) or reached_end_by_count(
                len(returned), matched, requested, verified=bool(drafts))
            round_ = Round(emitted, len(drafts), accepted, ended or produced + len(emitted) >= max_new_tokens,
                           draft_seconds, target_seconds, drafter=proposal.drafter if drafts else "",
                           context=position, draft_sample=proposal.seconds if drafts else None,
                           target_sample=target_seconds if steady else None,
                           alternatives=score_alternatives(proposal.alternatives, emitted) if drafts else (),
                           log_probs=log_probs)
            context += emitted
            produced += len(emitted)
            yield report(round_)
            if ended:
                return
    finally:
        request_over = True
        if warmup is not None and not warmup.done():
            warmup.add_done_callback(_drop_result)


def score_alternatives(alternatives: Sequence[tuple[str, Sequence[int]]],
                       emitted: Sequence[int]) -> tuple[tuple[str, int, bool], ...]:
    """(drafter, accepted, rejected) of each alternative proposal had it been verified by
    token matching: its tokens are tried in order against what the target emitted (its
    own sample at every position, distributed as the target's for sampled requests too),
    up to the first that differs; tokens past the emitted ones are not tried."""
    scored = []
    for name, tokens in alternatives:
        matched = common_prefix_length(tokens, emitted)
        scored.append((name, matched, matched < min(len(tokens), len(emitted))))
    return tuple(scored)


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


async def with_deadline(call, timeout: float | None):
    """Await an engine call, giving up after ``timeout`` seconds (DraftTimeout).

    The call itself is shielded, not cancelled: an engine request already
    queued in Triton cannot be taken back, so it runs to its end and its
    answer (or error) is dropped."""
    if not timeout or timeout <= 0:
        return await call
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout)
    except asyncio.TimeoutError:
        task.add_done_callback(_drop_result)
        raise DraftTimeout(f"draft did not answer within {timeout:g} s (draft_timeout_seconds)") from None


def _drop_result(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a late draft call failed after its deadline: %s", task.exception())
