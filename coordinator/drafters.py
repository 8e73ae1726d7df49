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
  so the timed call is a steady-state cost sample (on a prompt, in the
  background and in calls of CATCH_UP_CHUNK tokens).
* ``prompt_lookup``: the continuation of the latest earlier occurrence of the
  context's last n tokens (n from ``max_ngram`` down to ``min_ngram``), as in
  Saxena's prompt lookup decoding and TensorRT-LLM's n-gram drafter. No model:
  its cost is a few microseconds of search, so it pays wherever the text
  repeats its context (code edits, refactors, quoting, extraction).
* ``hybrid``: both where the context's last ``min_match`` tokens occurred
  before (a long match: the text is copying), the draft model otherwise; the
  policy takes the one predicted to serve more tokens per second
  (coordinator/policy.py). Short matches are left to the draft model: in code
  that is not copying, a 3-token match predicts the next token about as often
  as a coin, and the draft model then has text to catch up on. Where the
  draft model is ready, it drafts and prompt lookup's proposal is scored
  against what the target emitted, so prompt lookup earns its rounds with
  evidence that cost nothing; where the draft model would first have to
  catch up on the context, prompt lookup is preferred and tried first.

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
from coordinator.penalties import for_engine_call, processed_rows
from coordinator.sampling import SamplingParams, draft_log_probs

DRAFT_MODEL, PROMPT_LOOKUP, HYBRID = "draft_model", "prompt_lookup", "hybrid"
DRAFTERS = (DRAFT_MODEL, PROMPT_LOOKUP, HYBRID)
# Drafters that run no model: a rejected proposal costs only its verification
# rows, so the acceptance under which the draft model stops paying does not apply.
FREE_DRAFTERS = frozenset({PROMPT_LOOKUP})
# The draft model's background catch-up on a prompt goes in calls of at most
# this many tokens, each reusing the cache the one before left (the engines'
# KV-cache reuse). A request that ends before its draft has caught up then
# leaves at most one such call running: Triton 2.51 cannot cancel a BLS call,
# and the rest of a long prompt's prefill would take the cores (or the GPU)
# from other requests for nothing. 128 tokens are 16 forwards of the CPU
# draft's 8 rows; on a GPU a few more round trips per prompt.
CATCH_UP_CHUNK = 128
# On a prompt longer than two chunks the first call is shorter: where no
# earlier catch-up has priced one (a fresh server), the request learns from
# this call whether the rest pays, so a long prompt whose catch-up does not pay
# has cost the request only this much. A shorter prompt is caught up in at
# most two calls: a short first call's rate, which carries a call's fixed
# costs, would overprice a catch-up that is cheap anyway.
CATCH_UP_FIRST = 32


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
    uses: tuple[str, ...] = (DRAFT_MODEL,)
    seen: int = 0  # context length the engine has processed

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        return self.uses

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool,
                      using: str | None = None) -> Proposal:
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
            log_probs = await asyncio.to_thread(self._log_q, np.asarray(drafted.logits[: len(tokens)]),
                                                list(context), tokens)
        return Proposal(self.name, tokens, log_probs, (self.clock() - started) if tokens else None)

    def _log_q(self, logits: np.ndarray, context: list[int], tokens: list[int]) -> np.ndarray:
        """log q of the drafted tokens: the draft's raw logits processed as its
        sampler processed them (penalties included, each row after the tokens before it)."""
        end_id = self.end_ids[0] if self.end_ids else None
        rows, params = processed_rows(logits, tokens, for_engine_call(self.sampling, len(context)), end_id, context)
        return draft_log_probs(rows, params)

    def warm_up(self, context: Sequence[int], seed: int,
                wanted: Callable[[int], bool] = lambda done: True) -> Awaitable[int] | None:
        # No deadline: the target decodes while the draft prefills the prompt, so
        # a slow prefill (a long prompt, a crowd of them) delays no token; the
        # request drafts once it is done. A dead engine still fails the call.
        if self.seen:
            return None
        self.seen = len(context)
        return self._catch_up(list(context), replace(self.sampling, seed=seed), wanted)

    async def _catch_up(self, context: list[int], sampling: SamplingParams, wanted: Callable[[int], bool]) -> int:
        """``context`` into the draft engine's cache in the calls ``catch_up_ends`` gives
        (each reuses the cache the call before left); no further call once ``wanted(done)`` is
        False. Returns ``done``, the tokens caught up on."""
        done = 0
        for end in catch_up_ends(len(context)):
            if not wanted(done):
                break
            await self._prefill(context[:end], sampling, deadline=False)
            done = end
        return done

    async def _prefill(self, context: Sequence[int], sampling: SamplingParams, deadline: bool = True) -> None:
        """One call that puts ``context`` in the draft engine's cache (not priced as a draft step)."""
        call = self.engine.generate(context, 1, sampling)
        await (self.deadline(call) if deadline else call)

    def verified(self, context_length: int) -> None:
        self.seen = context_length


@dataclass
class PromptLookupDrafter:
    """n-gram lookup over the prompt and the generated text."""

    max_ngram: int = 3
    min_ngram: int = 1
    clock: Callable[[], float] = time.perf_counter
    name: str = PROMPT_LOOKUP
    uses: tuple[str, ...] = (PROMPT_LOOKUP,)

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        return self.uses

    def match(self, context: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, tokens): the longest n-gram match found and up to ``k`` tokens that followed it."""
        return lookup(context, k, self.max_ngram, self.min_ngram)

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


@dataclass
class HybridDrafter:
    """Prompt lookup or the draft model where ``lookup`` finds a match (the
    policy picks), the draft model elsewhere."""

    model: ModelDrafter
    lookup: PromptLookupDrafter  # searching for long matches only (make_drafter)
    name: str = HYBRID
    uses: tuple[str, ...] = (PROMPT_LOOKUP, DRAFT_MODEL)
    _last: str = ""  # the drafter of the latest proposal

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        _, tokens = self.lookup.match(context, 1)
        if not tokens:
            return (self.model.name,)
        if len(context) - self.model.seen > self.model.catch_up_after:  # the draft model is cold here
            return self.lookup.name, self.model.name
        return self.model.name, self.lookup.name

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool,
                      using: str | None = None) -> Proposal:
        using = using or self.candidates(context)[0]
        self._last = using
        if using == self.lookup.name:
            return await self.lookup.propose(context, k, seed, distribution)
        proposal = await self.model.propose(context, k, seed, distribution)
        _, alternative = self.lookup.match(context, k + 1)  # the round emits k + 1 tokens at most
        return replace(proposal, alternatives=((self.lookup.name, alternative),)) if alternative else proposal

    def warm_up(self, context: Sequence[int], seed: int,
                wanted: Callable[[int], bool] = lambda done: True) -> Awaitable[int] | None:
        # Where prompt lookup has a match the text is likely copying: the draft
        # model's prefill would only take cores from the target; it catches up
        # when it is first needed.
        if self.candidates(context)[0] == self.lookup.name:
            return None
        return self.model.warm_up(context, seed, wanted)

    def verified(self, context_length: int) -> None:
        if self._last == self.model.name:  # the draft model has not seen what prompt lookup proposed
            self.model.verified(context_length)


def catch_up_ends(tokens: int, chunk: int = CATCH_UP_CHUNK, first: int = CATCH_UP_FIRST) -> list[int]:
    """Where the calls of a catch-up on ``tokens`` tokens end: after ``first`` tokens
    if ``tokens`` is over two chunks (else after one chunk), then every ``chunk``
    tokens, then the end."""
    if tokens <= 0:
        return []
    return [*range(first if tokens > 2 * chunk else chunk, tokens, chunk), tokens]


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
                 min_match: int = 8) -> Drafter:
    """The drafter called ``name`` for one request (``model`` builds its draft-model drafter;
    ``min_match``: the hybrid's shortest prompt lookup match)."""
    if name == DRAFT_MODEL:
        return model()
    if name == PROMPT_LOOKUP:
        return PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    if name == HYBRID:
        return HybridDrafter(model(), PromptLookupDrafter(max_ngram=min_match, min_ngram=min_match))
    raise ValueError(f"unknown drafter {name!r}; drafters: {', '.join(DRAFTERS)}")
