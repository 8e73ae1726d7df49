"""OpenAI request JSON -> the coordinator's inputs.

Every field is mapped, accepted because it cannot change the text (``user``,
``stream_options``, ...), or refused with a 400 naming it: a client must
never get text that silently ignores what it asked for (``logprobs``, ``n`` >
1, penalties, tools). Limits that are the server's (``max_tokens`` up to the
coordinator's ``max_tokens_limit``, ``temperature``, ``top_p``, stop words)
are left to the coordinator, whose errors come back naming the OpenAI field
(``errors.from_coordinator``); this module checks types and what the wire
types can hold.

Absent fields keep the coordinator's defaults, not OpenAI's: ``temperature``
0 (greedy), the server's speculation settings and drafter."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from frontend.errors import OpenAIError, model_not_found

MODEL = "coordinator"  # the one model id served (the coordinator's Triton name)
INT32 = (-(2**31), 2**31 - 1)
UINT64 = (0, 2**64 - 1)

# Coordinator inputs a request may set under their own names (the ``openai``
# package's extra_body, AIPerf's --extra-inputs).
EXTENSIONS = ("speculation_window", "adaptive_window", "drafter", "draft_temperature", "top_k",
              "repetition_penalty", "min_length")

# OpenAI fields this server cannot honour: why, and the values that ask for
# nothing (accepted; so is null).
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "n": ("this server returns one choice per request", (1,)),
    "best_of": ("this server returns one choice per request", (1,)),
    "echo": ("the completion never includes the prompt", (False,)),
    "logprobs": ("the coordinator reports each token's log probability, not the token texts and "
                 "alternatives OpenAI's logprobs carry", (False,)),
    "top_logprobs": ("the coordinator does not report the alternatives to a token", (0,)),
    "logit_bias": ("the coordinator samples from the target model's own distribution", ({},)),
    "suffix": ("there is no fill-in-the-middle", ("",)),
    "tools": ("there is no tool calling", ([],)),
    "tool_choice": ("there is no tool calling", ("none",)),
    "functions": ("there is no tool calling", ([],)),
    "function_call": ("there is no tool calling", ("none",)),
    "response_format": ("there is no structured output", ({"type": "text"},)),
    "modalities": ("the models produce text only", (["text"],)),
    "audio": ("the models produce text only", ()),
    "prediction": ("there are no predicted outputs", ()),
    "reasoning_effort": ("the models do not reason", ()),
    "web_search_options": ("there is no web search", ()),
}
# Accepted and ignored: they cannot change the text.
HARMLESS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")

_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
           "n", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", *HARMLESS, *EXTENSIONS}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "best_of", "echo", "suffix"})
CHAT_FIELDS = frozenset(_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
    "response_format", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
})
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Generation:
    """One OpenAI request as the coordinator will run it."""

    chat: bool
    inputs: dict[str, object]  # coordinator inputs other than text_input and stream
    max_tokens: int
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    fields: dict[str, str] = field(default_factory=dict)  # coordinator input -> the OpenAI field it came from
    prompt: str = ""  # the text the coordinator continues (chat: after the chat template)
    messages: tuple[dict[str, str], ...] = ()  # chat: role and content for the template

    def with_prompt(self, prompt: str) -> Generation:
        return replace(self, prompt=prompt)

    def coordinator_inputs(self) -> dict[str, object]:
        """Every input of the coordinator request, by its name in coordinator/request/api.py."""
        return {"text_input": self.prompt, **self.inputs, "stream": self.stream}


def completion_request(body: object, default_max_tokens: int, model: str = MODEL) -> Generation:
    """``POST /v1/completions``."""
    body = _checked(body, COMPLETION_FIELDS, model)
    generation = _generation(body, chat=False, max_tokens_field="max_tokens", default_max_tokens=default_max_tokens)
    return generation.with_prompt(_prompt(body.get("prompt")))


def chat_request(body: object, default_max_tokens: int, model: str = MODEL) -> Generation:
    """``POST /v1/chat/completions``; the prompt is made from ``messages`` by the
    tokenizer's chat template (``frontend.prompts``)."""
    body = _checked(body, CHAT_FIELDS, model)
    max_tokens = _integer(body, "max_tokens", *INT32)
    max_completion_tokens = _integer(body, "max_completion_tokens", *INT32)
    if None not in (max_tokens, max_completion_tokens) and max_tokens != max_completion_tokens:
        raise OpenAIError(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion_tokens}) differ; "
                          "send max_completion_tokens only", param="max_completion_tokens")
    limit_field = "max_completion_tokens" if max_completion_tokens is not None else "max_tokens"
    generation = _generation(body, chat=True, max_tokens_field=limit_field, default_max_tokens=default_max_tokens)
    generation.fields["text_input"] = "messages"
    return replace(generation, messages=_messages(body.get("messages")))


def _checked(body: object, allowed: frozenset[str], model: str) -> Mapping:
    if not isinstance(body, Mapping):
        raise OpenAIError("the request body must be a JSON object")
    requested = body.get("model")
    if requested is None:
        raise OpenAIError(f"model is required (this server serves {model!r})", param="model")
    if requested != model:
        raise model_not_found(str(requested), model)
    for name, value in body.items():
        if name not in allowed:
            raise OpenAIError(f"unknown field {name!r}; this endpoint accepts: {', '.join(sorted(allowed))}",
                              param=name)
        if name in UNSUPPORTED and not _neutral(value, UNSUPPORTED[name][1]):
            reason, neutral = UNSUPPORTED[name]
            default = f" or send {json.dumps(neutral[0])}" if neutral else ""
            raise OpenAIError(f"{name} is not supported: {reason} (got {json.dumps(value)}; omit it{default})",
                              param=name)
    return body


def _neutral(value: object, neutral: tuple) -> bool:
    """Whether ``value`` asks for nothing: null, or one of ``neutral`` of the same
    kind (so ``logprobs: 0``, which asks for log-probabilities, is not ``False``)."""
    if value is None:
        return True
    for candidate in neutral:
        if isinstance(candidate, bool) or isinstance(value, bool):
            if value is candidate:
                return True
        elif isinstance(candidate, (int, float)) and isinstance(value, (int, float)):
            if value == candidate:
                return True
        elif type(value) is type(candidate) and value == candidate:
            return True
    return False


def _generation(body: Mapping, *, chat: bool, max_tokens_field: str, default_max_tokens: int) -> Generation:
    inputs: dict[str, object] = {}
    fields: dict[str, str] = {}
    max_tokens = _integer(body, max_tokens_field, *INT32)
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    inputs["max_tokens"] = max_tokens
    if max_tokens_field != "max_tokens":
        fields["max_tokens"] = max_tokens_field
    # presence_penalty and frequency_penalty count the prompt's tokens too, as
    # TensorRT-LLM's penalties do (coordinator/sampling/penalties.py)
    for name in ("temperature", "top_p", "draft_temperature", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        inputs[name] = _number(body, name)
    for name in ("speculation_window", "top_k", "min_length"):
        inputs[name] = _integer(body, name, *INT32)
    inputs["adaptive_window"] = _boolean(body, "adaptive_window")
    inputs["drafter"] = _string(body, "drafter")
    inputs["random_seed"] = _integer(body, "seed", *UINT64)
    inputs["ab_key"] = _string(body, "user")  # the traffic split's key: a user stays in one arm
    inputs["stop_words"] = _stop(body.get("stop"))
    stream = bool(_boolean(body, "stream"))
    return Generation(
        chat=chat,
        inputs={name: value for name, value in inputs.items() if value is not None},
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_include_usage(body.get("stream_options")) and stream,
        fields=fields,
    )


def _integer(body: Mapping, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"{name} must be an integer, got {value!r}", param=name)
    if not low <= value <= high:
        raise OpenAIError(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def _number(body: Mapping, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIError(f"{name} must be a number, got {value!r}", param=name)
    if not math.isfinite(value):
        raise OpenAIError(f"{name} must be a finite number, got {value}", param=name)
    return float(value)


def _boolean(body: Mapping, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _string(body: Mapping, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"{name} must be a string, got {value!r}", param=name)
    return value


def _stop(value: object) -> list[str] | None:
    if value is None:
        return None
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise OpenAIError(f"stop must be a string or a list of strings, got {value!r}", param="stop")
    return words or None


def _include_usage(options: object) -> bool:
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise OpenAIError(f"stream_options must be an object, got {options!r}", param="stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise OpenAIError(f"stream_options.include_usage must be true or false, got {include!r}",
                          param="stream_options")
    return bool(include)


def _prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(item, (int, list)) for item in value):
        raise OpenAIError("prompt as token ids is not supported; send the text", param="prompt")
    if isinstance(value, list) and len(value) > 1:
        raise OpenAIError(f"prompt holds {len(value)} prompts; this server completes one per request",
                          param="prompt")
    raise OpenAIError(f"prompt is required: a string, got {value!r}", param="prompt")


def _messages(value: object) -> tuple[dict[str, str], ...]:
    """The conversation as role/content strings (``developer`` is the template's
    ``system``); anything that is not plain text is refused."""
    if not isinstance(value, list) or not value:
        raise OpenAIError("messages is required: a non-empty list of {role, content} objects", param="messages")
    conversation = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise OpenAIError(f"{where} must be an object with role and content", param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise OpenAIError(f"{where}.role must be one of {', '.join(CHAT_ROLES)} (there is no tool calling), "
                              f"got {role!r}", param="messages")
        for key, item in message.items():
            if key not in ("role", "content", "name") and item is not None:
                raise OpenAIError(f"{where}.{key} is not supported (plain text messages only)", param="messages")
        conversation.append({"role": CHAT_ROLES[role], "content": _content(message.get("content"), where)})
    return tuple(conversation)


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise OpenAIError(f"{where}.content[{index}] is {kind!r}; only text parts are supported",
                                  param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts, got {content!r}",
                      param="messages")
