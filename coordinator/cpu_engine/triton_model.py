"""Triton Python-backend adapter of the CPU engine (models ``target`` and
``draft`` in the cpu profile). Reads the tensorrtllm-style inputs, runs the
engine, writes ``output_ids`` [1, 1, n], ``sequence_length`` [1, 1] and, when
asked, ``generation_logits`` [1, 1, n, vocab]."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from coordinator.config import expand_env
from coordinator.cpu_engine.engine import KNOWN_PARAMETERS, CausalLMEngine, EngineRequest, EngineRequestError
from coordinator.cpu_engine.faults import FaultConfigError, FaultInjector
from coordinator.sampling import SamplingParams

log = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        unknown = sorted(set(params) - KNOWN_PARAMETERS)
        if unknown:
            raise pb_utils.TritonModelException(f"{args['model_name']}: unknown parameter(s) {', '.join(unknown)}")
        if params.get("exclude_input_in_output", "true").lower() != "true":
            raise pb_utils.TritonModelException("the CPU engine only implements exclude_input_in_output=true")
        try:
            self.faults = FaultInjector.from_environment(args["model_name"], os.environ)
        except FaultConfigError as error:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {error}") from None
        if self.faults:
            log.warning("%s: TEST-ONLY FAULT INJECTION ENABLED for seeds %s", args["model_name"],
                        sorted(self.faults.rules))
        model_dir = expand_env(params["model_dir"], os.environ, "model_dir")
        reuse = params.get("enable_kv_cache_reuse", "true").lower() == "true"
        self.engine = CausalLMEngine(
            model_dir,
            dtype=params.get("dtype", "float32"),
            num_threads=int(params.get("num_threads", "0")),
            max_cached_sequences=int(params.get("max_cached_sequences", "8")) if reuse else 0,
            max_context_tokens=int(params.get("max_context_tokens", "4096")),
            decode_rows=int(params.get("decode_rows", "0")),
            weight_quantization=params.get("weight_quantization", "none"),
        )
        self.name = args["model_name"]
        self._pool_gauges = _pool_gauges(self.name)
        self._report_pool()

    def execute(self, requests):
        responses = [self._serve(request) for request in requests]
        self._report_pool()
        return responses

    def _report_pool(self) -> None:
        if self._pool_gauges is not None:
            sequences, tokens = self._pool_gauges[:2]
            sequences.set(len(self.engine.pool))
            tokens.set(self.engine.pool.cached_tokens)

    def _serve(self, request):
        try:
            engine_request = _read_request(request)
            if self.faults:
                self.faults.apply(engine_request.sampling.seed, int(engine_request.input_ids.size))
            result = self.engine.run(engine_request)
        except EngineRequestError as error:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.name}: {error}"))
        except Exception as error:  # keep serving other requests
            log.exception("%s failed", self.name)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.name}: internal error: {error}"))
        n = len(result.tokens)
        outputs = [
            pb_utils.Tensor("output_ids", np.asarray(result.tokens, dtype=np.int32).reshape(1, 1, n)),
            pb_utils.Tensor("sequence_length", np.asarray([[n]], dtype=np.int32)),
        ]
        if result.logits is not None:
            outputs.append(
                pb_utils.Tensor("generation_logits", result.logits.astype(np.float32).reshape(1, 1, n, -1))
            )
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self):
        self.engine.pool.clear()


def _pool_gauges(model_name: str):
    """Gauges of the KV-cache pool on Triton's metrics port, labelled by model.

    ``specdec_engine_cached_sequences``: sequences whose KV cache the engine
    keeps between calls (at most max_cached_sequences); ``specdec_engine_cached_tokens``:
    the tokens they hold. Nothing else survives an engine call."""
    try:
        sequences = pb_utils.MetricFamily(
            name="specdec_engine_cached_sequences",
            description="Sequences whose KV cache the CPU engine keeps for prefix reuse (bounded by max_cached_sequences)",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        tokens = pb_utils.MetricFamily(
            name="specdec_engine_cached_tokens",
            description="Tokens held in the CPU engine's KV-cache pool",
            kind=pb_utils.MetricFamily.GAUGE,
        )
    except Exception as error:  # metrics disabled or unsupported: serve without them
        log.warning("%s: no KV-cache pool metrics: %s", model_name, error)
        return None
    labels = {"model": model_name}
    # keep the families alive as long as the metrics
    return sequences.Metric(labels=labels), tokens.Metric(labels=labels), sequences, tokens


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name, default):
    value = _optional(request, name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0].item()


def _read_request(request) -> EngineRequest:
    input_ids = _optional(request, "input_ids")
    if input_ids is None:
        raise EngineRequestError("input_ids is required")
    input_ids = input_ids.reshape(-1)
    length = int(_scalar(request, "input_lengths", input_ids.size))
    if not 0 < length <= input_ids.size:
        raise EngineRequestError(f"input_lengths must be between 1 and the size of input_ids ({input_ids.size})")
    drafts = _optional(request, "draft_input_ids")
    draft_logits = _optional(request, "draft_logits")
    if draft_logits is not None:
        draft_logits = draft_logits.reshape(draft_logits.shape[-2], draft_logits.shape[-1])
    end_id = _scalar(request, "end_id", None)
    # Like TensorRT-LLM: neither top-k nor top-p given means greedy decoding.
    unfiltered = _optional(request, "runtime_top_k") is None and _optional(request, "runtime_top_p") is None
    return EngineRequest(
        input_ids=input_ids[:length],
        max_new_tokens=int(_scalar(request, "request_output_len", 1)),
        sampling=SamplingParams(
            temperature=float(_scalar(request, "temperature", 1.0)),
            top_k=1 if unfiltered else int(_scalar(request, "runtime_top_k", 0)),
            top_p=float(_scalar(request, "runtime_top_p", 1.0)),
            seed=int(_scalar(request, "random_seed", 0)),
        ),
        end_id=None if end_id is None else int(end_id),
        draft_tokens=None if drafts is None or drafts.size == 0 else drafts.reshape(-1),
        draft_logits=draft_logits,
        return_logits=bool(_scalar(request, "return_generation_logits", False)),
    )
