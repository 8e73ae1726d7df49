"""Admission control: the coordinator serves at most ``max_inflight_requests``
requests at once and answers the next one at once with a refusal, instead
of queueing it behind work the engines cannot take.

Each admitted request holds a slot from its arrival until just before its
final response is sent (so a client that starts its next request as soon as
it has the last one is never refused for its own finished request), or
until it failed or was cancelled. Refused requests never reach an engine;
the requests in flight go on untouched.

The refusal is an error response whose message starts with
``REFUSAL_PREFIX``: Triton 2.51's Python backend has no RESOURCE_EXHAUSTED
code, so the coordinator sends UNAVAILABLE (the gRPC status a client sees on
a stream opened with the ``triton_grpc_error`` header), and the
OpenAI-compatible frontend recognises the message and answers 429.
"""

from __future__ import annotations

import threading

REFUSAL_PREFIX = "server busy"


def refusal_message(limit: int) -> str:
    return (f"{REFUSAL_PREFIX}: {limit} requests are in flight, the most this server admits "
            "(max_inflight_requests); retry shortly or on another replica")


def is_refusal(message: str) -> bool:
    """Whether an error message is the coordinator's refusal (a client may
    see it behind a prefix, such as Triton's request id or a model name)."""
    return f"{REFUSAL_PREFIX}: " in message and "(max_inflight_requests)" in message


class Slot:
    """One admitted request's place; ``release`` may be called any number of times."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._leave()


class Admission:
    """Counts the requests in flight against ``limit``."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_inflight_requests must be at least 1, got {limit}")
        self.limit = limit
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self) -> Slot | None:
        """A slot for a new request, or None when ``limit`` requests hold one."""
        with self._lock:
            if self.limit and self._in_flight >= self.limit:
                return None
            self._in_flight += 1
        return Slot(self)

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
