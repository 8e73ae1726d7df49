"""What a drafter is: the interface the loop drives, what a proposal carries,
and the entry that declares a drafter to the registry (coordinator/drafters/registry.py).

A drafter is made per request (it remembers what its engine has seen) and is
as small as Hugging Face's ``CandidateGenerator``: ``propose`` k tokens after
a context, optionally with the draft's distribution q. A proposal with q is
verified by rejection sampling; one without q by token matching (the target
samples every position and keeps the drafts while they equal its own
samples), which is lossless for sampled requests too, since every emitted
token is the target's own sample. So a drafter that has no distribution
(prompt lookup) serves sampled requests as well.

Each proposal names the drafter that made it, so the cost model prices each
one by its own measured cost and acceptance.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np



@dataclass(frozen=True)
class DrafterOptions:
    """What a request's drafter is built from: the draft-model drafter (built on
    demand: only drafters that use the draft engine call it) and the server's settings."""

    model: Callable[[], "Drafter"]
    max_ngram: int = 3  # prompt lookup's longest n-gram
    min_ngram: int = 1  # and its shortest
    min_match: int = 8  # the hybrid's shortest prompt lookup match


@dataclass(frozen=True)
class DrafterEntry:
    """A drafter as the rest of the coordinator knows it: declared once, next to its code."""

    name: str  # the request input ``drafter`` and the server setting name it so
    build: Callable[[DrafterOptions], "Drafter"]
    free: bool = False  # runs no model: a rejected proposal costs only its verification rows
    # A draft step's cost as a fraction of a target step before anything is measured;
    # None for a drafter that only chooses among others (its proposals name the one used).
    prior_cost: float | None = None

@dataclass(frozen=True)
class Proposal:
    drafter: str  # the drafter that made it (a hybrid names the one it chose)
    tokens: list[int]
    log_probs: np.ndarray | None = None  # log q [len(tokens), vocab]; None: verified by token matching
    seconds: float | None = None  # what drafting cost, when it is a steady-state sample
    # What free drafters that could also propose here would have proposed: scored against
    # the round's tokens (loop.score_alternatives), they learn without costing a round.
    alternatives: tuple[tuple[str, list[int]], ...] = ()


class Drafter(Protocol):
    name: str
    uses: tuple[str, ...]  # the drafters it may propose with

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        """The drafters that could propose after ``context``, preferred first (what the policy prices)."""
        ...

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool,
                      using: str | None = None) -> Proposal:
        """Up to ``k`` tokens after ``context`` (fewer, or none, when it has nothing to say);
        with ``distribution``, log q as well where the drafter has one. ``seed`` seeds a sampling
        drafter; ``using`` names the candidate to propose with (None: the preferred one)."""
        ...

    def warm_up(self, context: Sequence[int], seed: int,
                wanted: Callable[[int], bool] = lambda done: True) -> Awaitable[int] | None:
        """Work worth starting in the background before the first proposal (None: nothing);
        it returns the context tokens it caught up on. ``wanted(done)``, ``done`` those
        so far, is asked before each engine call of it: False stops it there."""
        ...

    def verified(self, context_length: int) -> None:
        """The target verified a round at ``context_length``: a model drafter's cache holds it now."""
        ...


class EngineLike(Protocol):
    async def generate(self, input_ids, max_new_tokens, sampling, draft_tokens=(), draft_logits=None,
                       return_logits=False): ...


class DrafterError(RuntimeError):
    """A drafter answered outside its contract."""
