"""The one reader of the coordinator's gRPC response stream: the client, the
bench, the soak and the load test all read through ``responses``.

It keeps every response's arrival time and turns every way a request can go
wrong into a :class:`RequestFailed` with a short, stable ``kind`` (locust
groups failures by it):

* ``error response``  the server answered with an error (bad input, engine failure);
* ``server busy``     the coordinator refused the request: max_inflight_requests
                      were in flight (coordinator/request/admission.py);
* ``rpc error``       the gRPC call failed (server unreachable or going away);
* ``stream ended``    the stream closed without a final response;
* ``timeout``         no final response within the request's timeout.

A reader that stops early (closes the iterator) cancels the request, so the
server stops generating. Works with plain threads and under gevent, provided
that, under gevent, ``grpc.experimental.gevent.init_gevent()`` ran before the
first gRPC object was created (the locustfile does it): without it grpcio's
completion-queue thread blocks the gevent hub and the first streaming request
hangs.

Requests carry Triton's inference API key from ``SPECDEC_API_KEY``
(coordinator/request/access.py) unless the caller passes ``headers``.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Mapping

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from coordinator.request.access import api_key_from_env, grpc_headers
from coordinator.request.admission import is_refusal

MODEL = "coordinator"
POLL_SECONDS = 0.5  # how often a waiting request checks that its stream is still open


class RequestFailed(InferenceServerException):
    """A request that did not complete; ``message()`` is the server's or the transport's words."""

    def __init__(self, kind: str, detail: str = "", status: str | None = None):
        super().__init__(detail or kind, status)
        self.kind = kind
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def final(result) -> bool:
    flag = result.get_response().parameters.get("triton_final_response")
    return bool(flag is not None and flag.bool_param)


def text_delta(result) -> str:
    text = result.as_numpy("text_output")
    if text is None or not text.size:
        return ""
    delta = text.reshape(-1)[0]
    return delta.decode("utf-8", "replace") if isinstance(delta, bytes) else str(delta)


def _stream_closed(client: grpcclient.InferenceServerClient) -> bool:
    # tritonclient reports neither the end of the response iterator nor its
    # thread; its handler thread ending is the only sign that the server closed
    # the stream. Private attributes: if they change, only the timeout remains.
    handler = getattr(getattr(client, "_stream", None), "_handler", None)
    return handler is not None and not handler.is_alive()


def responses(client: grpcclient.InferenceServerClient, inputs, *, timeout: float, request_id: str = "",
              model: str = MODEL, headers: Mapping[str, str] | None = None) -> Iterator[tuple[float, str, object]]:
    """Send one request on a new stream of ``client``; yield (seconds since it was sent, its
    text delta, the ``InferResult``) for every response up to and including the final one.
    ``headers``: the stream's gRPC metadata; None: the API key in SPECDEC_API_KEY, if any."""
    if headers is None:
        headers = grpc_headers(api_key_from_env())
    arrivals: queue.Queue = queue.Queue()
    start = time.perf_counter()
    deadline = start + timeout
    finished = False
    client.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), result, error)),
                        stream_timeout=timeout + 5, headers=headers)
    try:
        try:
            client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        except InferenceServerException as error:
            # The stream failed before the request went out (Triton refused it: a
            # missing or wrong API key); the reason comes through the callback.
            try:
                _, _, reason = arrivals.get(timeout=POLL_SECONDS)
            except queue.Empty:
                reason = error
            status = reason.status() if isinstance(reason, InferenceServerException) else None
            detail = reason.message() if isinstance(reason, InferenceServerException) else str(reason)
            raise RequestFailed("rpc error", detail, status) from None
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise RequestFailed("timeout", f"no final response after {timeout:g} s")
            try:
                arrived, result, error = arrivals.get(timeout=min(POLL_SECONDS, remaining))
            except queue.Empty:
                if _stream_closed(client) and arrivals.empty():
                    raise RequestFailed("stream ended", "the stream closed without a final response") from None
                continue
            if error is not None:
                message = error.message() if isinstance(error, InferenceServerException) else str(error)
                status = error.status() if isinstance(error, InferenceServerException) else None
                if status and "DEADLINE_EXCEEDED" in str(status):
                    raise RequestFailed("timeout", message, status)
                if is_refusal(message):
                    raise RequestFailed("server busy", message, status)
                # Errors from the model arrive as error responses without a gRPC status.
                raise RequestFailed("rpc error" if status else "error response", message, status)
            is_final = final(result)
            finished = is_final
            yield arrived - start, text_delta(result), result
            if is_final:
                return
    finally:
        # A finished stream closes gracefully; anything else (failure, timeout,
        # a reader that left early, the user greenlet being killed) cancels the call.
        client.stop_stream(cancel_requests=not finished)
