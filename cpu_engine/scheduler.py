"""In-flight batching for the CPU engine, the way TensorRT-LLM's batcher works:
calls of many requests join the next forward as they arrive, and one forward
carries the decode rows, verification rows and prompt-prefill chunks of
several sequences, up to a row budget.

A call goes through two phases (the forward that ends a prompt's prefill
carries its first decode rows too, where they fit). Prefill puts the prompt tokens not found in
the prefix-cache pool into its sequence's cache, in chunks: a whole forward's
budget when no stream is decoding, and at most ``shared_prefill`` rows next to
running streams' decode rows, so a long prompt delays each of their tokens by
about one such chunk's cost and never stalls them. Decode then feeds the last input
token (with the k drafts of a verification) and, for plain decoding, one new
token per forward until the call is finished. Decode rows go first; each
forward takes whole calls in arrival order. Prefill chunks then go shortest
remaining prefill first: a running stream's catch-up of a few tokens (a draft
call after a verified round) is a round waiting on it, while a long prompt's
prefill (a new request, the draft's background warm-up) only gives up those
few rows; in arrival order, that catch-up waited behind every prompt queued
before it. A forward that holds a block of rows (``shared_prefill``) and ends a
prompt takes no further prompt: past a block a CPU forward's time grows with
its rows, so a second prompt in it would delay the first one's first token by
its whole prefill and gain nothing itself. Prompts that arrive together are
prefilled one after another, shortest first, and their first tokens come in
turn: four 150-token prompts prefilled in one 512-row forward all waited
3.8 s; in turn the first waited about 1.2 s. A prompt's leading whole blocks
that go through larger kernel calls (``prompt_block`` rows,
cpu_engine/prompt_blocks.py) are taken a whole block at a time: next to
running streams one such block a forward, in place of ``shared_prefill`` rows.

No torch here: the engine supplies ``forward(works)``, which runs one packed
forward and returns each work's logits (tests drive the scheduler with a fake).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from trtllm_emulation import calls
from trtllm_emulation.calls import CallResult, PlainDecoding
from coordinator.sampling.params import SamplingParams


@dataclass
class Work:
    """One call's rows in a forward: ``tokens`` appended to ``sequence``'s cache;
    ``logits`` whether the forward must return a logits row per token."""

    call: "Call"
    tokens: list[int]
    logits: bool


@dataclass(eq=False)
class Call:
    """One engine request in flight. ``sequence`` is the engine's cache object
    for it (opaque here); ``input_ids[:reused]`` are already in it."""

    input_ids: np.ndarray
    max_new_tokens: int
    sampling: SamplingParams
    end_id: int | None
    drafts: list[int]
    draft_logits: np.ndarray | None
    sequence: object
    reused: int
    on_tokens: Callable[["Call", list[int]], None] | None = None  # streaming: new tokens as they come
    return_logits: bool = False
    result: CallResult | None = None
    error: BaseException | None = None
    stop_words: tuple[tuple[int, ...], ...] = ()
    prompt_path: int = 0  # leading positions computed through the prompt's kernel calls

    def __post_init__(self):
        self.prefilled = self.reused
        self.plain = None if self.drafts else PlainDecoding(self.max_new_tokens, self.sampling, self.end_id,
                                                            self.input_ids, self.stop_words)
        self.feed = [int(self.input_ids[-1]), *self.drafts]  # rows of the first decode forward

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def prefill_left(self) -> int:
        return len(self.input_ids) - 1 - self.prefilled

    def decode_rows(self) -> int:
        return 0 if self.prefill_left else len(self.feed)

    def absorb(self, work: Work, logits: np.ndarray | None) -> None:
        """Take the results of this call's rows in a forward."""
        if not work.logits:
            self.prefilled += len(work.tokens)
            return
        if self.plain is None:
            self.result = calls.verify(logits, self.drafts, self.draft_logits, self.max_new_tokens,
                                                  self.sampling, self.end_id, self.input_ids, self.stop_words)
            return
        before = len(self.plain.tokens)
        following = self.plain.next_token(logits[-1])
        if following is None:
            self.result = self.plain.result()  # finished first, so a streaming reader sees the last step as final
        else:
            self.feed = [following]
        new = self.plain.tokens[before:]
        if new and self.on_tokens is not None:
            self.on_tokens(self, new)

    def cached_tokens(self) -> np.ndarray:
        """The tokens whose keys and values the sequence's cache holds once the call is finished."""
        return np.concatenate([self.input_ids, np.asarray(self.result.tokens[: self.result.fed], dtype=np.int64)])


class Scheduler:
    """Calls waiting for a forward, and the choice of what the next one carries."""

    def __init__(self, capacity: int, shared_prefill: int | None = None, prompt_block: int | None = None):
        if capacity < 1:
            raise ValueError(f"a forward must carry at least one row, got {capacity}")
        self.capacity = capacity
        self.shared_prefill = min(capacity, shared_prefill or capacity)
        self.prompt_block = prompt_block
        self.calls: list[Call] = []

    def __len__(self) -> int:
        return len(self.calls)

    def add(self, call: Call) -> None:
        self.calls.append(call)

    def next_forward(self) -> list[Work]:
        """The works of the next forward: decode rows first (whole calls), then
        prefill chunks, shortest remaining prefill first (ties in arrival order):
        the rest of the budget, or at most ``shared_prefill`` rows next to decode
        rows. A call whose decode rows alone exceed the budget gets a forward of its own."""
        works: list[Work] = []
        used = 0
        for call in self.calls:
            rows = call.decode_rows()
            if rows and (used + rows <= self.capacity or not works):
                works.append(Work(call, list(call.feed), logits=True))
                used += rows
        room = self.capacity - used
        if works:
            room = min(room, self.shared_prefill)
        for call in sorted(self.calls, key=lambda call: call.prefill_left):  # stable: ties in arrival order
            if room <= 0:
                break
            left = call.prefill_left
            if left:
                chunk = self._chunk(call, left, room)
                start = call.prefilled
                works.append(Work(call, [int(t) for t in call.input_ids[start : start + chunk]], logits=False))
                room -= chunk
                if chunk == left and (len(call.feed) <= room or call.prompt_path >= len(call.input_ids)):
                    # the prompt is in: its first decode rows ride in the same forward, so the
                    # first token does not wait for a forward of its own (past the room where the
                    # prompt's last token finishes its padded call: alone it would pad one of its own)
                    works.append(Work(call, list(call.feed), logits=True))
                    room -= len(call.feed)
                if chunk == left and self.capacity - room >= self.shared_prefill:
                    break  # one prompt ends here: the next one's prefill would only delay its first token
        return works

    def _chunk(self, call: Call, left: int, room: int) -> int:
        """Prompt rows of ``call`` the next forward takes: within the prompt's
        blocks up to a block's end (at least the end of the block it is in, more
        whole blocks as the room allows) and, once they are all in, what of the
        rest fits; past its blocks what fits. A chunk ends where a block does, so
        a cached prefix that ends inside a block (a reused preamble) does not make
        every later block's attention run in two forwards, once partly padded."""
        blocks_left = min(call.prompt_path - call.prefilled, left)  # the last token is a decode row
        if blocks_left <= 0 or not self.prompt_block:
            return min(left, room)
        block, start = self.prompt_block, call.prefilled
        end = max((start // block + 1) * block, (start + room) // block * block)
        take = min(blocks_left, end - start)
        if take == blocks_left:  # its blocks all in: the rest of the prompt as the room allows
            take += max(0, min(left - blocks_left, room - take))
        return take

    def finish(self, works: Sequence[Work], logits: Sequence[np.ndarray | None]) -> list[Call]:
        """Hand each work its logits; returns the calls that finished (removed)."""
        for work, rows in zip(works, logits):
            try:
                work.call.absorb(work, rows)
            except Exception as error:  # this call fails, the others go on
                work.call.error = error
        done = [call for call in self.calls if call.finished]
        self.calls = [call for call in self.calls if not call.finished]
        return done

    def fail_all(self, works: Sequence[Work | Call], error: BaseException) -> list[Call]:
        """A forward failed: its calls fail (their caches are in an unknown state)."""
        failed = {id(getattr(work, "call", work)) for work in works}
        done = []
        for call in self.calls:
            if id(call) in failed:
                call.error = error
                done.append(call)
        self.calls = [call for call in self.calls if not call.finished]
        return done
