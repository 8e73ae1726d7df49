"""Triton Python-backend adapter of the coordinator (a thin shim).

``execute`` is a coroutine and every engine call is an awaited BLS request,
so one instance serves many streams at once; each request's loop lives in
``coordinator.generation``."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from coordinator.config import CoordinatorSettings
from coordinator.engine_io import REQUESTED_OUTPUTS, engine_inputs, generated_tokens
from coordinator.generation import Chunk, generate_text
from coordinator.loop import EngineError
from coordinator.request import INPUT_NAMES, InputError, parse_request
from coordinator.sampling import SamplingParams
from coordinator.tokenizer import Codec, SpecialTokens

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BlsEngine:
    """The loop's Engine protocol over a BLS call to a tensorrtllm-contract model."""

    def __init__(self, model_name: str, special: SpecialTokens):
        self.model_name = model_name
        self.special = special

    async def generate(
        self, input_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams, draft_tokens=()
    ) -> list[int]:
        tensors = engine_inputs(
            input_ids,
            max_new_tokens,
            sampling,
            end_id=self.special.end_id,
            pad_id=self.special.pad_token_id,
            draft_tokens=draft_tokens,
        )
        request = pb_utils.InferenceRequest(
            model_name=self.model_name,
            inputs=[pb_utils.Tensor(name, array) for name, array in tensors.items()],
            requested_output_names=list(REQUESTED_OUTPUTS),
        )
        response = await request.async_exec()
        if response.has_error():
            raise EngineError(f"{self.model_name}: {response.error().message()}")
        output_ids = pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy()
        lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
        return generated_tokens(output_ids, lengths)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.settings = CoordinatorSettings.from_parameters(parameters)
        self.codec = Codec.from_dir(self.settings.tokenizer_dir)
        self.target = BlsEngine(self.settings.target_model_name, self.codec.special)
        self.draft = BlsEngine(self.settings.draft_model_name, self.codec.special)
        log.info("coordinator ready: %s", self.settings)

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request) -> None:
        sender = request.get_response_sender()
        try:
            raw = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                raw[name] = None if tensor is None else tensor.as_numpy()
            generation = parse_request(raw, self.settings, new_seed=lambda: secrets.randbits(63))
            pieces: list[str] = []
            chunks = generate_text(
                generation, self.codec, draft=self.draft, target=self.target, settings=self.settings
            )
            async for chunk in chunks:
                if _cancelled(request, sender):
                    await chunks.aclose()
                    sender.send(flags=FINAL)
                    return
                if generation.stream:
                    if chunk.text or chunk.final:
                        sender.send(_response(chunk.text, chunk if chunk.final else None),
                                    flags=FINAL if chunk.final else 0)
                else:
                    pieces.append(chunk.text)
                    if chunk.final:
                        sender.send(_response("".join(pieces), chunk), flags=FINAL)
        except InputError as error:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=FINAL)
        except EngineError as error:
            log.error("engine failure: %s", error)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=FINAL)
        except Exception as error:  # never leave a stream open
            log.exception("coordinator failure")
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"coordinator internal error: {error}")),
                flags=FINAL,
            )


def _cancelled(request, sender) -> bool:
    check = getattr(sender, "is_cancelled", None) or getattr(request, "is_cancelled", None)
    return bool(check and check())


def _response(text: str, final: Chunk | None):
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
    if final is not None:
        stats = final.stats
        tensors += [
            pb_utils.Tensor("total_draft_tokens", np.array([stats.draft_tokens], dtype=np.int32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([stats.accepted_draft_tokens], dtype=np.int32)),
            pb_utils.Tensor("acceptance_rate", np.array([stats.acceptance_rate], dtype=np.float32)),
            pb_utils.Tensor("completion_tokens", np.array([stats.completion_tokens], dtype=np.int32)),
        ]
    return pb_utils.InferenceResponse(output_tensors=tensors)
