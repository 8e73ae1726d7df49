"""A drafter added the way docs/reference.md#adding-a-drafter says: this one
file (the class and its ENTRY) plus one line in the registry's ENTRIES (the
test puts it there). It proposes the context's last token k times: cheap,
model-free and right wherever the text repeats a token."""

from __future__ import annotations

import time
from collections.abc import Sequence

from coordinator.drafters.base import DrafterEntry, Proposal

NAME = "repeat_last"


class RepeatLastDrafter:
    name: str = NAME
    uses: tuple[str, ...] = (NAME,)

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        return (NAME,) if context else ()

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool,
                      using: str | None = None) -> Proposal:
        started = time.perf_counter()
        return Proposal(NAME, [int(context[-1])] * k, seconds=time.perf_counter() - started)

    def warm_up(self, context, seed, wanted=lambda done: True):
        return None

    def verified(self, context_length: int) -> None:
        pass


ENTRY = DrafterEntry(NAME, free=True, prior_cost=0.0, build=lambda options: RepeatLastDrafter())
