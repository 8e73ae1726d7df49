"""The draft model as a drafter: the ``draft`` engine (a Triton model speaking
the tensorrtllm contract) proposes k tokens, with its distribution q for
sampled requests.

It catches up on a context it is behind on in a call of its own, so the
timed call is a steady-state cost sample (on a prompt, in the background and
in calls of CATCH_UP_CHUNK tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from coordinator.drafters.base import DrafterEntry, DrafterError, EngineLike, Proposal
from coordinator.sampling.maths import draft_log_probs
from coordinator.sampling.params import SamplingParams
from coordinator.sampling.penalties import for_engine_call, processed_rows
from coordinator.verification.outcome import before_end

NAME = "draft_model"

# The draft model's background catch-up on a prompt goes in calls of at most
# this many tokens, each reusing the cache the one before left (the engines'
# KV-cache reuse). A request that ends before its draft has caught up then
# leaves at most one such call running: Triton 2.51 cannot cancel a BLS call,
# and the rest of a long prompt's prefill would take the cores (or the GPU)
# from other requests for nothing. 128 tokens are one forward of the CPU
# draft (up to 256 rows, cpu_engine/row_blocks.py); on a GPU a few more round
# trips per prompt.
CATCH_UP_CHUNK = 128
# On a prompt longer than two chunks the first call is shorter: where no
# earlier catch-up has priced one (a fresh server), the request learns from
# this call whether the rest pays, so a long prompt whose catch-up does not pay
# has cost the request only this much. A shorter prompt is caught up in at
# most two calls: a short first call's rate, which carries a call's fixed
# costs, would overprice a catch-up that is cheap anyway.
CATCH_UP_FIRST = 32


@dataclass
class ModelDrafter:
    """The draft model, served as an engine; ``sampling`` is how it samples."""

    engine: EngineLike
    sampling: SamplingParams
    end_ids: Sequence[int]
    catch_up_after: int  # tokens behind beyond which it catches up in an untimed call first
    deadline: Callable[[Awaitable], Awaitable] = lambda call: call  # wraps every call (the draft timeout)
    clock: Callable[[], float] = time.perf_counter
    name: str = NAME
    uses: tuple[str, ...] = (NAME,)
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


def catch_up_ends(tokens: int, chunk: int = CATCH_UP_CHUNK, first: int = CATCH_UP_FIRST) -> list[int]:
    """Where the calls of a catch-up on ``tokens`` tokens end: after ``first`` tokens
    if ``tokens`` is over two chunks (else after one chunk), then every ``chunk``
    tokens, then the end."""
    if tokens <= 0:
        return []
    return [*range(first if tokens > 2 * chunk else chunk, tokens, chunk), tokens]


# Before anything is measured a draft step is taken to cost this fraction of a
# target step (a draft about a tenth of the target's size, memory-bound).
ENTRY = DrafterEntry(NAME, build=lambda options: options.model(), prior_cost=0.3)
