"""Validation of the coordinator's public inputs.

Every rejection names the field and the limit, so a client can fix its
request without reading server logs. Triton itself already rejects unknown
inputs and data types that differ from config.pbtxt; this module checks the
values (and shapes again, defensively)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
import numpy as np
from coordinator.request.api import INPUT_NAMES
from coordinator.settings import CoordinatorSettings
from coordinator.drafters import registry
from coordinator.sampling.params import NO_PENALTIES, Penalties
from coordinator.sampling.params import SamplingParams

MAX_STOP_WORDS = 16
MAX_STOP_WORD_CHARS = 256
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0



# Request parameters Triton itself defines (the parameters extension); any other
# parameter is refused: the coordinator's settings are inputs. With HTTP
# `generate`, a JSON field that is not an input arrives as a parameter, so a
# misspelt input ("max_token") is refused instead of silently ignored.
TRITON_PARAMETERS = frozenset({"sequence_id", "priority", "timeout", "sequence_start", "sequence_end", "headers"})


class InputError(ValueError):
    """A request input is missing, malformed or out of range."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    max_tokens: int
    speculation_window: int  # per-request cap on drafted tokens (0: plain decoding)
    sampling: SamplingParams
    adaptive_window: bool = True
    draft_sampling: SamplingParams | None = None  # how the draft samples (None: as the target)
    stop_words: tuple[str, ...] = ()
    stream: bool = False
    drafter: str = ""  # who drafts ("": the server's drafter)
    end_id: int | None = None  # the token that ends the completion (None: the model's end tokens)
    draft_distribution: bool = True  # sampled requests: verify against q (False: by token matching)
    penalties: Penalties = NO_PENALTIES  # bad_words still as text: bad_word_texts
    bad_word_texts: tuple[str, ...] = ()
    return_log_probs: bool = False
    arm: str = "none"  # the traffic split's arm: control, speculative or none (not split)


# The traffic split's arms (settings.speculation_ab_fraction).
CONTROL, SPECULATIVE, NO_ARM = "control", "speculative", "none"
ARMS = (CONTROL, SPECULATIVE, NO_ARM)
MAX_AB_KEY_BYTES = 1024


def ab_arm(key: bytes, fraction: float) -> str:
    """The arm of a request key: a hash of the key alone (SHA-256, not Python's
    salted hash), so a key lands in the same arm on every replica and after
    restarts; ``fraction`` of the keys are control."""
    point = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0**64  # uniform in [0, 1)
    return CONTROL if point < fraction else SPECULATIVE


def parse_request(
    inputs: Mapping[str, np.ndarray | None],
    settings: CoordinatorSettings,
    new_seed: Callable[[], int],
) -> GenerationRequest:
    """Build a validated request from the raw input tensors (absent: None)."""
    unknown = sorted(k for k, v in inputs.items() if v is not None and k not in INPUT_NAMES)
    if unknown:
        raise InputError(f"unknown input(s) {', '.join(unknown)}; accepted inputs: {', '.join(INPUT_NAMES)}")

    prompt = _utf8("text_input", _scalar(inputs, "text_input", required=True))
    if not prompt:
        raise InputError("text_input is empty; send at least one character of prompt")

    max_tokens = _int_in_range(inputs, "max_tokens", settings.default_max_tokens, 1, settings.max_tokens_limit)
    window = _int_in_range(
        inputs,
        "speculation_window",
        settings.speculation_window,
        0,
        settings.speculation_window,
        limit_name="the server's speculation_window",
    )
    sampling, draft_sampling = _sampling(inputs, new_seed)
    bad_words = _stop_words(inputs.get("bad_words"), "bad_words")
    penalties = _penalties(inputs, settings)
    drafter_value = _scalar(inputs, "drafter")
    drafter = settings.drafter if drafter_value is None else _utf8("drafter", drafter_value)
    if drafter not in registry.names():
        raise InputError(f"drafter must be one of {', '.join(registry.names())}, got {drafter!r}")
    arm = _arm(inputs, settings)
    if arm == CONTROL:
        window = 0  # plain decoding, in the same batches as the speculative arm
    if (penalties.active or bad_words) and not settings.speculate_with_penalties:
        window = 0  # this server's engines are not known to verify such requests losslessly
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        speculation_window=window,
        sampling=sampling,
        adaptive_window=_flag(inputs, "adaptive_window", settings.adaptive_window),
        draft_sampling=draft_sampling,
        stop_words=_stop_words(inputs.get("stop_words")),
        stream=_flag(inputs, "stream", False),
        drafter=drafter,
        end_id=sampling.end_id,
        draft_distribution=_flag(inputs, "use_draft_logits", True),
        penalties=penalties,
        bad_word_texts=bad_words,
        return_log_probs=_flag(inputs, "return_log_probs", False),
        arm=arm,
    )


def _arm(inputs: Mapping[str, np.ndarray | None], settings: CoordinatorSettings) -> str:
    """The request's arm of the traffic split: none without a split or when the
    request set speculation_window itself (it is not re-assigned)."""
    key = _scalar(inputs, "ab_key")
    if key is not None:
        key = _utf8("ab_key", key)
        if len(key.encode("utf-8")) > MAX_AB_KEY_BYTES:
            raise InputError(f"ab_key may be at most {MAX_AB_KEY_BYTES} bytes, got {len(key.encode('utf-8'))}")
    if settings.speculation_ab_fraction <= 0.0 or _scalar(inputs, "speculation_window") is not None:
        return NO_ARM
    if not key:  # no key: a random arm, in the same proportions
        return CONTROL if random.random() < settings.speculation_ab_fraction else SPECULATIVE
    return ab_arm(key.encode("utf-8"), settings.speculation_ab_fraction)


def _flag(inputs: Mapping[str, np.ndarray | None], name: str, default: bool) -> bool:
    value = _scalar(inputs, name)
    return default if value is None else bool(value)


def _sampling(inputs: Mapping[str, np.ndarray | None],
              new_seed: Callable[[], int]) -> tuple[SamplingParams, SamplingParams | None]:
    """The target's sampling settings, and the draft's where its temperature differs."""
    temperature = _float(inputs, "temperature", 0.0)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InputError(f"temperature must be between 0 and {MAX_TEMPERATURE:g} (0 = greedy), got {temperature:g}")
    top_k = _int_in_range(inputs, "top_k", 0, 0, 2**31 - 1)
    top_p = _float(inputs, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p:g}")
    draft_temperature = _float(inputs, "draft_temperature", temperature)
    if not 0.0 <= draft_temperature <= MAX_TEMPERATURE:
        raise InputError(
            f"draft_temperature must be between 0 and {MAX_TEMPERATURE:g} (0 = greedy draft), got {draft_temperature:g}"
        )
    if temperature == 0.0 and _scalar(inputs, "draft_temperature") is not None and draft_temperature != 0.0:
        raise InputError("draft_temperature needs a sampled request (temperature > 0); greedy requests draft greedily")
    seed_value = _scalar(inputs, "random_seed")
    seed = int(seed_value) if seed_value is not None else new_seed()
    if not 0 <= seed < 2**64:
        raise InputError(f"random_seed must be between 0 and 2^64-1, got {seed}")
    end_id = _int_in_range(inputs, "end_id", -1, 0, 2**31 - 1)
    end_id = None if end_id < 0 else end_id  # checked against the vocabulary where the tokenizer is known
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, end_id=end_id)
    if draft_temperature == temperature:
        return sampling, None
    return sampling, SamplingParams(temperature=draft_temperature, top_k=top_k, top_p=top_p, seed=seed, end_id=end_id)


def _penalties(inputs: Mapping[str, np.ndarray | None], settings: CoordinatorSettings) -> Penalties:
    repetition = _float(inputs, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= MAX_PENALTY:
        raise InputError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}] (1 = none), got {repetition:g}")
    presence = _float(inputs, "presence_penalty", 0.0)
    frequency = _float(inputs, "frequency_penalty", 0.0)
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InputError(f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g} (0 = none), got {value:g}")
    min_length = _int_in_range(inputs, "min_length", 0, 0, settings.max_tokens_limit)
    return Penalties(repetition=repetition, presence=presence, frequency=frequency, min_length=min_length)


def check_parameters(parameters: Mapping[str, object]) -> None:
    unknown = sorted(k for k in parameters if not k.startswith("triton_") and k not in TRITON_PARAMETERS)
    if unknown:
        raise InputError(
            f"unknown parameter(s) {', '.join(unknown)}; the coordinator takes its settings as inputs: "
            f"{', '.join(INPUT_NAMES)}"
        )


def check_context(prompt_tokens: int, max_tokens: int, settings: CoordinatorSettings) -> None:
    """Prompt plus completion must fit the engines' context."""
    if prompt_tokens + max_tokens > settings.max_context_tokens:
        raise InputError(
            f"text_input is {prompt_tokens} tokens; with max_tokens {max_tokens} that exceeds the context limit "
            f"of {settings.max_context_tokens} tokens (shorten the prompt or lower max_tokens)"
        )


def check_end_id(end_id: int | None, vocab_size: int) -> None:
    if end_id is not None and not 0 <= end_id < vocab_size:
        raise InputError(f"end_id must be a token id between 0 and {vocab_size - 1}, got {end_id}")


def check_prompt_size(prompt_bytes: int, max_token_bytes: int, settings: CoordinatorSettings) -> None:
    """Refuse, before tokenizing it, a prompt too long to fit the context.

    No token is longer than ``max_token_bytes``, so a prompt of more than
    max_context_tokens x max_token_bytes bytes has more tokens than the context
    holds. Checking this first keeps a huge prompt from holding the
    coordinator's event loop (and every other stream) while it is tokenized."""
    limit = settings.max_context_tokens * max_token_bytes
    if prompt_bytes > limit:
        raise InputError(
            f"text_input is {prompt_bytes} bytes; at most {limit} bytes can fit the context limit of "
            f"{settings.max_context_tokens} tokens (shorten the prompt)"
        )


def _scalar(inputs: Mapping[str, np.ndarray | None], name: str, required: bool = False):
    value = inputs.get(name)
    if value is None:
        if required:
            raise InputError(f"{name} is required")
        return None
    array = np.asarray(value)
    if array.size != 1:
        raise InputError(f"{name} must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _int_in_range(inputs, name: str, default: int, low: int, high: int, limit_name: str | None = None) -> int:
    value = _scalar(inputs, name)
    if value is None:
        return default
    if not isinstance(value, (int, np.integer)):
        raise InputError(f"{name} must be an integer, got {value!r}")
    number = int(value)
    if not low <= number <= high:
        limit = f" ({limit_name})" if limit_name else ""
        raise InputError(f"{name} must be between {low} and {high}{limit}, got {number}")
    return number


def _float(inputs, name: str, default: float) -> float:
    value = _scalar(inputs, name)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be a number (FP32), got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise InputError(f"{name} must be a finite number, got {number}")
    return number


def _utf8(name: str, value) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise InputError(f"{name} must be a UTF-8 string (BYTES), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{name} is not valid UTF-8 (invalid byte at offset {error.start})") from None


def _stop_words(value: np.ndarray | None, name: str = "stop_words") -> tuple[str, ...]:
    if value is None:
        return ()
    raw = np.asarray(value).reshape(-1)
    if raw.size > MAX_STOP_WORDS:
        raise InputError(f"{name} may hold at most {MAX_STOP_WORDS} strings, got {raw.size}")
    words = [_utf8(f"{name}[{i}]", w) for i, w in enumerate(raw)]
    for i, word in enumerate(words):
        if not word:
            raise InputError(f"{name}[{i}] is an empty string; {name.replace('_', ' ')} must not be empty")
        if len(word) > MAX_STOP_WORD_CHARS:
            raise InputError(
                f"{name}[{i}] is {len(word)} characters; {name.replace('_', ' ')} may be at most {MAX_STOP_WORD_CHARS}"
            )
    return tuple(words)
