"""The CPU reference engine: one transformers causal LM, greedy/sampled
generation, one-pass verification of draft tokens, prefix KV-cache reuse.

Semantics follow TensorRT-LLM's ``draft_tokens_external`` mode
(coordinator/engine_semantics.py): with k draft tokens the engine runs one
forward pass over the new tokens plus the k drafts and returns the accepted
prefix plus one token of its own; acceptance is token matching, or rejection
sampling against softmax(draft_logits) when they are given. The end token is
not returned, and each call's random numbers come from its own seed."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from coordinator.cpu_engine import attention as attention_module
from coordinator.cpu_engine.kv_pool import PrefixCachePool
from coordinator.cpu_engine.quantize import check_scheme, quantize_linear_layers
from coordinator import engine_semantics
from coordinator.sampling import SamplingParams

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
    "decode_rows",
    "weight_quantization",
}
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

    Measured (python -m coordinator.cpu_engine.measure): with native bf16 a
    bf16 forward over 8 tokens costs what one token costs; without it bf16
    arithmetic is emulated and only float32 verifies several tokens cheaply.
    """
    if name == "auto":
        return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return name


class EngineRequestError(ValueError):
    """The request violates the engine's limits (named field, stated limit)."""


@dataclass
class EngineRequest:
    input_ids: np.ndarray
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    draft_tokens: np.ndarray | None = None
    draft_logits: np.ndarray | None = None  # [k, vocab]
    return_logits: bool = False


@dataclass
class EngineResult:
    tokens: list[int]
    logits: np.ndarray | None = None  # [len(tokens), vocab] float32
    reused_tokens: int = 0  # prompt tokens served from the KV-cache pool


def release_free_heap() -> bool:
    """Give the heap memory freed while loading (checkpoint buffers, the
    quantization's temporaries) back to the OS. glibc keeps freed pages
    resident: without this an engine started up to a GB larger than it needed
    to, and that slack hid its later growth from RSS. False outside glibc."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


class CausalLMEngine:
    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        num_threads: int = 2,
        max_cached_sequences: int = 8,
        max_context_tokens: int = 4096,
        decode_rows: int = 0,
        weight_quantization: str = "none",
    ):
        self.dtype = resolve_dtype(dtype)
        if decode_rows < 0:
            raise ValueError(f"decode_rows must be >= 0, got {decode_rows}")
        # none, int8 or int4 weight-only linear layers (coordinator/cpu_engine/quantize.py):
        # for the draft, whose precision only changes the acceptance rate.
        self.weight_quantization = check_scheme(weight_quantization)
        self.decode_rows = decode_rows
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        # Fixed-row decoding also needs attention whose per-row result does not
        # depend on the rest of the block (see coordinator/cpu_engine/attention.py).
        attention = {"attn_implementation": attention_module.NAME} if decode_rows > 0 else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[self.dtype], **attention)
        self.model.eval()
        self.quantized_layers = quantize_linear_layers(self.model, weight_quantization)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context_tokens = max_context_tokens
        self.pool = PrefixCachePool(max_cached_sequences)
        release_free_heap()

    @torch.inference_mode()
    def run(self, request: EngineRequest) -> EngineResult:
        input_ids = np.asarray(request.input_ids, dtype=np.int64).reshape(-1)
        drafts = [] if request.draft_tokens is None else [int(t) for t in np.asarray(request.draft_tokens).reshape(-1)]
        self._check(request, input_ids, drafts)
        cache, reused = self.pool.take(input_ids)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        else:
            cache.crop(reused - cache.get_seq_length())
        # Everything but the last input token goes in as context; the last one
        # is decoded (alone or with the drafts) so its logits come out.
        self._prefill(input_ids[reused:-1], cache)
        if drafts:
            result, cached_tokens = self._verify(request, input_ids, drafts, cache)
        else:
            result, cached_tokens = self._generate(request, input_ids, cache)
        # Only a cache that finished cleanly goes back to the pool.
        self.pool.put(cached_tokens, cache)
        result.reused_tokens = reused
        return result

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
        if request.draft_logits is not None and drafts:
            shape = tuple(np.shape(request.draft_logits))
            if shape != (len(drafts), self.vocab_size):
                raise EngineRequestError(
                    f"draft_logits must have shape [{len(drafts)}, {self.vocab_size}] "
                    f"(draft tokens x vocabulary), got {list(shape)}"
                )

    def _forward(self, tokens, cache: DynamicCache, logits_to_keep: int = 0) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).unsqueeze(0)
        output = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        return output.logits[0].float()

    def _prefill(self, tokens: np.ndarray, cache: DynamicCache) -> None:
        """Put context tokens into the cache (no logits needed)."""
        if len(tokens):
            self._forward(tokens, cache, logits_to_keep=1)

    def _decode(self, tokens: list[int], cache: DynamicCache) -> torch.Tensor:
        """Logits for each of ``tokens``, computed in forwards of exactly ``decode_rows`` rows.

        CPU kernels pick different code paths (and so different rounding) for
        different numbers of rows; with a fixed shape, a token's logits do not
        depend on whether it was decoded alone or verified with k others, so
        greedy speculation is bitwise-identical to plain decoding. Padding rows
        come after the real ones (causal attention: they cannot change them)
        and are cropped from the cache.
        """
        rows = self.decode_rows
        if rows <= 0:
            return self._forward(tokens, cache)
        blocks = []
        for start in range(0, len(tokens), rows):
            block = list(tokens[start : start + rows])
            real = len(block)
            with attention_module.real_rows(real):
                blocks.append(self._forward(block + [0] * (rows - real), cache)[:real])
            if real < rows:
                cache.crop(real - rows)
        return torch.cat(blocks)

    def _verify(self, request, input_ids, drafts, cache):
        logits = self._decode([int(input_ids[-1]), *drafts], cache).numpy()
        call = engine_semantics.verify(
            logits, drafts, request.draft_logits, request.max_new_tokens, request.sampling, request.end_id
        )
        return self._result(request, input_ids, call, cache)

    def _generate(self, request, input_ids, cache):
        def step(token: int) -> np.ndarray:
            return self._decode([token], cache)[-1].numpy()

        call = engine_semantics.generate(
            step, int(input_ids[-1]), request.max_new_tokens, request.sampling, request.end_id
        )
        return self._result(request, input_ids, call, cache)

    def _result(self, request, input_ids, call, cache):
        """The result, and the tokens whose KV the cache keeps (the cache is cut to them)."""
        cached_tokens = np.concatenate([input_ids, call.tokens[: call.fed]]).astype(np.int64)
        cache.crop(cached_tokens.size - cache.get_seq_length())
        logits = None
        if request.return_logits:
            rows = [np.asarray(row, dtype=np.float32) for row in call.logits]
            logits = np.stack(rows) if rows else np.zeros((0, self.vocab_size), dtype=np.float32)
        return EngineResult(call.tokens, logits), cached_tokens
