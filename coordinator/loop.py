"""The draft-verify loop, engine-agnostic.

Each round drafts k = min(window, tokens still allowed - 1) tokens, asks the
target to verify them in one forward pass (it returns the accepted prefix plus
one token of its own), and yields what was emitted. Engines are awaited, so
many requests interleave their rounds on one coordinator instance.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.policy import SpeculationPolicy
from coordinator.sampling import SamplingParams

log = logging.getLogger(__name__)


class Engine(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        draft_tokens: Sequence[int] = (),
    ) -> list[int]:
        """Generate up to ``max_new_tokens`` after ``input_ids``; with
        ``draft_tokens`` (k of them, max_new_tokens = k + 1) verify them and
        return the accepted prefix plus one token."""
        ...


class EngineError(RuntimeError):
    """An engine failed or answered outside its contract."""


@dataclass(frozen=True)
class Round:
    tokens: list[int]  # emitted this round, end token excluded
    drafted: int
    accepted: int
    finished: bool  # end token reached or token budget spent


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
) -> AsyncIterator[Round]:
    context = list(prompt_ids)
    produced = 0
    while produced < max_new_tokens:
        remaining = max_new_tokens - produced
        k = min(policy.window(), remaining - 1)
        proposal: list[int] = []
        if k > 0:
            try:
                proposal = _cut_after_end(list(await draft.generate(context, k, sampling))[:k], end_ids)
            except Exception as error:  # the request goes on without the draft
                log.warning("draft failed, continuing with the target alone: %s", error)
                policy.draft_failed(error)
        emitted = list(await target.generate(context, len(proposal) + 1, sampling, draft_tokens=proposal))
        if not 1 <= len(emitted) <= len(proposal) + 1:
            raise EngineError(f"target returned {len(emitted)} tokens for a round of {len(proposal)} draft tokens")
        accepted = common_prefix_length(emitted, proposal)
        policy.record(len(proposal), accepted)
        emitted = _cut_after_end(emitted[:remaining], end_ids)
        ended = emitted[-1] in end_ids
        if ended:
            emitted.pop()
        context += emitted
        produced += len(emitted)
        yield Round(emitted, len(proposal), accepted, finished=ended or produced >= max_new_tokens)
        if ended:
            return
