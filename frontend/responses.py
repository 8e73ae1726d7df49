"""The coordinator's responses as OpenAI bodies, stream chunks and SSE events.

Every non-streamed body and the last chunk of a stream carry ``speculation``:
the coordinator's statistics keyed by their wire names (coordinator/request/api.py),
so an OpenAI client sees how its text was decoded (``response.model_extra``
in the ``openai`` package)."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np

from coordinator.request.api import Statistics

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(completion_tokens: int, max_tokens: int) -> str:
    """"length" when the completion used every token it was allowed, else "stop"
    (an end-of-sequence token or a stop word)."""
    return "length" if completion_tokens >= max_tokens else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(statistics: Statistics) -> dict:
    """The statistics by wire name; FP32 ones at float32's precision (0.8, not
    0.800000011920929)."""
    values = {}
    for name, array in statistics.outputs().items():
        value = np.asarray(array).reshape(-1)[0]
        if isinstance(value, bytes):
            values[name] = value.decode("utf-8", "replace")
        elif isinstance(value, np.floating):
            values[name] = float(f"{float(value):.7g}")
        else:
            values[name] = value.item()
    return values


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "specdec"}


class Reply:
    """The OpenAI bodies of one request, all with the same id and creation time."""

    def __init__(self, chat: bool, model: str, max_tokens: int, include_usage: bool = False,
                 created: int | None = None, request_id: str | None = None):
        self.chat = chat
        self.model = model
        self.max_tokens = max_tokens
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created
        self.id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._role_sent = False

    def body(self, text: str, statistics: Statistics, prompt_tokens: int) -> dict:
        """A non-streamed response."""
        finish = finish_reason(statistics.completion_tokens, self.max_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
            "model": self.model, "choices": [choice], "usage": usage(prompt_tokens, statistics.completion_tokens),
            "speculation": speculation(statistics),
        }

    def chunks(self, text: str, statistics: Statistics | None = None, prompt_tokens: int | None = None) -> list[dict]:
        """The stream chunks for one coordinator response (``statistics``: the
        final one's; ``prompt_tokens``: needed then when usage is included)."""
        finish = None if statistics is None else finish_reason(statistics.completion_tokens, self.max_tokens)
        if self.chat:
            delta = {"content": text} if text or statistics is None else {}
            if not self._role_sent:
                delta = {"role": "assistant", "content": text}
                self._role_sent = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        chunks = [self._chunk([choice])]
        if statistics is not None:
            if self.include_usage:
                if prompt_tokens is None:
                    raise ValueError("the usage chunk needs prompt_tokens")
                chunks.append(self._chunk([], usage(prompt_tokens, statistics.completion_tokens)))
            chunks[-1]["speculation"] = speculation(statistics)
        return chunks

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage_  # null on every chunk but the last, as OpenAI sends it
        return chunk
