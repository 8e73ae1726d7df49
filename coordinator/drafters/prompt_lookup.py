"""Prompt lookup as a drafter: the continuation of the latest earlier
occurrence of the context's last n tokens (n from ``max_ngram`` down to
``min_ngram``), as in Saxena's prompt lookup decoding and TensorRT-LLM's
n-gram drafter. No model: its cost is a few microseconds of search, so it pays
wherever the text repeats its context (code edits, refactors, quoting,
extraction).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.drafters.base import DrafterEntry, Proposal

NAME = "prompt_lookup"

@dataclass
class PromptLookupDrafter:
    """n-gram lookup over the prompt and the generated text."""

    max_ngram: int = 3
    min_ngram: int = 1
    clock: Callable[[], float] = time.perf_counter
    name: str = NAME
    uses: tuple[str, ...] = (NAME,)

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        return self.uses

    def match(self, context: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, tokens): the longest n-gram match found and up to ``k`` tokens that followed it."""
        return lookup(context, k, self.max_ngram, self.min_ngram)

    def find(self, context: Sequence[int]) -> tuple[int, int]:
        """(n, where the tokens that followed the match start in ``context``); (0, 0): no match."""
        return find(context, self.max_ngram, self.min_ngram)

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool,
                      using: str | None = None) -> Proposal:
        started = self.clock()
        _, tokens = self.match(context, k)
        return Proposal(self.name, tokens, None, self.clock() - started)

    def warm_up(self, context: Sequence[int], seed: int,
                wanted: Callable[[int], bool] = lambda done: True) -> Awaitable[int] | None:
        return None

    def verified(self, context_length: int) -> None:
        pass


def lookup(context: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """The continuation (up to ``k`` tokens) of the latest earlier occurrence of the
    context's last n tokens, for the largest n in max_ngram..min_ngram that occurs;
    (0, []) when none does."""
    if k <= 0:
        return 0, []
    n, follow = find(context, max_ngram, min_ngram)
    return (n, [int(t) for t in context[follow: follow + k]]) if n else (0, [])


def find(context: Sequence[int], max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """(n, where the continuation starts) of ``lookup``'s match; (0, 0) when there is none."""
    if len(context) < 2:
        return 0, 0
    tokens = np.asarray(context, dtype=np.int64)
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        pattern = tokens[size - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)  # starts 0..size-1-n
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size:
            return n, int(starts[-1]) + n  # the latest occurrence, what followed it
    return 0, 0


# A search, not a forward: nothing, next to a target step.
ENTRY = DrafterEntry(NAME, free=True, prior_cost=0.0,
                     build=lambda options: PromptLookupDrafter(max_ngram=options.max_ngram,
                                                               min_ngram=options.min_ngram))
