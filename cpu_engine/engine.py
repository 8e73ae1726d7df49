"""The CPU reference engine: one transformers causal LM serving many calls at
once (in-flight batching, cpu_engine/scheduler.py), greedy or
sampled generation, one-pass verification of draft tokens, prefix KV-cache
reuse.

Semantics follow TensorRT-LLM's ``draft_tokens_external`` mode
(trtllm_emulation/calls.py): with k draft tokens the engine runs one
forward pass over the new tokens plus the k drafts and returns the accepted
prefix plus one token of its own; acceptance is token matching, or rejection
sampling against softmax(draft_logits) when they are given. The end token is
not returned, and each call's random numbers come from its own seed.

Every forward is packed: the new tokens of all calls it carries are rows of
one block through the linear layers, attention runs per sequence
(cpu_engine/attention.py), and the number of rows follows the
row shape measured at start-up (cpu_engine/rows.py), so a row's
logits do not depend on what else the forward carried."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from trtllm_emulation.requests import EngineRequest, EngineRequestError  # noqa: F401 (this module's API)
from cpu_engine.heap import release_free_heap, retain_freed_memory
from cpu_engine import attention
from cpu_engine.kv_pool import PrefixCachePool
from cpu_engine.packed import choose_linear_kernel
from cpu_engine.quantize import check_scheme, choose_dense_rows, quantize_linear_layers
from cpu_engine.prompt_blocks import measure_prompt_block, prompt_path
from cpu_engine.row_blocks import block_linear_layers, merged_runs, prompt_rows, shaping
from cpu_engine.rows import MAX_BLOCK_ROWS, RowShape, measure_row_shape
from cpu_engine.scheduler import Call, Scheduler, Work

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Parameters of configs/cpu.pbtxt this engine understands.
KNOWN_PARAMETERS = {
    "model_dir",
    "dtype",
    "num_threads",
    "max_cached_sequences",
    "max_context_tokens",
    "exclude_input_in_output",
    "enable_kv_cache_reuse",
    "max_num_tokens",
    "max_draft_len",
    "row_invariant",
    "weight_quantization",
    "linear_kernel",
    "prompt_block",
    "reload_generation",  # set by the engine watchdog to reload the model in place (selfheal/triton_admin.py); unused
}
# Drafts one verification may carry unless configured: one attention block.
DEFAULT_MAX_DRAFT_LEN = attention.BLOCK_ROWS - 1
# Neither layer type is masked by transformers: packed_attention masks per sequence.
_NO_MASKS = {"full_attention": None, "sliding_attention": None}
_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True where the CPU computes in bfloat16 natively (AVX512-BF16 or AMX)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as file:
                cpuinfo = file.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return bool(_NATIVE_BF16_FLAGS & set(line.split(":", 1)[1].split()))
    return False


def resolve_dtype(name: str, cpuinfo: str | None = None) -> str:
    """``auto``: bfloat16 where the CPU has native bfloat16 arithmetic, else float32.

    Measured (python -m tools.measure_forwards): with native bf16 a
    bf16 forward over 8 tokens costs what one token costs; without it bf16
    arithmetic is emulated and only float32 verifies several tokens cheaply.
    """
    if name == "auto":
        return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return name


@dataclass
class EngineResult:
    tokens: list[int]
    logits: np.ndarray | None = None  # [len(tokens), vocab] float32
    reused_tokens: int = 0  # prompt tokens served from the KV-cache pool
    log_probs: list[float] | None = None  # each token's, when the request asked (return_log_probs)


def _add_segment(segments: list[attention.Segment], segment: attention.Segment) -> None:
    """Append ``segment``, joined to the last one where it goes on the same
    sequence's prompt rows: a prompt's last token (its own work, a logits row)
    then shares its prompt block's attention call with the rows before it, which
    had one call each (0.11 s of a 2,150-token prompt's prefill on a 2-vCPU Intel
    Xeon with AMX). A prompt block's rows do not depend on its other rows
    (``attention.prompt_blocks_agree``), so the result is bitwise the same."""
    last = segments[-1] if segments else None
    if (last is not None and last.kv is segment.kv and last.stop == segment.start
            and last.prompt_rows == last.stop - last.start):
        segments[-1] = attention.Segment(last.start, segment.stop, segment.kv, last.prompt_rows + segment.prompt_rows)
    else:
        segments.append(segment)


INVARIANCE_MODES = {"true": "always", "sampled": "sampled", "false": "never"}
# The most rows one kernel call of a "sampled" engine is measured at (and so computes).
SAMPLED_BLOCK_ROWS = 2 * attention.BLOCK_ROWS


def invariance_mode(row_invariant: bool | str) -> str:
    """``row_invariant`` as configured: true (every forward keeps the measured row
    shape), sampled (only forwards carrying a sampled call's rows) or false."""
    if isinstance(row_invariant, bool):
        return "always" if row_invariant else "never"
    mode = INVARIANCE_MODES.get(str(row_invariant).strip().lower())
    if mode is None:
        raise ValueError(f"row_invariant must be one of {', '.join(INVARIANCE_MODES)}, got {row_invariant!r}")
    return mode


class CausalLMEngine:
    """``submit`` calls and ``step`` forwards (the Triton model does both from
    its own threads); ``run`` serves one request to its end."""

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        num_threads: int = 2,
        max_cached_sequences: int = 8,
        max_context_tokens: int = 4096,
        max_num_tokens: int = 64,
        max_draft_len: int = DEFAULT_MAX_DRAFT_LEN,
        row_invariant: bool | str = True,
        weight_quantization: str = "none",
        linear_kernel: str = "auto",
        prompt_block: str = "auto",
    ):
        self.dtype = resolve_dtype(dtype)
        if max_num_tokens < attention.BLOCK_ROWS:
            raise ValueError(f"max_num_tokens must be at least {attention.BLOCK_ROWS}, got {max_num_tokens}")
        if not 0 <= max_draft_len < max_num_tokens:
            raise ValueError(f"max_draft_len must be between 0 and max_num_tokens - 1 ({max_num_tokens - 1}), "
                             f"got {max_draft_len}")
        # The longest verification (max_draft_len drafts plus the last token)
        # always fits one forward, also where every forward has one fixed size.
        self.max_draft_len = max_draft_len
        # none, int8 or int4 weight-only linear layers (cpu_engine/quantize.py):
        # for the draft, whose precision only changes the acceptance rate.
        self.weight_quantization = check_scheme(weight_quantization)
        self.num_threads = num_threads
        self.bind_thread()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[self.dtype], attn_implementation=attention.NAME)
        self.model.eval()
        self.quantized_layers = quantize_linear_layers(self.model, weight_quantization)
        # After loading, so the loader's buffers went back; before the start-up measurements,
        # so they see the heap the forwards will run on (cpu_engine/heap.py).
        retain_freed_memory()
        # Over how many rows a quantized layer uses its original weights, measured on this CPU.
        self.dense_rows = choose_dense_rows(self.model, max_num_tokens)
        # The float linear layers' kernel, measured on this machine (cpu_engine/packed.py).
        probed = min(max_num_tokens, MAX_BLOCK_ROWS)  # the most rows one kernel call is measured at
        self.linear_kernel = choose_linear_kernel(self.model, probed, linear_kernel)
        self.vocab_size = int(self.model.config.vocab_size)
        self.layers = int(self.model.config.num_hidden_layers)
        self.max_context_tokens = max_context_tokens
        # An entry of the same sequence goes on past its next call by the drafts
        # a verification fed and rejected at most (a plain stretch by none).
        self.pool = PrefixCachePool(max_cached_sequences, tail=max_draft_len,
                                    copy_prefix=lambda sequence, length: sequence.prefix(length),
                                    path_agreement=self._path_agreement)
        # The target's rows must not depend on their batch-mates (lossless greedy
        # speculation): every forward keeps the measured row shape. The draft only
        # proposes: its invariance buys only a seeded sampled request's repeatable
        # text, so it keeps the shape only in forwards that carry a sampled call's rows.
        self.invariance = invariance_mode(row_invariant)
        fixed_rows = max(attention.BLOCK_ROWS, min(max_draft_len + 1, probed))
        # Only a sampled call's rows keep the draft's shape, and the start-up probe costs
        # the square of its budget: a draft's kernel calls are measured up to two blocks.
        budget = probed if self.invariance == "always" else min(probed, SAMPLED_BLOCK_ROWS)
        measured = (RowShape(floor=1, budget=max_num_tokens) if self.invariance == "never"
                    else measure_row_shape(self.model, budget, min(fixed_rows, budget)))
        # Where every forward keeps the shape, a prompt's leading blocks may go through
        # larger calls, measured here (cpu_engine/prompt_blocks.py); a prompt block
        # must fit one forward.
        chosen = None
        if self.invariance == "always" and measured.fixed is None:
            chosen = measure_prompt_block(self.model, measured.block, prompt_block)
            if chosen is not None and chosen.rows > max_num_tokens:
                log.info("prompt block: none (%d rows do not fit max_num_tokens %d)", chosen.rows, max_num_tokens)
                chosen = None
        self.prompt_block = chosen
        block = chosen.rows if chosen else None
        # A forward carries up to max_num_tokens rows; its linear layers run in
        # blocks of the measured shape (cpu_engine/row_blocks.py).
        self.row_shape = replace(measured, forward_rows=max_num_tokens, prompt_block=block)
        if self.invariance != "never":  # no forward is shaped: the layers stay as they are
            block_linear_layers(self.model)
        # How many attention blocks of one key length one matmul computes, where that
        # keeps each block's bits (always, where no forward need keep them).
        self.attention_stack = max(attention.STACKS)
        if self.invariance != "never":
            started = time.perf_counter()
            self.attention_stack = attention.measure_stack(*attention.model_heads(self.model.config),
                                                           DTYPES[self.dtype], max_context_tokens)
            log.info("attention: up to %d blocks of one key length a matmul (measured in %.1f s)",
                     self.attention_stack, time.perf_counter() - started)
        # A prompt's blocks attend in one call a block where their rows do not depend on each other here.
        self.prompt_attention = bool(block) and attention.prompt_blocks_agree(
            *attention.model_heads(self.model.config), DTYPES[self.dtype], block, max_context_tokens)
        if block:
            log.info("attention: a prompt's blocks %s", "in one call a block" if self.prompt_attention
                     else "in 8-row blocks (a block's rows depend on its others here)")
        # Next to running streams a prompt's prefill takes one block a forward,
        # so it delays their next token by about one block's cost.
        self.scheduler = Scheduler(self.row_shape.capacity, shared_prefill=self.row_shape.block,
                                   prompt_block=self.row_shape.prompt_block)
        self.last_forward = (0, 0)  # (sequences, rows) of the latest forward: the load metrics
        self.last_forward_rows = 0
        self.forwards = 0  # forward passes run so far
        release_free_heap()

    def _path_agreement(self, one: int, other: int) -> int:
        """How many leading positions two prompt paths compute alike (the pool's rule)."""
        return self.prompt_block.agreement(one, other) if self.prompt_block else min(one, other)

    def bind_thread(self) -> None:
        """Use ``num_threads`` threads for the calling thread's forwards (OpenMP's
        setting is per thread: the thread that runs the forwards must call this)."""
        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)

    def submit(self, request: EngineRequest, on_tokens=None) -> Call:
        """Check a request and queue it for the next forwards (EngineRequestError when it is invalid)."""
        input_ids = np.asarray(request.input_ids, dtype=np.int64).reshape(-1)
        drafts = [] if request.draft_tokens is None else [int(t) for t in np.asarray(request.draft_tokens).reshape(-1)]
        self._check(request, input_ids, drafts)
        path = prompt_path(request.prompt_length, input_ids.size, self.prompt_block)
        sequence, reused = self.pool.take(input_ids, path)
        if sequence is None:
            sequence = attention.SequenceKV(self.layers)
        else:
            sequence.crop(reused)
        call = Call(input_ids, request.max_new_tokens, request.sampling, request.end_id, drafts,
                    request.draft_logits, sequence, reused, on_tokens, request.return_logits,
                    stop_words=request.stop_words, prompt_path=path)
        self.scheduler.add(call)
        return call

    def pending(self) -> int:
        return len(self.scheduler)

    @torch.inference_mode()
    def step(self) -> list[Call]:
        """One forward over what the scheduler picks; returns the calls it finished.
        A finished call's cache goes back to the pool; a failed call's is dropped."""
        works = self.scheduler.next_forward()
        if not works:
            return []
        try:
            logits = self._forward(works)
        except Exception as error:  # the calls of this forward fail; the engine keeps serving
            return self.scheduler.fail_all(works, error)
        done = self.scheduler.finish(works, logits)
        for call in done:
            if call.result is not None:
                tokens = call.cached_tokens()
                call.sequence.crop(tokens.size)
                self.pool.put(tokens, call.sequence, call.prompt_path)
        return done

    def fail_all(self, error: BaseException) -> list[Call]:
        """Fail every call in flight (their caches are dropped); returns them."""
        return self.scheduler.fail_all(list(self.scheduler.calls), error)

    def run(self, request: EngineRequest) -> EngineResult:
        call = self.submit(request)
        while not call.finished:
            self.step()
        return self.result(call)

    def result(self, call: Call) -> EngineResult:
        """The finished call's result (its error raised)."""
        if call.error is not None:
            raise call.error
        logits = None
        if call.return_logits:
            rows = [np.asarray(row, dtype=np.float32) for row in call.result.logits]
            logits = np.stack(rows) if rows else np.zeros((0, self.vocab_size), dtype=np.float32)
        return EngineResult(list(call.result.tokens), logits, call.reused, call.result.log_probs)

    def _check(self, request: EngineRequest, input_ids: np.ndarray, drafts: list[int]) -> None:
        if input_ids.size == 0:
            raise EngineRequestError("input_ids is empty")
        if request.max_new_tokens < 1:
            raise EngineRequestError(f"request_output_len must be at least 1, got {request.max_new_tokens}")
        bad = input_ids[(input_ids < 0) | (input_ids >= self.vocab_size)]
        if bad.size or any(not 0 <= t < self.vocab_size for t in drafts):
            raise EngineRequestError(f"token ids must be in [0, {self.vocab_size}) for this model")
        needed = input_ids.size + max(request.max_new_tokens, len(drafts) + 1)
        if needed > self.max_context_tokens:
            raise EngineRequestError(
                f"input_ids ({input_ids.size} tokens) plus request_output_len exceeds max_context_tokens "
                f"{self.max_context_tokens}"
            )
        if len(drafts) > self.max_draft_len:
            raise EngineRequestError(
                f"draft_input_ids ({len(drafts)} tokens) exceeds max_draft_len {self.max_draft_len}")
        if request.draft_logits is not None and drafts:
            shape = tuple(np.shape(request.draft_logits))
            if shape != (len(drafts), self.vocab_size):
                raise EngineRequestError(
                    f"draft_logits must have shape [{len(drafts)}, {self.vocab_size}] "
                    f"(draft tokens x vocabulary), got {list(shape)}"
                )

    def _prompt_runs(self, path: int, cached: int, start: int, rows: int) -> list[tuple[int | None, int, int]]:
        """A work's ``rows`` prompt-path rows (positions ``cached``..) from forward row
        ``start``, cut where the size of the call that computes them changes."""
        if not rows:
            return []
        whole = path // self.prompt_block.rows * self.prompt_block.rows
        in_whole = max(0, min(rows, whole - cached))
        return [(self.prompt_block.rows, start, start + in_whole),
                (self.prompt_block.call_of(path, whole), start + in_whole, start + rows)]

    def _forward(self, works: list[Work]) -> list[np.ndarray | None]:
        """One packed forward over the works' rows (padded to the row shape);
        the logits rows of the works that want them."""
        ids: list[int] = []
        positions: list[int] = []
        segments: list[attention.Segment] = []
        wanted: list[int] = []
        runs: list[tuple[int | None, int, int]] = []  # (call size, start, stop): see row_blocks.prompt_rows
        earlier: dict[int, int] = {}  # rows of this forward already given to a sequence (its prefill's last chunk)
        for work in works:
            key = id(work.call.sequence)
            start, cached = len(ids), work.call.sequence.get_seq_length() + earlier.get(key, 0)
            earlier[key] = earlier.get(key, 0) + len(work.tokens)
            ids += work.tokens
            positions += range(cached, cached + len(work.tokens))
            # a prompt's leading rows on its path: prefill rows, and the prompt's last token (a logits row)
            in_blocks = max(0, min(len(work.tokens), work.call.prompt_path - cached))
            _add_segment(segments, attention.Segment(start, len(ids), work.call.sequence, in_blocks))
            if work.logits:
                wanted += range(start, len(ids))
            runs += self._prompt_runs(work.call.prompt_path, cached, start, in_blocks)
            runs.append((None, start + in_blocks, len(ids)))
        real = len(ids)
        shaped = self.invariance == "always" or (self.invariance == "sampled"
                                                 and any(not work.call.sampling.greedy for work in works))
        total = self.row_shape.rows(real) if shaped else real
        if total > real:
            segments.append(attention.Segment(real, total, None))
            ids += [0] * (total - real)
            positions += [0] * (total - real)
        self.last_forward = (len({id(work.call) for work in works}), real)
        self.last_forward_rows = total  # as computed, padding included
        self.forwards += 1
        runs.append((None, real, total))
        marked = shaped and any(size for size, _, _ in runs)
        block = self.row_shape.prompt_block if shaped and self.prompt_attention else 0
        with attention.packed(segments, self.attention_stack, block), shaping(self.row_shape if shaped else None):
            with prompt_rows(merged_runs(runs) if marked else None):
                hidden = self.model.model(
                    input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                    attention_mask=_NO_MASKS, use_cache=False,
                ).last_hidden_state[0]
            logits = None
            if wanted:
                # the output layer is one more linear: the same row rule applies
                picked = wanted + [wanted[0]] * ((self.row_shape.rows(len(wanted)) if shaped else 0) - len(wanted))
                logits = self.model.lm_head(hidden[picked]).float().numpy()
        out: list[np.ndarray | None] = []
        row = 0
        for work in works:
            if work.logits:
                out.append(logits[row : row + len(work.tokens)])
                row += len(work.tokens)
            else:
                out.append(None)
        return out
