"""The simulated engine: in-flight batching over the synthetic LM, with
TensorRT-LLM's semantics for each call (trtllm_emulation/calls.py) and a
forward time taken from a latency table by sleeping.

Batching follows TensorRT-LLM's executor: every forward carries every call in
flight, in arrival order, up to ``max_num_tokens`` rows (a call that alone
exceeds it gets a forward of its own); calls that arrive during a forward join
the next one, and no forward waits for them. A call's first forward carries
its context phase: the input tokens not found in the KV-cache pool (exact
prefixes of finished calls, as with ``enable_kv_cache_reuse``), the drafts of
a verification with them, and yields the first new token (or the verified
tokens); a plain call then takes one row per forward per new token.

Greedy calls without penalties, log probs or returned logits run calls.py on
compact rows: the tokens any of their rows, drafts or end id name, plus one
background slot for the rest, which holds the same values as the full row's
other tokens. Argmax over those equals argmax over the full row, so the
result is the one calls.py gives on the full rows (tests/unit/test_sim_engine.py
checks both); every other call runs on full rows of the real vocabulary."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim_engine.lm import BACKGROUND, SyntheticLM
from sim_engine.presets import StepTime
from trtllm_emulation import calls
from trtllm_emulation.calls import CallResult, PlainDecoding
from trtllm_emulation.requests import EngineRequest, EngineRequestError  # noqa: F401 (this module's API)

PREFIX_KEY = 8  # tokens that key the prefix pool's buckets (a prompt's first ones)
BUCKET = 8  # sequences kept per bucket, newest first


@dataclass
class SimResult:
    tokens: list[int]
    logits: np.ndarray | None = None
    reused_tokens: int = 0
    log_probs: list[float] | None = None


class _Compact:
    """A growing map of token ids to compact indices; index 0 stands for every other token."""

    def __init__(self):
        self.index: dict[int, int] = {}
        self.ids: list[int] = [-1]

    def of(self, token: int) -> int:
        i = self.index.get(token)
        if i is None:
            i = self.index[token] = len(self.ids)
            self.ids.append(token)
        return i

    def row(self, support: tuple[tuple[int, ...], tuple[float, ...]], size: int | None = None) -> np.ndarray:
        tokens, logits = support
        at = [self.of(t) for t in tokens]
        out = np.full(size or len(self.ids), BACKGROUND, dtype=np.float32)
        out[at] = logits
        return out


@dataclass(eq=False)
class SimCall:
    request: EngineRequest
    context: list[int]
    drafts: list[int]
    reused: int
    compact: _Compact | None
    on_tokens: Callable[["SimCall", list[int]], None] | None = None
    plain: PlainDecoding | None = None
    result: CallResult | None = None
    error: BaseException | None = None
    started: bool = False  # its context phase is done
    arrived: float | None = None  # when it reached the engine (the adapter's clock); None: when submitted

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def rows(self) -> int:
        if not self.started:
            return len(self.context) - self.reused + len(self.drafts)
        return 1


class SimEngine:
    """``submit`` calls and ``step`` forwards; ``run`` serves one call to its end.
    ``sleep=False`` skips the waits (tests)."""

    def __init__(self, lm: SyntheticLM, step_time: StepTime, max_num_tokens: int = 8192, max_draft_len: int = 8,
                 max_context_tokens: int = 4096, max_cached_sequences: int = 256, sleep: bool = True,
                 clock=time.monotonic, sleeper=time.sleep):
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.step_time = step_time
        self.max_num_tokens = max_num_tokens
        self.max_draft_len = max_draft_len
        self.max_context_tokens = max_context_tokens
        self.max_cached_sequences = max_cached_sequences
        self.sleep = sleep
        self.clock, self.sleeper = clock, sleeper
        self.calls: list[SimCall] = []
        self.pool: OrderedDict[tuple, list[np.ndarray]] = OrderedDict()  # first tokens -> cached sequences
        self.forwards = 0
        self.last_forward = (0, 0)  # (calls, rows)
        self.busy_seconds = 0.0  # what the forwards' own work took (not the sleeps)
        self.free_at = 0.0  # when the last forward's time was up

    # -- calls ---------------------------------------------------------------

    def submit(self, request: EngineRequest, on_tokens=None, arrived: float | None = None) -> SimCall:
        """``arrived``: when the call reached the engine, if before now (the forward
        that carries it may have begun then)."""
        input_ids = np.asarray(request.input_ids, dtype=np.int64).reshape(-1)
        drafts = [] if request.draft_tokens is None else [int(t) for t in np.asarray(request.draft_tokens).reshape(-1)]
        self._check(request, input_ids, drafts)
        sampling = request.sampling
        compact = None
        if sampling.greedy and sampling.penalties is None and not sampling.log_probs and not request.return_logits:
            compact = _Compact()
        call = SimCall(request, input_ids.tolist(), drafts, self._reused(input_ids), compact, on_tokens,
                       arrived=self.clock() if arrived is None else arrived)
        if not drafts:
            call.plain = PlainDecoding(request.max_new_tokens, sampling, self._end(call), input_ids)
        self.calls.append(call)
        return call

    def pending(self) -> int:
        return len(self.calls)

    def run(self, request: EngineRequest) -> SimResult:
        call = self.submit(request)
        while not call.finished:
            self.step()
        return self.result(call)

    def result(self, call: SimCall) -> SimResult:
        if call.error is not None:
            raise call.error
        tokens = list(call.result.tokens)
        if call.compact is not None:
            tokens = [call.compact.ids[t] for t in tokens]
        logits = None
        if call.request.return_logits:
            rows = [np.asarray(r, dtype=np.float32) for r in call.result.logits]
            logits = np.stack(rows) if rows else np.zeros((0, self.vocab_size), dtype=np.float32)
        return SimResult(tokens, logits, call.reused, call.result.log_probs)

    def fail_all(self, error: BaseException) -> list[SimCall]:
        done = list(self.calls)
        for call in done:
            call.error = error
        self.calls = []
        return done

    # -- forwards ------------------------------------------------------------

    def step(self) -> list[SimCall]:
        """One forward over the calls in flight; returns the calls it finished,
        after the forward's time has passed.

        The forward's time runs from when it could have begun: once the last
        forward's time was up and every call it carries had arrived, as an
        executor does that picks a call up as it is enqueued. The adapter's own
        work between a call's arrival and this step (reading its tensors in
        Python, waking this thread) is then inside the forward's time, as the
        C++ backend's is on a GPU host, not added to it."""
        if not self.calls:
            return []
        started = self.clock()
        carried, rows = [], 0
        for call in self.calls:
            need = call.rows()
            if carried and rows + need > self.max_num_tokens:
                continue
            carried.append(call)
            rows += need
        streamed: list[tuple[SimCall, list[int]]] = []
        for call in carried:
            try:
                new = self._advance(call)
            except Exception as error:  # this call fails, the others go on
                call.error = error
                continue
            if new and call.on_tokens is not None:
                streamed.append((call, new))
        self.forwards += 1
        self.last_forward = (len(carried), rows)
        self.busy_seconds += self.clock() - started
        begun = min(started, max([self.free_at, *(call.arrived for call in carried)]))
        self.free_at = begun + self.step_time.seconds(rows)
        if self.sleep:
            left = self.free_at - self.clock()
            if left > 0:
                self.sleeper(left)
        for call, new in streamed:
            call.on_tokens(call, new)
        done = [call for call in self.calls if call.finished]
        if done:
            self.calls = [call for call in self.calls if not call.finished]
            for call in done:
                if call.result is not None:
                    self._cache(call)
        return done

    def _advance(self, call: SimCall) -> list[int]:
        """Run the call's rows of this forward; returns the new tokens a streaming reader gets."""
        first = not call.started
        call.started = True
        end_id = self._end(call)
        request = call.request
        if call.plain is None:  # a verification: done in its first forward
            contexts = [call.context + call.drafts[:i] for i in range(len(call.drafts) + 1)]
            if call.compact is not None:
                drafts = [call.compact.of(t) for t in call.drafts]
                supports = [self.lm.row(c) for c in contexts]
                for tokens, _ in supports:
                    for t in tokens:
                        call.compact.of(t)
                size = len(call.compact.ids)
                rows = np.stack([call.compact.row(s, size) for s in supports])
                call.result = calls.verify(rows, drafts, None, request.max_new_tokens, request.sampling, end_id)
            else:
                rows = np.stack([self.lm.full_row(c) for c in contexts])
                call.result = calls.verify(rows, call.drafts, request.draft_logits, request.max_new_tokens,
                                           request.sampling, end_id, call.context)
            return []
        plain = call.plain
        context = call.context if first else call.context + self._tokens(call, plain.tokens)
        row = call.compact.row(self.lm.row(context)) if call.compact is not None else self.lm.full_row(context)
        before = len(plain.tokens)
        if plain.next_token(row) is None:
            call.result = plain.result()
        return self._tokens(call, plain.tokens[before:])

    def _tokens(self, call: SimCall, tokens: list[int]) -> list[int]:
        return tokens if call.compact is None else [call.compact.ids[t] for t in tokens]

    def _end(self, call: SimCall) -> int | None:
        end_id = call.request.end_id
        if end_id is None or call.compact is None:
            return end_id
        return call.compact.of(int(end_id))

    # -- the KV-cache pool (only what it saves in rows) -------------------------

    def _reused(self, input_ids: np.ndarray) -> int:
        """Input tokens found as a prefix of a cached sequence, all but the last at most."""
        bucket = self.pool.get(tuple(input_ids[:PREFIX_KEY].tolist()))
        best = 0
        limit = input_ids.size - 1
        for cached in bucket or ():
            n = min(limit, cached.size)
            differ = np.flatnonzero(cached[:n] != input_ids[:n])
            best = max(best, int(differ[0]) if differ.size else n)
        return best

    def _cache(self, call: SimCall) -> None:
        if self.max_cached_sequences <= 0:
            return
        tokens = self._tokens(call, call.result.tokens[: call.result.fed])
        sequence = np.asarray(call.context + tokens, dtype=np.int64)
        key = tuple(sequence[:PREFIX_KEY].tolist())
        bucket = self.pool.pop(key, [])
        bucket = [sequence, *bucket[: BUCKET - 1]]
        self.pool[key] = bucket
        while len(self.pool) > self.max_cached_sequences:
            self.pool.popitem(last=False)

    def _check(self, request: EngineRequest, input_ids: np.ndarray, drafts: list[int]) -> None:
        if input_ids.size == 0:
            raise EngineRequestError("input_ids is empty")
        if request.max_new_tokens < 1:
            raise EngineRequestError(f"request_output_len must be at least 1, got {request.max_new_tokens}")
        if ((input_ids < 0) | (input_ids >= self.vocab_size)).any() or any(
                not 0 <= t < self.vocab_size for t in drafts):
            raise EngineRequestError(f"token ids must be in [0, {self.vocab_size}) for this model")
        if input_ids.size + max(request.max_new_tokens, len(drafts) + 1) > self.max_context_tokens:
            raise EngineRequestError(f"input_ids ({input_ids.size} tokens) plus request_output_len exceeds "
                                  f"max_context_tokens {self.max_context_tokens}")
        if len(drafts) > self.max_draft_len:
            raise EngineRequestError(f"draft_input_ids ({len(drafts)} tokens) exceeds max_draft_len {self.max_draft_len}")
        if request.draft_logits is not None and drafts:
            shape = tuple(np.shape(request.draft_logits))
            if shape != (len(drafts), self.vocab_size):
                raise EngineRequestError(f"draft_logits must have shape [{len(drafts)}, {self.vocab_size}] "
                                      f"(draft tokens x vocabulary), got {list(shape)}")
