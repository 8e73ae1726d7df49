"""One timed request to the ``coordinator`` over Triton's gRPC stream, read
with the tools' stream reader (tools/stream.py, which names the ways a
request fails), plus one more failure kind:

* ``no statistics``   the final response lacks ``completion_tokens`` & co.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient

from coordinator.request.api import Statistics
from tools.stream import MODEL, RequestFailed, final, responses

__all__ = ["MODEL", "RequestFailed", "Timing", "timed_completion"]


@dataclass
class Timing(Statistics):
    """What one request measured. Times are seconds since ``started`` (a
    ``time.time()`` stamp, so requests from several machines line up)."""

    started: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty text chunk
    text: str = ""

    @property
    def ttft(self) -> float | None:
        """Time to the first chunk of text (None: no text came)."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency: the time from the first chunk to the last,
        over the tokens that came after the first one. Chunks can carry several
        tokens (a speculative round emits up to window + 1), so the gaps between
        chunks are not the gaps between tokens; this is the per-token average."""
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.latency if self.latency > 0 else 0.0


def timed_completion(client: grpcclient.InferenceServerClient, inputs, *, timeout: float,
                     request_id: str = "") -> Timing:
    """Send one request on a new stream of ``client`` and wait for its final
    response. Raises :class:`RequestFailed`; on failure (or when the calling
    greenlet is killed) the stream is cancelled, so the server stops generating."""
    timing = Timing(started=time.time())
    for arrived, delta, result in responses(client, inputs, timeout=timeout, request_id=request_id):
        if delta:
            timing.chunk_times.append(arrived)
            timing.text += delta
        timing.read(result.as_numpy)  # the statistics, on the final response
        timing.latency = arrived
        if final(result) and result.as_numpy("completion_tokens") is None and not timing.completion_tokens:
            raise RequestFailed("no statistics", "the final response carries no completion_tokens")
    return timing

