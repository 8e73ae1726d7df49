"""The draft-verify loop, engine-agnostic.

Each round asks the policy for a window k (bounded by the tokens still
allowed), lets the draft propose k tokens, asks the target to verify them in
one forward pass (it returns the accepted prefix plus one token of its own),
and yields what was emitted. With k = 0 the round is one plain target step.
For sampled requests the draft also returns its logits and the target
verifies by rejection sampling, so the output is distributed exactly as the
target's. Every engine call is timed for the policy's cost model. Engines are
awaited, so many requests interleave their rounds on one coordinator.

A draft call that raises, or does not answer within ``draft_timeout`` seconds,
switches the request to target-only decoding (``policy.draft_failed``); the
late call is left to finish in the background and its answer is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from coordinator.policy import SpeculationPolicy
from coordinator.sampling import SamplingParams, draft_logits_for_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOutput:
    tokens: list[int]
    logits: np.ndarray | None = None  # [len(tokens), vocab] raw logits, when asked for


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
        rejection sampling when ``draft_logits`` [k, vocab] are given) and
        return the accepted prefix plus one token."""
        ...


class EngineError(RuntimeError):
    """An engine failed or answered outside its contract."""


class DraftTimeout(EngineError):
    """The draft did not answer within the coordinator's draft_timeout_seconds."""


@dataclass(frozen=True)
class Round:
    tokens: list[int]  # emitted this round, end token excluded
    drafted: int
    accepted: int
    finished: bool  # end token reached or token budget spent
    draft_seconds: float = 0.0
    target_seconds: float = 0.0


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _cut_after_end(tokens: list[int], end_ids: Collection[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in end_ids:
            return tokens[: i + 1]
    return tokens


async def speculative_decode(
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    draft: Engine,
    target: Engine,
    policy: SpeculationPolicy,
    sampling: SamplingParams,
    end_ids: Collection[int],
    draft_sampling: SamplingParams | None = None,
    clock: Callable[[], float] = time.perf_counter,
    draft_timeout: float | None = None,
) -> AsyncIterator[Round]:
    """``draft_sampling``: how the draft samples (defaults to ``sampling``;
    another temperature stays lossless because the target is told q).
    ``draft_timeout``: seconds a draft call may take (None or 0: no deadline)."""
    draft_sampling = draft_sampling or sampling
    want_logits = not sampling.greedy
    context = list(prompt_ids)
    produced = 0
    # Context length each engine had already processed at its last call: a call
    # that has to catch up on more than one round's tokens (the prompt prefill,
    # or the draft after plain rounds) is not a steady-state cost sample.
    draft_seen = target_seen = 0
    while produced < max_new_tokens:
        remaining = max_new_tokens - produced
        k = min(policy.window(), remaining - 1)
        proposal: list[int] = []
        proposal_logits = None
        draft_seconds = 0.0
        if k > 0:
            started = clock()
            try:
                drafted = await _with_deadline(
                    draft.generate(context, k, draft_sampling, return_logits=want_logits), draft_timeout
                )
                proposal = _cut_after_end(list(drafted.tokens)[:k], end_ids)
                if want_logits and proposal:
                    proposal_logits = _draft_logits(drafted, len(proposal), draft_sampling, sampling)
            except Exception as error:  # the request goes on without the draft
                log.warning("draft failed, continuing with the target alone: %s", error)
                policy.draft_failed(error)
                proposal, proposal_logits = [], None
            draft_seconds = clock() - started
        started = clock()
        verified = await target.generate(
            context, len(proposal) + 1, sampling, draft_tokens=proposal, draft_logits=proposal_logits
        )
        target_seconds = clock() - started
        steady = target_seen > 0  # the target caught up on one round's tokens at most
        draft_steady = draft_seen > 0 and len(context) - draft_seen <= policy.max_window + 1
        target_seen = len(context)
        if proposal:
            draft_seen = len(context)
        emitted = list(verified.tokens)
        if not 1 <= len(emitted) <= len(proposal) + 1:
            raise EngineError(f"target returned {len(emitted)} tokens for a round of {len(proposal)} draft tokens")
        accepted = common_prefix_length(emitted, proposal)
        if proposal:
            timed = steady and draft_steady
            policy.record(len(proposal), accepted, draft_seconds if timed else None, target_seconds if timed else None)
        else:
            policy.record_plain(target_seconds if steady else None)
        emitted = _cut_after_end(emitted[:remaining], end_ids)
        ended = emitted[-1] in end_ids
        if ended:
            emitted.pop()
        context += emitted
        produced += len(emitted)
        finished = ended or produced >= max_new_tokens
        yield Round(emitted, len(proposal), accepted, finished, draft_seconds, target_seconds)
        if ended:
            return


async def _with_deadline(call, timeout: float | None):
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


def _draft_logits(drafted: EngineOutput, k: int, draft_sampling: SamplingParams, sampling: SamplingParams):
    if drafted.logits is None or len(drafted.logits) < k:
        raise EngineError("the draft returned no generation_logits for a sampled request")
    logits = np.asarray(drafted.logits[:k], dtype=np.float32)
    if draft_sampling == sampling:  # the target processes them exactly as the draft did
        return logits
    try:
        return draft_logits_for_target(logits, draft_sampling, sampling)
    except ValueError:  # the target cannot be told q: verify by token matching (lossless for any draft)
        return None
