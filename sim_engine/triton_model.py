"""Triton Python-backend adapter of the simulated engine (models ``target``
and ``draft`` in the sim profile): the tensorrtllm-style inputs and outputs
of the CPU engine's adapter (cpu_engine/triton_model.py), decoupled, one
engine thread that runs a forward over whatever is queued, then sleeps out
the forward's time from the preset's table (sim_engine/presets.py)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from coordinator.settings import expand_env
from sim_engine.engine import SimEngine
from trtllm_emulation.requests import EngineRequest, EngineRequestError, read_request
from sim_engine.lm import SyntheticLM
from sim_engine.presets import UnknownPreset, preset

log = logging.getLogger(__name__)
KNOWN_PARAMETERS = {"role", "preset", "model_dir", "max_num_tokens", "max_draft_len", "max_context_tokens",
                    "max_cached_sequences", "exclude_input_in_output", "enable_kv_cache_reuse",
                    "reload_generation"}


def vocab_size(model_dir: str) -> int:
    """The real model's vocabulary size, from its config.json (no weights read)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        unknown = sorted(set(params) - KNOWN_PARAMETERS)
        if unknown:
            raise pb_utils.TritonModelException(f"{self.name}: unknown parameter(s) {', '.join(unknown)}")
        role = params.get("role", self.name)
        if role not in ("target", "draft"):
            raise pb_utils.TritonModelException(f"{self.name}: role must be target or draft, got {role!r}")
        try:
            chosen = preset(expand_env(params.get("preset", "h100-8b-1b"), os.environ, "preset"))
        except UnknownPreset as error:
            raise pb_utils.TritonModelException(f"{self.name}: {error}") from None
        vocab = vocab_size(expand_env(params["model_dir"], os.environ, "model_dir"))
        lm = SyntheticLM(vocab, role, chosen.agreement, chosen.second_choice)
        reuse = params.get("enable_kv_cache_reuse", "true").lower() == "true"
        self.engine = SimEngine(
            lm, chosen.step(role),
            max_num_tokens=int(params.get("max_num_tokens", "8192")),
            max_draft_len=int(params.get("max_draft_len", "8")),
            max_context_tokens=int(params.get("max_context_tokens", "4096")),
            max_cached_sequences=int(params.get("max_cached_sequences", "256")) if reuse else 0,
        )
        self._senders: dict[int, tuple[object, bool]] = {}
        self._streamed: dict[int, int] = {}
        self._wake = threading.Condition()
        self._incoming: list[tuple[object, EngineRequest, bool, float]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-sim", daemon=True)
        self._thread.start()
        log.info("%s: sim engine, preset %s, vocabulary %d", self.name, chosen.name, vocab)

    def execute(self, requests):
        arrived = time.monotonic()  # the engine's clock: its forwards may count from here
        for request in requests:
            sender = request.get_response_sender()
            try:
                sim_request = _read_request(request)
                streaming = bool(_scalar(request, "streaming", False))
            except EngineRequestError as error:
                _send_error(sender, f"{self.name}: {error}")
                continue
            with self._wake:
                self._incoming.append((sender, sim_request, streaming, arrived))
                self._wake.notify()
        return None

    def _run(self) -> None:
        """Admit what is queued, run one forward (it sleeps its time), answer finished calls.
        As TensorRT-LLM's executor: no forward waits for calls on their way."""
        while True:
            with self._wake:
                while not self._incoming and not self.engine.pending() and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
            for sender, sim_request, streaming, arrived in incoming:
                try:
                    call = self.engine.submit(sim_request, on_tokens=self._stream if streaming else None,
                                              arrived=arrived)
                except EngineRequestError as error:
                    _send_error(sender, f"{self.name}: {error}")
                    continue
                self._senders[id(call)] = (sender, streaming)
            try:
                done = self.engine.step()
            except Exception as error:
                log.exception("%s: sim step failed", self.name)
                done = self.engine.fail_all(error)
            for call in done:
                self._answer(call)

    def _stream(self, call, tokens) -> None:
        if not call.finished:
            sender, _ = self._senders[id(call)]
            log_probs = None if call.plain.log_probs is None else call.plain.log_probs[-len(tokens):]
            _send(sender, tokens, None, flags=0, log_probs=log_probs)
            self._streamed[id(call)] = self._streamed.get(id(call), 0) + len(tokens)

    def _answer(self, call) -> None:
        sender, streaming = self._senders.pop(id(call))
        streamed = self._streamed.pop(id(call), 0)
        try:
            result = self.engine.result(call)
        except Exception as error:
            _send_error(sender, f"{self.name}: internal error: {error}")
            return
        tokens, logits, log_probs = result.tokens, result.logits, result.log_probs
        if streaming and call.plain is not None:
            tokens, logits = tokens[streamed:], None
            log_probs = None if log_probs is None else log_probs[streamed:]
        _send(sender, tokens, logits, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, log_probs=log_probs)

    def finalize(self):
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)


def _send(sender, tokens, logits, flags, log_probs=None) -> None:
    n = len(tokens)
    outputs = [
        pb_utils.Tensor("output_ids", np.asarray(tokens, dtype=np.int32).reshape(1, 1, n)),
        pb_utils.Tensor("sequence_length", np.asarray([[n]], dtype=np.int32)),
    ]
    if log_probs is not None:
        values = np.asarray(log_probs, dtype=np.float32)[:n]
        outputs.append(pb_utils.Tensor("output_log_probs", values.reshape(1, 1, -1)))
        outputs.append(pb_utils.Tensor("cum_log_probs", np.asarray([[values.sum()]], dtype=np.float32)))
    if logits is not None:
        outputs.append(pb_utils.Tensor("generation_logits", logits.astype(np.float32, copy=False).reshape(1, 1, n, -1)))
    sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)


def _send_error(sender, message: str) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name, default):
    value = _optional(request, name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0].item()


def _read_request(request) -> EngineRequest:
    """The inputs as every engine adapter here reads them (trtllm_emulation/requests.py)."""
    return read_request(lambda name: _optional(request, name))

