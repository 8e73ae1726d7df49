"""NVIDIA's request interface (the ``ensemble`` and ``tensorrt_llm_bls`` models
of tensorrtllm_backend's ``inflight_batcher_llm`` repository, v0.17) mapped
onto the coordinator's inputs, so clients written for those models work
unchanged.

Pure numpy: ``translate`` turns one request's input tensors (leading batch
dim, NVIDIA's names) into one coordinator request per batch item; the Triton
adapter (``coordinator/triton/tensorrt_llm_bls_model.py``) sends them and shapes the answers.
Every input NVIDIA defines is declared: the ones this server implements are
mapped, the ones that cannot change a text output here are accepted, and the
rest are refused by name whenever a request sets them to anything but their
neutral value, so nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
import numpy as np
from coordinator.request.api import STATISTICS
from coordinator.engines.contract import TensorSpec
from coordinator.request.parse import InputError

COORDINATOR_MODEL = "coordinator"


def _spec(name: str, data_type: str, dims=(1,), meaning: str = "", optional: bool = True) -> TensorSpec:
    return TensorSpec(name, data_type, tuple(dims), meaning, optional)


# Every input of NVIDIA's tensorrt_llm_bls model, with its dims (per batch item).
INPUTS: tuple[TensorSpec, ...] = (
    _spec("text_input", "TYPE_STRING", meaning="the prompt", optional=False),
    _spec("max_tokens", "TYPE_INT32", meaning="most tokens to generate", optional=False),
    _spec("stream", "TYPE_BOOL", meaning="a response per chunk of text (then without the prompt)"),
    _spec("exclude_input_in_output", "TYPE_BOOL", meaning="false (default): a non-streamed output starts with the prompt"),
    _spec("temperature", "TYPE_FP32", meaning="sampling temperature; sampling needs top_k or top_p as well"),
    _spec("top_k", "TYPE_INT32", meaning="sample among the k likeliest tokens; top_k 0 with top_p 0: greedy"),
    _spec("top_p", "TYPE_FP32", meaning="nucleus sampling mass; top_k 0 with top_p 0: greedy"),
    _spec("random_seed", "TYPE_UINT64", meaning="seed of a sampled request"),
    _spec("stop_words", "TYPE_STRING", (-1,), "strings that end the completion (not included)"),
    _spec("end_id", "TYPE_INT32", meaning="the token that ends the completion"),
    _spec("pad_id", "TYPE_INT32", meaning="pads output_ids, which a text output never carries: no effect here"),
    _spec("num_draft_tokens", "TYPE_INT32", meaning="tokens drafted per round (0: plain decoding; absent: adaptive)"),
    _spec("use_draft_logits", "TYPE_BOOL", meaning="sampled requests: verify against the draft's distribution"),
    _spec("beam_width", "TYPE_INT32", meaning="1 only: speculative decoding is a single-beam method"),
    _spec("num_return_sequences", "TYPE_INT32", meaning="1 only"),
    _spec("length_penalty", "TYPE_FP32", meaning="scores beams; with beam_width 1 it has no effect (as in TensorRT-LLM)"),
    _spec("min_length", "TYPE_INT32", meaning="as the coordinator's input of that name"),
    _spec("repetition_penalty", "TYPE_FP32", meaning="as the coordinator's input of that name"),
    _spec("presence_penalty", "TYPE_FP32", meaning="as the coordinator's input of that name"),
    _spec("frequency_penalty", "TYPE_FP32", meaning="as the coordinator's input of that name"),
    _spec("bad_words", "TYPE_STRING", (-1,), "strings the completion must not produce"),
    _spec("return_log_probs", "TYPE_BOOL", meaning="output_log_probs and cum_log_probs on the final response"),
    _spec("return_context_logits", "TYPE_BOOL", meaning="not supported: false only"),
    _spec("return_generation_logits", "TYPE_BOOL", meaning="not supported: false only"),
    _spec("return_kv_cache_reuse_stats", "TYPE_BOOL", meaning="not supported: false only"),
    _spec("prompt_embedding_table", "TYPE_FP16", (-1, -1), "prompt tuning: not supported"),
    _spec("prompt_vocab_size", "TYPE_INT32", meaning="prompt tuning: not supported"),
    _spec("prompt_table_extra_id", "TYPE_UINT64", meaning="prompt tuning: not supported"),
    _spec("embedding_bias_words", "TYPE_STRING", (-1,), "embedding bias: not supported"),
    _spec("embedding_bias_weights", "TYPE_FP32", (-1,), "embedding bias: not supported"),
    _spec("lora_task_id", "TYPE_UINT64", meaning="LoRA: not supported"),
    _spec("lora_weights", "TYPE_FP16", (-1, -1), "LoRA: not supported"),
    _spec("lora_config", "TYPE_INT32", (-1, 3), "LoRA: not supported"),
    _spec("decoder_text_input", "TYPE_STRING", meaning="encoder-decoder models: not supported"),
    _spec("image_input", "TYPE_FP16", (-1, 3, -1, -1), "multimodal: not supported"),
    _spec("image_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1), "multimodal: not supported"),
    _spec("image_url_input", "TYPE_STRING", meaning="multimodal: not supported"),
    _spec("video_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1), "multimodal: not supported"),
)
INPUT_NAMES = tuple(spec.name for spec in INPUTS)
# The ensemble takes the same inputs but the multimodal ones (NVIDIA's ensemble has
# none of those; it has no speculative ones either, which are kept here).
ENSEMBLE_INPUT_NAMES = tuple(n for n in INPUT_NAMES if n not in ("image_input", "image_bytes_input",
                                                                  "image_url_input", "video_bytes_input"))

OUTPUTS: tuple[TensorSpec, ...] = (
    _spec("text_output", "TYPE_STRING", (-1,), "the text (a chunk of it when streaming)", optional=False),
    _spec("batch_index", "TYPE_INT32", meaning="which batch item a response belongs to", optional=False),
    _spec("sequence_index", "TYPE_INT32", meaning="which of num_return_sequences (always 0)", optional=False),
    _spec("cum_log_probs", "TYPE_FP32", (-1,), "with return_log_probs: their sum [1, 1]", optional=False),
    _spec("output_log_probs", "TYPE_FP32", (-1, -1),
          "with return_log_probs: each generated token's [1, 1, n], on the final response", optional=False),
    _spec("context_logits", "TYPE_FP32", (-1, -1), "not supported (return_context_logits is refused)",
          optional=False),
    _spec("generation_logits", "TYPE_FP32", (-1, -1, -1), "not supported (return_generation_logits is refused)",
          optional=False),
    # The coordinator's statistics, on the final response of each batch item.
    *STATISTICS,
)

# Inputs refused unless neutral: name -> (neutral value, why). Absent is neutral too.
_NEUTRAL: dict[str, tuple[object, str]] = {
    "return_context_logits": (False, "return_context_logits is not supported (no context_logits)"),
    "return_generation_logits": (False, "return_generation_logits is not supported (no generation_logits)"),
    "return_kv_cache_reuse_stats": (False, "return_kv_cache_reuse_stats is not supported"),
    "beam_width": (1, "beam_width must be 1: speculative decoding is a single-beam method"),
    "num_return_sequences": (1, "num_return_sequences must be 1"),
}
# Inputs refused whenever present (with a non-empty value).
_UNSUPPORTED = {
    "prompt_embedding_table": "prompt tuning (prompt_embedding_table) is not supported by this server",
    "prompt_vocab_size": "prompt tuning (prompt_vocab_size) is not supported by this server",
    "prompt_table_extra_id": "prompt tuning (prompt_table_extra_id) is not supported by this server",
    "embedding_bias_words": "embedding bias (embedding_bias_words) is not supported by this server",
    "embedding_bias_weights": "embedding bias (embedding_bias_weights) is not supported by this server",
    "lora_task_id": "LoRA (lora_task_id) is not supported by this server",
    "lora_weights": "LoRA (lora_weights) is not supported by this server",
    "lora_config": "LoRA (lora_config) is not supported by this server",
    "decoder_text_input": "decoder_text_input is for encoder-decoder models; this server serves a decoder-only pair",
    "image_input": "image_input: this server serves a text model pair (no multimodal encoder)",
    "image_bytes_input": "image_bytes_input: this server serves a text model pair (no multimodal encoder)",
    "image_url_input": "image_url_input: this server serves a text model pair (no multimodal encoder)",
    "video_bytes_input": "video_bytes_input: this server serves a text model pair (no multimodal encoder)",
}
# Coordinator input names as the client knows them (for its error messages).
CLIENT_NAMES = {"speculation_window": "num_draft_tokens"}


@dataclass(frozen=True)
class Item:
    """One batch item as a coordinator request, and how to shape its answer."""

    batch_index: int
    prompt: str
    inputs: dict[str, np.ndarray]  # coordinator input name -> array of its config dims
    stream: bool
    include_prompt: bool  # the final non-streamed text starts with the prompt


def translate(inputs: Mapping[str, np.ndarray | None]) -> list[Item]:
    """One coordinator request per batch item of a request in NVIDIA's format."""
    present = {name: np.asarray(value) for name, value in inputs.items() if value is not None}
    unknown = sorted(set(present) - set(INPUT_NAMES))
    if unknown:
        raise InputError(f"unknown input(s) {', '.join(unknown)}")
    if "text_input" not in present:
        raise InputError("text_input is required")
    batch = _batch_size(present)
    return [_item(present, index) for index in range(batch)]


def _batch_size(present: Mapping[str, np.ndarray]) -> int:
    sizes = {name: (array.shape[0] if array.ndim else 1) for name, array in present.items()}
    batch = sizes["text_input"]
    if batch < 1:
        raise InputError("text_input holds no prompt (batch size 0)")
    for name, size in sizes.items():
        if size != batch:
            raise InputError(f"{name} has batch size {size}, text_input has {batch}: every input needs one row "
                             "per prompt")
    return batch


def _item(present: Mapping[str, np.ndarray], index: int) -> Item:
    row = {name: (array[index] if array.ndim else array) for name, array in present.items()}
    for name, message in _UNSUPPORTED.items():
        if name in row and np.asarray(row[name]).size:
            raise InputError(message)
    for name, (neutral, message) in _NEUTRAL.items():
        value = _one(row, name)
        if value is not None and value != neutral:
            raise InputError(f"{message}; got {name} {_shown(value)}")

    prompt = _text(row, "text_input")
    stream = bool(_one(row, "stream") or False)
    exclude = _one(row, "exclude_input_in_output")
    max_tokens = _one(row, "max_tokens")
    if max_tokens is None:
        raise InputError("max_tokens is required")
    out: dict[str, np.ndarray] = {
        "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
        "max_tokens": _array(max_tokens, np.int32),
        "stream": np.array([stream], dtype=bool),
    }
    out.update(_sampling(row))
    for name, dtype in (("random_seed", np.uint64), ("end_id", np.int32), ("use_draft_logits", bool),
                        ("return_log_probs", bool),
                        ("min_length", np.int32), ("repetition_penalty", np.float32),
                        ("presence_penalty", np.float32), ("frequency_penalty", np.float32)):
        value = _one(row, name)
        if value is not None:
            out[name] = _array(value, dtype)
    draft_tokens = _one(row, "num_draft_tokens")
    if draft_tokens is not None:
        # NVIDIA's BLS drafts exactly num_draft_tokens each round: a fixed window here
        out["speculation_window"] = _array(draft_tokens, np.int32)
        out["adaptive_window"] = np.array([False])
    for name in ("stop_words", "bad_words"):
        words = _strings(row, name)
        if words:
            out[name] = np.array([w.encode("utf-8") for w in words], dtype=np.object_)
    return Item(index, prompt, out, stream, include_prompt=not stream and not bool(exclude))


def _sampling(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """temperature/top_k/top_p as TensorRT-LLM reads them: top_k and top_p
    default to 0, and top_k 0 with top_p 0 means greedy whatever the
    temperature (samplingTopKKernels.h, regularizeTopKTopP); top_k > 0 with
    top_p 0 samples top-k alone."""
    temperature = _one(row, "temperature")
    top_k = _one(row, "top_k")
    top_p = _one(row, "top_p")
    top_k = 0 if top_k is None else int(top_k)
    top_p = 0.0 if top_p is None else float(top_p)
    if top_k < 0:
        raise InputError(f"top_k must be >= 0, got {top_k}")
    if top_k == 0 and top_p == 0.0:
        return {"temperature": np.array([0.0], dtype=np.float32)}
    out = {"temperature": np.array([1.0 if temperature is None else float(temperature)], dtype=np.float32),
           "top_k": np.array([top_k], dtype=np.int32),
           "top_p": np.array([1.0 if top_p == 0.0 else top_p], dtype=np.float32)}
    return out


def client_message(message: str) -> str:
    """A coordinator error in the client's terms (its input names)."""
    for ours, theirs in CLIENT_NAMES.items():
        message = message.replace(ours, theirs)
    return message


def final_text(item: Item, completion: str) -> str:
    return item.prompt + completion if item.include_prompt else completion


def _one(row: Mapping[str, np.ndarray], name: str):
    if name not in row:
        return None
    array = np.asarray(row[name]).reshape(-1)
    if array.size != 1:
        raise InputError(f"{name} must hold one value per prompt, got {array.size}")
    value = array[0]
    return value.item() if isinstance(value, np.generic) else value


def _text(row: Mapping[str, np.ndarray], name: str) -> str:
    value = _one(row, name)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{name} is not valid UTF-8 (invalid byte at offset {error.start})") from None
    if isinstance(value, str):
        return value
    raise InputError(f"{name} must be a UTF-8 string (BYTES), got {type(value).__name__}")


def _strings(row: Mapping[str, np.ndarray], name: str) -> list[str]:
    if name not in row:
        return []
    words = []
    for i, value in enumerate(np.asarray(row[name]).reshape(-1)):
        try:
            text = bytes(value).decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)
        except UnicodeDecodeError:
            raise InputError(f"{name}[{i}] is not valid UTF-8") from None
        if text:  # NVIDIA's client pads rows of a batch with empty strings
            words.append(text)
    return words


def _array(value, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)
