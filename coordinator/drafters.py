"""Who proposes the tokens a round verifies: the draft model, prompt lookup, or both.

A drafter is made per request (it remembers what its engine has seen) and is
as small as Hugging Face's ``CandidateGenerator``: ``propose`` k tokens after
a context, optionally with the draft's distribution q. A proposal with q is
verified by rejection sampling; one without q by token matching (the target
samples every position and keeps the drafts while they equal its own
samples), which is lossless for sampled requests too, since every emitted
token is the target's own sample. So a drafter that has no distribution
(prompt lookup) serves sampled requests as well.

* ``draft_model``: the draft engine (a Triton model speaking the tensorrtllm
  contract). It catches up on a context it is behind on in a call of its own,
  so the timed call is a steady-state cost sample.
* ``prompt_lookup``: the continuation of the latest earlier occurrence of the
  context's last n tokens (n from ``max_ngram`` down to ``min_ngram``), as in
  Saxena's prompt lookup decoding and TensorRT-LLM's n-gram drafter. No model:
  its cost is a few microseconds of search, so it pays wherever the text
  repeats its context (code edits, refactors, quoting, extraction).
* ``hybrid``: prompt lookup where the context has a confident match (at least
  ``confident_ngram`` tokens), the draft model otherwise.

Each proposal names the drafter that made it, so the cost model prices each
one by its own measured cost and acceptance.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from coordinator.engine_semantics import before_end
from coordinator.sampling import SamplingParams, draft_log_probs

DRAFT_MODEL, PROMPT_LOOKUP, HYBRID = "draft_model", "prompt_lookup", "hybrid"
DRAFTERS = (DRAFT_MODEL, PROMPT_LOOKUP, HYBRID)


@dataclass(frozen=True)
class Proposal:
    drafter: str  # the drafter that made it (a hybrid names the one it chose)
    tokens: list[int]
    log_probs: np.ndarray | None = None  # log q [len(tokens), vocab]; None: verified by token matching
    seconds: float | None = None  # what drafting cost, when it is a steady-state sample


class Drafter(Protocol):
    name: str

    def chooses(self, context: Sequence[int]) -> str:
        """The drafter that would propose after ``context`` (what the window is priced for)."""
        ...

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool) -> Proposal:
        """Up to ``k`` tokens after ``context`` (fewer, or none, when it has nothing to say);
        with ``distribution``, log q as well where the drafter has one. ``seed`` seeds a sampling drafter."""
        ...

    def warm_up(self, context: Sequence[int], seed: int) -> Awaitable[None] | None:
        """Work worth starting in the background before the first proposal (None: nothing)."""
        ...

    def verified(self, context_length: int) -> None:
        """The target verified a round at ``context_length``: a model drafter's cache holds it now."""
        ...


class EngineLike(Protocol):
    async def generate(self, input_ids, max_new_tokens, sampling, draft_tokens=(), draft_logits=None,
                       return_logits=False): ...


@dataclass
class ModelDrafter:
    """The draft model, served as an engine; ``sampling`` is how it samples."""

    engine: EngineLike
    sampling: SamplingParams
    end_ids: Sequence[int]
    catch_up_after: int  # tokens behind beyond which it catches up in an untimed call first
    deadline: Callable[[Awaitable], Awaitable] = lambda call: call  # wraps every call (the draft timeout)
    clock: Callable[[], float] = time.perf_counter
    name: str = DRAFT_MODEL
    seen: int = 0  # context length the engine has processed

    def chooses(self, context: Sequence[int]) -> str:
        return self.name

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool) -> Proposal:
        sampling = replace(self.sampling, seed=seed)
        if len(context) - self.seen > self.catch_up_after:
            await self._prefill(context, sampling)
            self.seen = len(context)
        started = self.clock()
        drafted = await self.deadline(self.engine.generate(context, k, sampling, return_logits=distribution))
        tokens = before_end([int(t) for t in drafted.tokens][:k], self.end_ids)  # the target decides the end
        log_probs = None
        if distribution and tokens:
            if drafted.logits is None or len(drafted.logits) < len(tokens):
                raise DrafterError("the draft returned no generation_logits for a sampled request")
            # k rows over the whole vocabulary, off the event loop: other streams need not wait
            log_probs = await asyncio.to_thread(draft_log_probs, np.asarray(drafted.logits[: len(tokens)]),
                                                self.sampling)
        return Proposal(self.name, tokens, log_probs, (self.clock() - started) if tokens else None)

    def warm_up(self, context: Sequence[int], seed: int) -> Awaitable[None] | None:
        if self.seen:
            return None
        self.seen = len(context)
        return self._prefill(list(context), replace(self.sampling, seed=seed))

    async def _prefill(self, context: Sequence[int], sampling: SamplingParams) -> None:
        """One untimed call that puts ``context`` in the draft engine's cache."""
        await self.deadline(self.engine.generate(context, 1, sampling))

    def verified(self, context_length: int) -> None:
        self.seen = context_length


@dataclass
class PromptLookupDrafter:
    """n-gram lookup over the prompt and the generated text."""

    max_ngram: int = 3
    min_ngram: int = 1
    clock: Callable[[], float] = time.perf_counter
    name: str = PROMPT_LOOKUP

    def chooses(self, context: Sequence[int]) -> str:
        return self.name

    def match(self, context: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, tokens): the longest n-gram match found and up to ``k`` tokens that followed it."""
        return lookup(context, k, self.max_ngram, self.min_ngram)

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool) -> Proposal:
        started = self.clock()
        _, tokens = self.match(context, k)
        return Proposal(self.name, tokens, None, self.clock() - started)

    def warm_up(self, context: Sequence[int], seed: int) -> Awaitable[None] | None:
        return None

    def verified(self, context_length: int) -> None:
        pass


@dataclass
class HybridDrafter:
    """Prompt lookup where the context has a match of ``confident_ngram`` tokens, the draft model elsewhere."""

    model: ModelDrafter
    lookup: PromptLookupDrafter
    confident_ngram: int = 3
    name: str = HYBRID
    _last: str = ""  # the drafter of the latest proposal

    def chooses(self, context: Sequence[int]) -> str:
        n, tokens = self.lookup.match(context, 1)
        return self.lookup.name if tokens and n >= self.confident_ngram else self.model.name

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool) -> Proposal:
        started = self.lookup.clock()
        n, tokens = self.lookup.match(context, k)
        if tokens and n >= self.confident_ngram:
            self._last = self.lookup.name
            return Proposal(self.lookup.name, tokens, None, self.lookup.clock() - started)
        self._last = self.model.name
        return await self.model.propose(context, k, seed, distribution)

    def warm_up(self, context: Sequence[int], seed: int) -> Awaitable[None] | None:
        # Where prompt lookup has a match the text is likely copying: the draft
        # model's prefill would only take cores from the target; it catches up
        # when it is first needed.
        if self.chooses(context) == self.lookup.name:
            return None
        return self.model.warm_up(context, seed)

    def verified(self, context_length: int) -> None:
        if self._last == self.model.name:  # the draft model has not seen what prompt lookup proposed
            self.model.verified(context_length)


class DrafterError(RuntimeError):
    """A drafter answered outside its contract."""


def lookup(context: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """The continuation (up to ``k`` tokens) of the latest earlier occurrence of the
    context's last n tokens, for the largest n in max_ngram..min_ngram that occurs;
    (0, []) when none does."""
    if k <= 0 or len(context) < 2:
        return 0, []
    tokens = np.asarray(context, dtype=np.int64)
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        pattern = tokens[size - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)  # starts 0..size-1-n
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # the latest occurrence, what followed it
            return n, [int(t) for t in tokens[follow: follow + k]]
    return 0, []


def make_drafter(name: str, *, model: Callable[[], ModelDrafter], max_ngram: int = 3, min_ngram: int = 1,
                 confident_ngram: int = 3) -> Drafter:
    """The drafter called ``name`` for one request (``model`` builds its draft-model drafter)."""
    if name == DRAFT_MODEL:
        return model()
    lookup_drafter = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    if name == PROMPT_LOOKUP:
        return lookup_drafter
    if name == HYBRID:
        return HybridDrafter(model(), lookup_drafter, confident_ngram)
    raise ValueError(f"unknown drafter {name!r}; drafters: {', '.join(DRAFTERS)}")
