"""The tensor contract between the coordinator and its engines.

The engines (``target``, ``draft``) speak the interface of the ``tensorrt_llm``
model of NVIDIA's Triton TensorRT-LLM backend, so the same coordinator drives
TensorRT-LLM engines on GPUs and the CPU reference engine here. This module is
the single list of what the coordinator sends and reads; the config checks
compare it against every profile's ``config.pbtxt``.

Dims below are the per-request dims declared in the model config (the engines
have ``max_batch_size`` >= 1, so on the wire each gains a leading batch dim).
"""

from __future__ import annotations

from dataclasses import dataclass


NUMPY_TYPES = {"TYPE_STRING": "object", "TYPE_INT32": "int32", "TYPE_UINT64": "uint64", "TYPE_FP32": "float32",
               "TYPE_FP16": "float16", "TYPE_BOOL": "bool"}
WIRE_TYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_UINT64": "UINT64", "TYPE_FP32": "FP32",
              "TYPE_FP16": "FP16", "TYPE_BOOL": "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a model's config: of the engine contract here, of the
    coordinator's public contract in coordinator/api.py."""

    name: str
    data_type: str  # Triton config spelling, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    meaning: str = ""
    optional: bool = True

    @property
    def numpy_dtype(self) -> str:
        return NUMPY_TYPES[self.data_type]

    @property
    def wire_type(self) -> str:
        """The type's name in the KServe protocol (tritonclient's InferInput datatype)."""
        return WIRE_TYPES[self.data_type]



# Inputs the coordinator may send to an engine.
ENGINE_INPUTS: dict[str, TensorSpec] = {
    s.name: s
    for s in (
        TensorSpec("input_ids", "TYPE_INT32", (-1,)),
        TensorSpec("input_lengths", "TYPE_INT32", (1,)),
        TensorSpec("request_output_len", "TYPE_INT32", (1,)),
        TensorSpec("end_id", "TYPE_INT32", (1,)),
        TensorSpec("pad_id", "TYPE_INT32", (1,)),
        TensorSpec("draft_input_ids", "TYPE_INT32", (-1,)),
        TensorSpec("draft_logits", "TYPE_FP32", (-1, -1)),
        TensorSpec("temperature", "TYPE_FP32", (1,)),
        TensorSpec("runtime_top_k", "TYPE_INT32", (1,)),
        TensorSpec("runtime_top_p", "TYPE_FP32", (1,)),
        TensorSpec("repetition_penalty", "TYPE_FP32", (1,)),
        TensorSpec("presence_penalty", "TYPE_FP32", (1,)),
        TensorSpec("frequency_penalty", "TYPE_FP32", (1,)),
        TensorSpec("min_length", "TYPE_INT32", (1,)),
        TensorSpec("bad_words_list", "TYPE_INT32", (2, -1)),
        TensorSpec("return_log_probs", "TYPE_BOOL", (1,)),
        TensorSpec("random_seed", "TYPE_UINT64", (1,)),
        TensorSpec("return_generation_logits", "TYPE_BOOL", (1,)),
        TensorSpec("streaming", "TYPE_BOOL", (1,)),
    )
}

# Names the engines' seed input goes by: the tensorrtllm backend reads
# ``random_seed`` up to v0.19; the backend inside newer TensorRT-LLM releases
# reads ``seed``. Which one a deployment sends is the coordinator's
# ``engine_seed_input`` setting; ``ENGINE_INPUTS`` lists the default.
SEED_INPUT_NAMES = ("random_seed", "seed")

# Outputs the coordinator reads from an engine.
ENGINE_OUTPUTS: dict[str, TensorSpec] = {
    s.name: s
    for s in (
        TensorSpec("output_ids", "TYPE_INT32", (-1, -1)),
        TensorSpec("sequence_length", "TYPE_INT32", (-1,)),
        TensorSpec("generation_logits", "TYPE_FP32", (-1, -1, -1)),
        TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1)),
    )
}

# Engine-side settings the coordinator depends on: it reads ``output_ids`` as
# the generated tokens only, so every engine must exclude the input.
REQUIRED_ENGINE_PARAMETERS: dict[str, str] = {"exclude_input_in_output": "true"}
