"""One timed request to the ``coordinator`` over Triton's gRPC stream.

Like ``coordinator.client.stream_completion``, but it keeps the arrival time
of every response and turns every way a request can go wrong into a
:class:`RequestFailed` with a short, stable ``kind`` (locust groups failures
by message):

* ``error response``  the server answered with an error (bad input, engine failure);
* ``rpc error``       the gRPC call failed (server unreachable or going away);
* ``stream ended``    the stream closed without a final response;
* ``timeout``         no final response within the request's timeout;
* ``no statistics``   the final response lacks ``completion_tokens`` & co.

Works with plain threads and under gevent, provided that, under gevent,
``grpc.experimental.gevent.init_gevent()`` ran before the first gRPC object
was created (the locustfile does it): without it grpcio's completion-queue
thread blocks the gevent hub and the first streaming request hangs.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from coordinator.api import Statistics

MODEL = "coordinator"
POLL_SECONDS = 0.5  # how often a waiting request checks that its stream is still open


class RequestFailed(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


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


def _final(response) -> bool:
    flag = response.parameters.get("triton_final_response")
    return bool(flag is not None and flag.bool_param)


def _stream_closed(client: grpcclient.InferenceServerClient) -> bool:
    # tritonclient reports neither the end of the response iterator nor its
    # thread; its handler thread ending is the only sign that the server closed
    # the stream. Private attributes: if they change, only the timeout remains.
    handler = getattr(getattr(client, "_stream", None), "_handler", None)
    return handler is not None and not handler.is_alive()


def timed_completion(client: grpcclient.InferenceServerClient, inputs, *, timeout: float,
                     request_id: str = "") -> Timing:
    """Send one request on a new stream of ``client`` and wait for its final
    response. Raises :class:`RequestFailed`; on failure (or when the calling
    greenlet is killed) the stream is cancelled, so the server stops generating."""
    responses: queue.Queue = queue.Queue()
    timing = Timing(started=time.time())
    start = time.perf_counter()
    deadline = start + timeout
    finished = False
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)),
                        stream_timeout=timeout + 5)
    try:
        client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise RequestFailed("timeout", f"no final response after {timeout:g} s")
            try:
                arrived, result, error = responses.get(timeout=min(POLL_SECONDS, remaining))
            except queue.Empty:
                if _stream_closed(client) and responses.empty():
                    raise RequestFailed("stream ended", "the stream closed without a final response") from None
                continue
            if error is not None:
                message = error.message() if isinstance(error, InferenceServerException) else str(error)
                status = error.status() if isinstance(error, InferenceServerException) else None
                if status and "DEADLINE_EXCEEDED" in str(status):
                    raise RequestFailed("timeout", message)
                # Errors from the model arrive as error responses without a gRPC status.
                raise RequestFailed("rpc error" if status else "error response", message)
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                delta = text.reshape(-1)[0]
                delta = delta.decode("utf-8", "replace") if isinstance(delta, bytes) else str(delta)
                if delta:
                    timing.chunk_times.append(arrived - start)
                    timing.text += delta
            timing.read(result.as_numpy)  # the statistics, on the final response
            if _final(result.get_response()):
                timing.latency = arrived - start
                if result.as_numpy("completion_tokens") is None and not timing.completion_tokens:
                    raise RequestFailed("no statistics", "the final response carries no completion_tokens")
                finished = True
                return timing
    finally:
        # A finished stream closes gracefully; anything else (failure, timeout,
        # the user greenlet being killed at the end of a step) cancels the call.
        client.stop_stream(cancel_requests=not finished)
