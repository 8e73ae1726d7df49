"""Building engine requests and reading engine responses, in the tensorrtllm
backend's wire format (leading batch dim of 1; beams in ``output_ids``).
Pure numpy: the BLS adapter wraps these arrays in Triton tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from coordinator.engines.contract import ENGINE_EXTENSION_INPUTS, ENGINE_INPUTS
from coordinator.sampling.penalties import word_list
from coordinator.sampling.params import SamplingParams

REQUESTED_OUTPUTS = ("output_ids", "sequence_length")


def engine_inputs(
    input_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    *,
    end_id: int,
    pad_id: int,
    draft_tokens: Sequence[int] = (),
    draft_logits: np.ndarray | None = None,
    return_logits: bool = False,
    seed_input: str = "random_seed",
    streaming: bool = False,
    stop_ids: Sequence[int] = (),
    prompt_length: int | None = None,
) -> dict[str, np.ndarray]:
    """``sampling.seed`` is this call's own seed, sent as ``seed_input``
    (``random_seed`` or ``seed``, by backend version). ``draft_logits`` are
    sent as given: log q, which the backend reads through a plain softmax.
    ``stop_ids``: the model's end ids other than ``end_id``, sent as one-token
    stop words (TensorRT-LLM takes a single ``end_id``). ``prompt_length``: the
    CPU engine's own input (contract.ENGINE_EXTENSION_INPUTS), sent when given."""
    def scalar(name: str, value) -> np.ndarray:
        spec = ENGINE_INPUTS.get(name) or ENGINE_EXTENSION_INPUTS[name]
        return np.array([[value]], dtype=spec.numpy_dtype)

    tensors = {
        "input_ids": np.asarray(input_ids, dtype=np.int32).reshape(1, -1),
        "input_lengths": scalar("input_lengths", len(input_ids)),
        "request_output_len": scalar("request_output_len", max_new_tokens),
        "end_id": scalar("end_id", end_id),
        "pad_id": scalar("pad_id", pad_id),
        # Greedy is top-k 1 (temperature 0 would divide by zero in some engines).
        "temperature": scalar("temperature", 1.0 if sampling.greedy else sampling.temperature),
        "runtime_top_k": scalar("runtime_top_k", 1 if sampling.greedy else sampling.top_k),
        "runtime_top_p": scalar("runtime_top_p", sampling.top_p),
        seed_input: scalar("random_seed", sampling.seed),
    }
    penalties = sampling.penalties
    if penalties is not None and penalties.active:
        call = penalties.for_call(len(input_ids))
        for name, value, neutral in (("repetition_penalty", call.repetition, 1.0),
                                     ("presence_penalty", call.presence, 0.0),
                                     ("frequency_penalty", call.frequency, 0.0),
                                     ("min_length", call.min_length, 0)):
            if value != neutral:
                tensors[name] = scalar(name, value)
        if call.bad_words:
            tensors["bad_words_list"] = word_list(call.bad_words)
    stop_words = [(int(i),) for i in stop_ids if int(i) != end_id]
    if stop_words:
        tensors["stop_words_list"] = word_list(stop_words)
    if draft_tokens:  # TensorRT-LLM asserts on an empty draft
        tensors["draft_input_ids"] = np.asarray(draft_tokens, dtype=np.int32).reshape(1, -1)
        if draft_logits is not None:
            tensors["draft_logits"] = np.asarray(draft_logits, dtype=np.float32)[None, ...]
    if return_logits:
        tensors["return_generation_logits"] = scalar("return_generation_logits", True)
    if sampling.log_probs:
        tensors["return_log_probs"] = scalar("return_log_probs", True)
    if streaming:  # a decoupled engine then answers with each step's new tokens
        tensors["streaming"] = scalar("streaming", True)
    if prompt_length is not None:
        tensors["prompt_length"] = scalar("prompt_length", prompt_length)
    return tensors


def generated_tokens(output_ids: np.ndarray, sequence_length: np.ndarray) -> list[int]:
    """Tokens of beam 0 of the single request (the engine excludes the input).

    A call that met the end token first returns none (TensorRT-LLM does not
    count it): ``output_ids`` may then have no token column at all."""
    ids = _rows(output_ids, 1)[0]
    length = int(np.asarray(sequence_length).reshape(-1)[0])
    if not 0 <= length <= ids.size:
        raise ValueError(f"sequence_length {length} is outside output_ids of size {ids.size}")
    return [int(t) for t in ids[:length]]


def output_log_probs(array: np.ndarray, tokens: int) -> list[float]:
    """Beam 0's log probabilities of its first ``tokens`` tokens from
    ``output_log_probs`` [1, beam, n] (or [1, n])."""
    values = _rows(np.asarray(array, dtype=np.float32), 1)[0]
    if values.size < tokens:
        raise ValueError(f"output_log_probs has {values.size} values for {tokens} generated tokens")
    return [float(v) for v in values[:tokens]]


def generation_logits(logits: np.ndarray, tokens: int) -> np.ndarray:
    """Beam 0's logits [tokens, vocab] from ``generation_logits`` [1, beam, n, vocab] (or [1, n, vocab])."""
    rows = _rows(np.asarray(logits, dtype=np.float32), 2)[0]
    if rows.shape[0] < tokens:
        raise ValueError(f"generation_logits has {rows.shape[0]} rows for {tokens} generated tokens")
    return rows[:tokens]


def _rows(array: np.ndarray, trailing: int) -> np.ndarray:
    """``array`` with its leading (batch, beam) dims flattened into one, keeping
    the last ``trailing`` dims; works when one of those is 0."""
    array = np.asarray(array)
    if array.ndim <= trailing:
        return array.reshape(1, *array.shape)
    lead = math.prod(array.shape[:-trailing])
    return array.reshape(lead, *array.shape[-trailing:])
