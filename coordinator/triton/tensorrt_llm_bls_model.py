"""Triton Python-backend adapter of ``tensorrt_llm_bls``: NVIDIA's request
interface in front of the ``coordinator`` model (a thin shim).

Each batch item becomes one BLS request to ``coordinator``, so speculative
decoding, its settings and its server-wide cost model live in one place;
this model only translates (``coordinator/request/nvidia.py``) and shapes answers as
NVIDIA's BLS model does: ``text_output`` [1] per response, ``batch_index``
and ``sequence_index`` [1, 1], the prompt in front of a non-streamed text
unless ``exclude_input_in_output``. The ``ensemble`` model is a Triton
ensemble whose one step is this model.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing

import numpy as np
import triton_python_backend_utils as pb_utils

from coordinator.engines.contract import EngineError
from coordinator.request import nvidia
from coordinator.request.api import LOG_PROBS, STATISTICS
from coordinator.request.api import OUTPUTS as COORDINATOR_OUTPUTS
from coordinator.request.parse import InputError
from coordinator.triton.coordinator_model import asked_cancelled, bls_responses

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_REQUESTED = [spec.name for spec in COORDINATOR_OUTPUTS]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.coordinator = parameters.get("coordinator_model_name", nvidia.COORDINATOR_MODEL)

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request) -> None:
        sender = request.get_response_sender()
        try:
            raw = {}
            for name in nvidia.INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                raw[name] = None if tensor is None else tensor.as_numpy()
            items = nvidia.translate(raw)
            single = len(items) == 1
            await asyncio.gather(*(self._generate(item, sender, last=single) for item in items))
            if not single:
                _release_held_streams(sender)
                sender.send(flags=FINAL)
        except (InputError, EngineError) as error:
            message = nvidia.client_message(str(error).removeprefix(f"{self.coordinator}: "))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        except Exception as error:  # never leave a stream open
            log.exception("tensorrt_llm_bls failure")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {error}")),
                        flags=FINAL)

    async def _generate(self, item: nvidia.Item, sender, last: bool) -> None:
        """Send the item's answers; ``last``: its final answer ends the whole request."""
        completion = []
        async with aclosing(bls_responses(self.coordinator, item.inputs, _REQUESTED, decoupled=True)) as responses:
            async for response in responses:
                text = _text(response)
                # the coordinator's last response is the one with the statistics
                final = pb_utils.get_output_tensor_by_name(response, STATISTICS[0].name) is not None
                if final and last:
                    _release_held_streams(sender)
                if item.stream:
                    sender.send(_answer(item, text, response if final else None), flags=FINAL if final and last else 0)
                else:
                    completion.append(text)
                    if final:
                        sender.send(_answer(item, nvidia.final_text(item, "".join(completion)), response),
                                    flags=FINAL if last else 0)
                if final:
                    return
        raise EngineError(f"{self.coordinator}: the response stream ended without its final response")


def _release_held_streams(sender) -> None:
    """Before a request's final response (after it, Triton 2.51 may have freed what the
    question refers to): the answer lets go of the coordinator streams held before it,
    earlier requests' (coordinator_model.asked_cancelled)."""
    try:
        asked_cancelled(sender.is_cancelled)
    except Exception as error:  # noqa: BLE001 - the streams stay held until the next answer
        log.info("could not ask whether a request was cancelled: %s", error)


def _text(response) -> str:
    tensor = pb_utils.get_output_tensor_by_name(response, "text_output")
    if tensor is None:
        return ""
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _answer(item: nvidia.Item, text: str, statistics):
    tensors = [
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("batch_index", np.array([[item.batch_index]], dtype=np.int32)),
        pb_utils.Tensor("sequence_index", np.array([[0]], dtype=np.int32)),
    ]
    if statistics is not None:
        for spec in STATISTICS:
            tensor = pb_utils.get_output_tensor_by_name(statistics, spec.name)
            if tensor is not None:
                tensors.append(pb_utils.Tensor(spec.name, tensor.as_numpy().reshape(1, -1)))
        for spec in LOG_PROBS:  # NVIDIA's shapes: [batch, beam, n] and [batch, beam]
            tensor = pb_utils.get_output_tensor_by_name(statistics, spec.name)
            if tensor is not None:
                shape = (1, 1, -1) if spec.name == "output_log_probs" else (1, 1)
                tensors.append(pb_utils.Tensor(spec.name, tensor.as_numpy().reshape(shape)))
    return pb_utils.InferenceResponse(output_tensors=tensors)
