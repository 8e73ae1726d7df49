"""The coordinator over gRPC streaming (``tritonclient.grpc.aio``): one
``stream_infer`` per request on one shared channel.

A request's stream stays open until its final response, and a reader that
leaves early (an HTTP client that disconnected) cancels the call, so the
coordinator stops generating within a round."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from coordinator.request.access import grpc_headers
from coordinator.request.api import INPUTS, Statistics

MODEL = "coordinator"
_SPECS = {spec.name: spec for spec in INPUTS}


class CoordinatorFailure(Exception):
    """The coordinator answered with an error (``message``: its words), or could
    not be reached (``transport``)."""

    def __init__(self, message: str, transport: bool = False):
        super().__init__(message)
        self.message = message
        self.transport = transport


@dataclass
class Piece:
    """One coordinator response: a text delta, and on the final one the statistics."""

    text: str
    statistics: Statistics | None = None

    @property
    def final(self) -> bool:
        return self.statistics is not None


def infer_inputs(values: Mapping[str, object]) -> list[grpcclient.InferInput]:
    """Tensors typed by the coordinator's contract (coordinator/request/api.py)."""
    tensors = []
    for name, value in values.items():
        spec = _SPECS[name]
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if spec.data_type == "TYPE_STRING":
            array = np.array([str(item).encode("utf-8") for item in items], dtype=np.object_)
        else:
            array = np.array(items, dtype=spec.numpy_dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), spec.wire_type)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


class CoordinatorClient:
    def __init__(self, url: str, model: str = MODEL, api_key: str | None = None):
        """``api_key``: Triton's inference key, sent with every request (None: none)."""
        self.url = url
        self.model = model
        self._headers = grpc_headers(api_key)
        self._client = grpcaio.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready()) and bool(await self._client.is_model_ready(self.model))
        except (InferenceServerException, grpc.RpcError):
            return False

    async def close(self) -> None:
        await self._client.close()

    async def generate(self, inputs: Mapping[str, object]) -> AsyncIterator[Piece]:
        """The request's responses up to the final one (raises CoordinatorFailure)."""
        finished = asyncio.Event()
        request = {"model_name": self.model, "inputs": infer_inputs(inputs)}

        async def requests():
            yield request
            await finished.wait()  # half-closing before the final response could end the stream early

        call = self._client.stream_infer(requests(), headers=self._headers)
        complete = False
        try:
            async for result, error in call:
                if error is not None:
                    complete = True  # an error response is the request's last
                    raise CoordinatorFailure(error.message())
                parameters = result.get_response().parameters
                final = "triton_final_response" in parameters and parameters["triton_final_response"].bool_param
                text = result.as_numpy("text_output")
                delta = text.reshape(-1)[0] if text is not None and text.size else b""
                statistics = None
                if final:
                    statistics = Statistics()
                    statistics.read(result.as_numpy)
                    complete = True
                    finished.set()
                yield Piece(delta.decode("utf-8", "replace") if isinstance(delta, bytes) else str(delta), statistics)
                if final:
                    return
            raise CoordinatorFailure("the coordinator's stream ended without a final response", transport=True)
        except grpc.RpcError as error:
            details = error.details() if hasattr(error, "details") else str(error)
            raise CoordinatorFailure(f"the coordinator at {self.url} is unreachable: {details}",
                                     transport=True) from None
        finally:
            finished.set()
            if not complete:
                call.cancel()
