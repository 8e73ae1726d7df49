"""A stand-in for Triton's gRPC endpoint that speaks the ``coordinator``
model's streaming contract, with no model behind it.

It exists to test the locustfile's accounting (and to dry-run a load-test
setup) in seconds: it answers ``ModelStreamInfer`` with ``max_tokens`` fake
tokens, one chunk per round (``speculation_window`` + 1 tokens when
speculating, 1 when not), the final response carrying the coordinator's
statistics and Triton's ``triton_final_response`` parameter. Prompts that
contain a marker misbehave on purpose, to check that failures are counted:

* ``#fake:error``   an error response (as for invalid input);
* ``#fake:nofinal`` two chunks, then the stream ends without a final response;
* ``#fake:hang``    nothing at all (the client's timeout must fire);
* ``#fake:abort``   the RPC fails with UNAVAILABLE (a server going away);
* ``#fake:slow``    a normal answer, 3 s late (a request longer than a phase);
* ``#fake:busy``    the coordinator's refusal at max_inflight_requests.

With an API key (``serve(api_key=...)``; ``main``: ``SPECDEC_API_KEY``) it
refuses streams without it as Triton's restricted inference does.

Run: ``python -m loadtests.fake_triton --port 8001`` (prints ``ready <port>``).
"""

from __future__ import annotations

import argparse
import signal
import struct
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from coordinator.request.access import GRPC_API_KEY_HEADER, api_key_from_env
from coordinator.request.admission import refusal_message
from coordinator.request.api import STATISTICS, Statistics

MODEL = "coordinator"
DEFAULT_WINDOW = 5
_END_STREAM = object()


def _decode_inputs(request) -> dict[str, np.ndarray]:
    values = {}
    for index, tensor in enumerate(request.inputs):
        raw = request.raw_input_contents[index] if index < len(request.raw_input_contents) else b""
        if tensor.datatype == "BYTES":
            items, offset = [], 0
            while offset < len(raw):
                (length,) = struct.unpack_from("<I", raw, offset)
                items.append(raw[offset + 4: offset + 4 + length])
                offset += 4 + length
            values[tensor.name] = np.array(items, dtype=np.object_)
        else:
            dtype = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}[tensor.datatype]
            values[tensor.name] = np.frombuffer(raw, dtype=dtype)
    return values


def _tensor(response, name: str, datatype: str, raw: bytes) -> None:
    output = response.outputs.add()
    output.name = name
    output.datatype = datatype
    output.shape.append(1)
    response.raw_output_contents.append(raw)


def _response(request, text: str, stats: Statistics | None, final: bool):
    response = service_pb2.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id)
    encoded = text.encode("utf-8")
    _tensor(response, "text_output", "BYTES", struct.pack("<I", len(encoded)) + encoded)
    if stats is not None:  # every statistic of the public contract, as the coordinator sends them
        for spec in STATISTICS:
            array = stats.outputs()[spec.name]
            if spec.data_type == "TYPE_STRING":
                raw = b"".join(struct.pack("<I", len(item)) + item for item in array)
            else:
                raw = array.tobytes()
            _tensor(response, spec.name, spec.wire_type, raw)
    response.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=response)


class FakeCoordinator(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, token_seconds: float, first_token_seconds: float, server_window: int = DEFAULT_WINDOW,
                 api_key: str | None = None):
        self.api_key = api_key
        self.token_seconds = token_seconds
        self.first_token_seconds = first_token_seconds
        self.server_window = server_window
        self.lock = threading.Lock()
        self.requests = 0

    def ServerLive(self, request, context):  # noqa: N802 (gRPC method name)
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):  # noqa: N802
        return service_pb2.ModelReadyResponse(ready=request.name == MODEL)

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        if self.api_key is not None and dict(context.invocation_metadata()).get(GRPC_API_KEY_HEADER) != self.api_key:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"This protocol is restricted, expecting header '{GRPC_API_KEY_HEADER}'")
        for request in request_iterator:
            with self.lock:
                self.requests += 1
            if request.model_name != MODEL:
                yield service_pb2.ModelStreamInferResponse(error_message=f"Request for unknown model: '{request.model_name}'")
                continue
            for response in self._generate(request, context):
                if response is _END_STREAM:
                    return  # the RPC ends with status OK while the request is unfinished
                yield response

    def _generate(self, request, context):
        inputs = _decode_inputs(request)
        prompt = inputs["text_input"][0].decode("utf-8", "replace")
        max_tokens = int(inputs.get("max_tokens", np.array([128]))[0])
        stream = bool(inputs.get("stream", np.array([False]))[0])
        window = int(inputs.get("speculation_window", np.array([self.server_window]))[0])
        if "#fake:error" in prompt:
            yield service_pb2.ModelStreamInferResponse(error_message="fake error: max_tokens must be between 1 and 1024")
            return
        if "#fake:busy" in prompt:
            yield service_pb2.ModelStreamInferResponse(error_message=refusal_message(8))
            return
        if "#fake:abort" in prompt:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake abort: server going away")
        if "#fake:hang" in prompt:
            while context.is_active():
                time.sleep(0.05)
            return
        time.sleep(self.first_token_seconds + (3.0 if "#fake:slow" in prompt else 0.0))
        emitted, drafted, accepted, pieces = 0, 0, 0, []
        while emitted < max_tokens:
            step = min(window + 1, max_tokens - emitted) if window > 0 else 1
            if window > 0 and max_tokens - emitted > 1:
                drafted += min(window, max_tokens - emitted - 1)
                accepted += step - 1
            emitted += step
            chunk = " tok" * step
            time.sleep(self.token_seconds * (1 if window > 0 else step))
            if "#fake:nofinal" in prompt and emitted > 2 * step:
                yield _END_STREAM
                return
            if stream:
                yield _response(request, chunk, None, False)
            else:
                pieces.append(chunk)
            if not context.is_active():
                return
        stats = Statistics(draft_tokens=drafted, accepted_draft_tokens=accepted,
                           acceptance_rate=accepted / drafted if drafted else 0.0, completion_tokens=emitted)
        yield _response(request, "" if stream else "".join(pieces), stats, True)


def serve(port: int, token_seconds: float = 0.01, first_token_seconds: float = 0.05,
          address: str = "127.0.0.1", api_key: str | None = None) -> tuple[grpc.Server, FakeCoordinator, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    servicer = FakeCoordinator(token_seconds, first_token_seconds, api_key=api_key)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{address}:{port}")
    server.start()
    return server, servicer, bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.fake_triton", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    parser.add_argument("--token-seconds", type=float, default=0.01, help="delay per round (default 0.01)")
    parser.add_argument("--first-token-seconds", type=float, default=0.05, help="delay before the first round")
    args = parser.parse_args(argv)
    server, _, port = serve(args.port, args.token_seconds, args.first_token_seconds, args.address,
                            api_key_from_env())
    print(f"ready {port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.stop(grace=1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
