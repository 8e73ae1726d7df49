"""The coordinator's public contract: its request inputs and its response
statistics, defined once (name, data type, meaning).

The server builds its responses from it, the client, the bench, the soak, the
load test and its fake server read and write through it, and a test checks it
against every profile's ``model_repository/coordinator/configs/*.pbtxt``. A
new statistic is a field of ``Statistics`` here plus the code that computes
it (``generation.Stats.add``); everything that carries it follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
import numpy as np
from coordinator.engines.contract import TensorSpec

INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), "the prompt", optional=False),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), "most tokens to generate"),
    TensorSpec("speculation_window", "TYPE_INT32", (1,), "most draft tokens per round (0: plain decoding)"),
    TensorSpec("adaptive_window", "TYPE_BOOL", (1,), "let the cost model pick each round's window"),
    TensorSpec("temperature", "TYPE_FP32", (1,), "sampling temperature (0: greedy)"),
    TensorSpec("draft_temperature", "TYPE_FP32", (1,), "the draft model's temperature (lossless either way)"),
    TensorSpec("top_k", "TYPE_INT32", (1,), "sample among the k likeliest tokens (0: all)"),
    TensorSpec("top_p", "TYPE_FP32", (1,), "nucleus sampling mass"),
    TensorSpec("random_seed", "TYPE_UINT64", (1,), "seed of a sampled request (same seed, same text)"),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), "strings that end the completion (not included)"),
    TensorSpec("stream", "TYPE_BOOL", (1,), "a response per chunk of text instead of one at the end"),
    TensorSpec("drafter", "TYPE_STRING", (1,), "who drafts: draft_model, prompt_lookup or hybrid"),
    TensorSpec("end_id", "TYPE_INT32", (1,), "the token that ends the completion (default: the model's end tokens)"),
    TensorSpec("use_draft_logits", "TYPE_BOOL", (1,),
               "sampled requests: verify against the draft's distribution (false: by token matching)"),
    TensorSpec("repetition_penalty", "TYPE_FP32", (1,), "divides the logits of tokens already in the text (> 0)"),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,), "subtracted from the logits of tokens already in the text"),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,), "subtracted once per occurrence of a token in the text"),
    TensorSpec("min_length", "TYPE_INT32", (1,), "tokens to generate before the end token may come"),
    TensorSpec("bad_words", "TYPE_STRING", (-1,), "strings the completion must not produce"),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,), "report each generated token's log probability"),
    TensorSpec("ab_key", "TYPE_STRING", (1,),
               "the traffic split's key (e.g. a user id): the same key always lands in the same arm"),
)
INPUT_NAMES = tuple(spec.name for spec in INPUTS)

TEXT_OUTPUT = TensorSpec("text_output", "TYPE_STRING", (1,), "the text (a chunk of it when streaming)",
                         optional=False)


def _statistic(wire_name: str, data_type: str, meaning: str, default=0):
    return field(default=default, metadata={"spec": TensorSpec(wire_name, data_type, (1,), meaning, optional=False)})


@dataclass
class Statistics:
    """What the final response says about how its text was decoded."""

    draft_tokens: int = _statistic("total_draft_tokens", "TYPE_INT32", "draft tokens proposed to the target")
    accepted_draft_tokens: int = _statistic("total_accepted_draft_tokens", "TYPE_INT32",
                                            "of those, accepted by the target")
    acceptance_rate: float = _statistic("acceptance_rate", "TYPE_FP32", "accepted / drafted (0 with no drafts)", 0.0)
    completion_tokens: int = _statistic("completion_tokens", "TYPE_INT32", "tokens generated")
    speculative_rounds: int = _statistic("speculative_rounds", "TYPE_INT32", "rounds that verified drafted tokens")
    plain_rounds: int = _statistic("plain_rounds", "TYPE_INT32", "plain target steps")
    rejected_rounds: int = _statistic("rejected_rounds", "TYPE_INT32", "speculative rounds that rejected a draft")
    lookup_draft_tokens: int = _statistic("lookup_draft_tokens", "TYPE_INT32",
                                          "draft tokens proposed by prompt lookup (the rest by the draft model)")
    draft_seconds: float = _statistic("draft_seconds", "TYPE_FP32", "server-side seconds spent drafting", 0.0)
    verify_seconds: float = _statistic("verify_seconds", "TYPE_FP32",
                                       "server-side seconds in target calls that verified drafts", 0.0)
    plain_seconds: float = _statistic("plain_seconds", "TYPE_FP32", "server-side seconds in plain target steps", 0.0)
    fallback_reason: str = _statistic("fallback_reason", "TYPE_STRING",
                                      "why speculation last stopped or was held back (empty if it never was)", "")
    arm: str = _statistic("speculation_arm", "TYPE_STRING",
                          "the traffic split's arm: control, speculative or none (not split)", "none")

    def outputs(self) -> dict[str, np.ndarray]:
        """The statistics as the response's output tensors."""
        arrays = {}
        for spec, name in _specs():
            value = getattr(self, name)
            if spec.data_type == "TYPE_STRING":
                arrays[spec.name] = np.array([str(value).encode("utf-8")], dtype=np.object_)
            else:
                arrays[spec.name] = np.array([value], dtype=spec.numpy_dtype)
        return arrays

    def read(self, output: Callable[[str], np.ndarray | None]) -> None:
        """Set every statistic a response carries (``output(name)``: its tensor, or None)."""
        for spec, name in _specs():
            array = output(spec.name)
            if array is None or not np.asarray(array).size:
                continue
            value = np.asarray(array).reshape(-1)[0]
            if spec.data_type == "TYPE_STRING":
                value = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            elif spec.data_type == "TYPE_FP32":
                value = float(value)
            else:
                value = int(value)
            setattr(self, name, value)


    def problem(self, max_tokens: int, speculation: bool = True) -> str | None:
        """What breaks the contract in a final response's statistics (None: nothing): a
        client that checks its responses (the soak, the load test) calls this."""
        if self.completion_tokens > max_tokens:
            return f"{self.completion_tokens} tokens for max_tokens {max_tokens}"
        if not 0 <= self.accepted_draft_tokens <= self.draft_tokens:
            return f"{self.accepted_draft_tokens} accepted of {self.draft_tokens} drafted tokens"
        if not speculation and self.draft_tokens:
            return f"{self.draft_tokens} tokens drafted with speculation_window 0"
        return None


def _specs() -> list[tuple[TensorSpec, str]]:
    return [(f.metadata["spec"], f.name) for f in fields(Statistics)]


STATISTICS: tuple[TensorSpec, ...] = tuple(spec for spec, _ in _specs())
# With return_log_probs, on the final response: one value per generated token
# (completion_tokens of them) and their sum, as TensorRT-LLM reports them.
LOG_PROBS: tuple[TensorSpec, ...] = (
    TensorSpec("output_log_probs", "TYPE_FP32", (-1,), "log probability of each generated token", optional=False),
    TensorSpec("cum_log_probs", "TYPE_FP32", (1,), "their sum", optional=False),
)
OUTPUTS: tuple[TensorSpec, ...] = (TEXT_OUTPUT, *STATISTICS, *LOG_PROBS)
COUNTED = tuple(name for spec, name in _specs() if spec.data_type in ("TYPE_INT32", "TYPE_FP32")
                and name != "acceptance_rate")  # statistics that add up over requests
