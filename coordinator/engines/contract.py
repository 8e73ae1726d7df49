"""The contract between the coordinator and its engines, in one place.

The engines (``target``, ``draft``) speak the interface of the ``tensorrt_llm``
model of NVIDIA's Triton TensorRT-LLM backend, so the same coordinator drives
TensorRT-LLM engines on GPUs and the CPU reference engine here. This module
holds the three parts of that contract:

* the tensors: what the coordinator sends and reads (the config checks compare
  them against every profile's ``config.pbtxt``); coordinator/engines/tensors.py
  packs and unpacks them;
* the protocol: ``Engine``, what the loop awaits (coordinator/triton/coordinator_model.py
  implements it over BLS);
* the semantics the coordinator relies on beyond names and shapes, as
  TensorRT-LLM 0.17 behaves (trtllm_emulation/ reproduces them for the CPU engine
  and the tests' fakes):
  - the end token is neither returned nor counted in ``sequence_length``, so a
    call that reached the end returns fewer tokens than it otherwise must
    (coordinator/verification/outcome.py reads the end from the counts);
  - a stop word (``stop_words_list``: the pair's other end ids) ends the call
    too, but it is returned and counted (TensorRT-LLM's stop criterion looks at
    tokens already written); the loop cuts the text before every end id;
  - each call is a new request seeded from its own ``random_seed``;
  - ``draft_logits`` are read as q = softmax(draft_logits), without the
    target's temperature or top-k/top-p;
  - with k draft tokens and ``request_output_len`` k + 1 the target returns the
    accepted prefix plus one token of its own (coordinator/verification/rules.py
    names the rule); an empty ``draft_input_ids`` is never sent.

Dims below are the per-request dims declared in the model config (the engines
have ``max_batch_size`` >= 1, so on the wire each gains a leading batch dim).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from coordinator.sampling.params import SamplingParams

NUMPY_TYPES = {"TYPE_STRING": "object", "TYPE_INT32": "int32", "TYPE_UINT64": "uint64", "TYPE_FP32": "float32",
               "TYPE_FP16": "float16", "TYPE_BOOL": "bool"}
WIRE_TYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_UINT64": "UINT64", "TYPE_FP32": "FP32",
              "TYPE_FP16": "FP16", "TYPE_BOOL": "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a model's config: of the engine contract here, of the
    coordinator's public contract in coordinator/request/api.py."""

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
        TensorSpec("stop_words_list", "TYPE_INT32", (2, -1)),
        TensorSpec("return_log_probs", "TYPE_BOOL", (1,)),
        TensorSpec("random_seed", "TYPE_UINT64", (1,)),
        TensorSpec("return_generation_logits", "TYPE_BOOL", (1,)),
        TensorSpec("streaming", "TYPE_BOOL", (1,)),
    )
}

# Inputs beyond TensorRT-LLM's that the CPU engine takes, sent only where the
# coordinator's ``engine_prompt_length`` setting is on (the cpu profile); a
# target that declares none of them gets none.
ENGINE_EXTENSION_INPUTS: dict[str, TensorSpec] = {
    s.name: s
    for s in (
        # How many leading tokens of input_ids are the request's prompt: the CPU
        # engine prefills a prompt's leading blocks through larger kernel calls
        # (cpu_engine/prompt_blocks.py) and cannot tell a prompt from generated
        # tokens sent back to it.
        TensorSpec("prompt_length", "TYPE_INT32", (1,)),
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


@dataclass(frozen=True)
class EngineOutput:
    tokens: list[int]  # end token excluded or not: the loop copes with both
    logits: np.ndarray | None = None  # [len(tokens), vocab] raw logits, when asked for
    log_probs: list[float] | None = None  # each token's (sampling.log_probs), aligned with tokens


class Engine(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        draft_tokens: Sequence[int] = (),
        draft_logits: np.ndarray | None = None,
        return_logits: bool = False,
    ) -> EngineOutput:
        """Generate up to ``max_new_tokens`` after ``input_ids``; with
        ``draft_tokens`` (k of them, max_new_tokens = k + 1) verify them (by
        rejection sampling against softmax(``draft_logits``) [k, vocab] when
        given) and return the accepted prefix plus one token. ``sampling.seed``
        seeds this call alone."""
        ...

    def stream(self, input_ids: Sequence[int], max_new_tokens: int,
               sampling: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Plain decoding in one call: the tokens (and log probabilities) as they are generated."""
        ...


def for_prompt(engine: Engine, prompt_length: int) -> Engine:
    """``engine`` as one request's calls use it: an engine that takes the prompt's
    length (``for_prompt``: the BLS adapter, where ``engine_prompt_length`` is on)
    sends it with each call; any other is used as it is."""
    marked = getattr(engine, "for_prompt", None)
    return engine if marked is None else marked(prompt_length)


class EngineError(RuntimeError):
    """An engine failed or answered outside its contract."""
