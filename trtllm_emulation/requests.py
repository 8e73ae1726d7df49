"""One engine call as a tensorrtllm-backend model reads its inputs: the CPU
engine's and the simulated engine's Triton adapters both read requests here,
so the two profiles cannot drift apart in what they accept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from coordinator.sampling.params import Penalties, SamplingParams
from coordinator.sampling.penalties import read_word_list


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
    stop_words: tuple[tuple[int, ...], ...] = ()  # stop_words_list: each ends the call, returned and counted
    # The CPU engine's own input (TensorRT-LLM has none): how many leading tokens of
    # input_ids are the request's prompt (cpu_engine/prompt_blocks.py)
    prompt_length: int | None = None


def read_request(tensor: Callable[[str], np.ndarray | None]) -> EngineRequest:
    """The call whose input tensors ``tensor(name)`` gives (None where absent), with
    TensorRT-LLM's defaults: neither top-k nor top-p given means greedy decoding,
    min_length counts from this call's input."""

    def scalar(name, default):
        value = tensor(name)
        return default if value is None or value.size == 0 else value.reshape(-1)[0].item()

    input_ids = tensor("input_ids")
    if input_ids is None:
        raise EngineRequestError("input_ids is required")
    input_ids = input_ids.reshape(-1)
    length = int(scalar("input_lengths", input_ids.size))
    if not 0 < length <= input_ids.size:
        raise EngineRequestError(f"input_lengths must be between 1 and the size of input_ids ({input_ids.size})")
    drafts = tensor("draft_input_ids")
    draft_logits = tensor("draft_logits")
    if draft_logits is not None:
        draft_logits = draft_logits.reshape(draft_logits.shape[-2], draft_logits.shape[-1])
    end_id = scalar("end_id", None)
    unfiltered = tensor("runtime_top_k") is None and tensor("runtime_top_p") is None
    penalties = Penalties(
        repetition=float(scalar("repetition_penalty", 1.0)),
        presence=float(scalar("presence_penalty", 0.0)),
        frequency=float(scalar("frequency_penalty", 0.0)),
        min_length=int(scalar("min_length", 0)),
        bad_words=_words(tensor("bad_words_list")),
        prompt_length=length,
    )
    if penalties.repetition <= 0.0:
        raise EngineRequestError(f"repetition_penalty must be > 0, got {penalties.repetition:g}")
    prompt_length = scalar("prompt_length", None)
    if prompt_length is not None and not 0 < int(prompt_length) <= length:
        raise EngineRequestError(f"prompt_length must be between 1 and input_lengths ({length}), "
                                 f"got {int(prompt_length)}")
    return EngineRequest(
        input_ids=input_ids[:length],
        max_new_tokens=int(scalar("request_output_len", 1)),
        sampling=SamplingParams(
            temperature=float(scalar("temperature", 1.0)),
            top_k=1 if unfiltered else int(scalar("runtime_top_k", 0)),
            top_p=float(scalar("runtime_top_p", 1.0)),
            seed=int(scalar("random_seed", 0)),
            penalties=penalties if penalties.active else None,
            log_probs=bool(scalar("return_log_probs", False)),
        ),
        end_id=None if end_id is None else int(end_id),
        draft_tokens=None if drafts is None or drafts.size == 0 else drafts.reshape(-1),
        draft_logits=draft_logits,
        return_logits=bool(scalar("return_generation_logits", False)),
        stop_words=_words(tensor("stop_words_list")),
        prompt_length=None if prompt_length is None else int(prompt_length),
    )


def _words(array: np.ndarray | None) -> tuple[tuple[int, ...], ...]:
    return () if array is None or array.size == 0 else read_word_list(array)
