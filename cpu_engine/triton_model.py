"""Triton Python-backend adapter of the CPU engine (models ``target`` and
``draft`` in the cpu profile). Reads the tensorrtllm-style inputs, runs the
engine, writes ``output_ids`` [1, 1, n], ``sequence_length`` [1, 1] and, when
asked, ``generation_logits`` [1, 1, n, vocab].

The model is decoupled, as TensorRT-LLM's is with in-flight batching:
``execute`` only queues the calls, and one engine thread runs forwards over
whatever is queued, so calls that arrive during a forward join the next one.
With ``streaming`` true, a plain call sends its tokens as they are generated
(one response per forward, the last one flagged final); otherwise one
response with all tokens, flagged final."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from coordinator.settings import expand_env
from coordinator.triton.logs import log_to_stderr
from cpu_engine.engine import (
    DEFAULT_MAX_DRAFT_LEN,
    KNOWN_PARAMETERS,
    CausalLMEngine,
    EngineRequest,
    EngineRequestError,
)
from cpu_engine.faults import FaultConfigError, FaultInjector
from cpu_engine.turns import ForwardTurns
from trtllm_emulation.requests import read_request

log = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args):
        log_to_stderr("cpu_engine")  # the start-up choices measured on this machine, into Triton's log
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
        try:
            self._turns = ForwardTurns.from_environment(os.environ)
        except ValueError as error:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {error}") from None
        model_dir = expand_env(params["model_dir"], os.environ, "model_dir")
        reuse = params.get("enable_kv_cache_reuse", "true").lower() == "true"
        settings = dict(
            model_dir=model_dir,
            dtype=params.get("dtype", "float32"),
            num_threads=int(params.get("num_threads", "0")),
            max_cached_sequences=int(params.get("max_cached_sequences", "8")) if reuse else 0,
            max_context_tokens=int(params.get("max_context_tokens", "4096")),
            max_num_tokens=int(params.get("max_num_tokens", "64")),
            max_draft_len=int(params.get("max_draft_len", DEFAULT_MAX_DRAFT_LEN)),
            row_invariant=params.get("row_invariant", "true"),
            weight_quantization=params.get("weight_quantization", "none"),
            linear_kernel=params.get("linear_kernel", "auto"),
            prompt_block=params.get("prompt_block", "auto"),
        )
        self.name = args["model_name"]
        self._senders: dict[int, tuple[object, bool]] = {}  # call id -> (response sender, streaming)
        self._streamed: dict[int, int] = {}  # call id -> tokens already streamed
        self._wake = threading.Condition()
        self._incoming: list[tuple[object, EngineRequest, bool]] = []
        self._arrivals = 0  # calls queued since start: which came after a forward's answers
        self._stopping = False
        self._gauges = _engine_gauges(self.name)
        # The engine is built on the thread that runs its forwards (_engine_thread),
        # which answers with None or the error that stopped it.
        built: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._engine_thread, args=(settings, built),
                                        name=f"{self.name}-engine", daemon=True)
        self._thread.start()
        error = built.get()
        if error is not None:
            raise error
        log.info("%s: %s, %s; linear kernel %s, %s weights, row invariance %s, attention blocks stacked up "
                 "to %d a matmul", self.name, self.engine.row_shape.describe(), self.engine.dtype,
                 self.engine.linear_kernel, self.engine.weight_quantization, self.engine.invariance,
                 self.engine.attention_stack)
        self._report()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                engine_request = _read_request(request)
                streaming = bool(_scalar(request, "streaming", False))
            except EngineRequestError as error:
                _send_error(sender, f"{self.name}: {error}")
                continue
            if self.faults and self.faults.rule_for(engine_request.sampling.seed, int(engine_request.input_ids.size)):
                # a late or failing call must not hold up the others: its fault runs on a thread of its own
                threading.Thread(target=self._faulty, args=(sender, engine_request, streaming), daemon=True).start()
                continue
            self._queue(sender, engine_request, streaming)
        return None

    def _faulty(self, sender, engine_request, streaming) -> None:
        try:
            self.faults.apply(engine_request.sampling.seed, int(engine_request.input_ids.size))
        except Exception as error:
            _send_error(sender, f"{self.name}: internal error: {error}")
            return
        self._queue(sender, engine_request, streaming)

    def _queue(self, sender, engine_request, streaming) -> None:
        with self._wake:
            self._incoming.append((sender, engine_request, streaming))
            self._arrivals += 1
            self._wake.notify()

    def _engine_thread(self, settings: dict, built: queue.SimpleQueue) -> None:
        """Build the engine, then run it, on this one thread.

        OpenMP keeps a team of worker threads per thread that runs parallel
        work. Loading, packing and timing the model on the stub's main thread
        would leave a second, idle team in the process; libgomp then counts
        more threads than cores and cuts every wait's spinning short, so the
        forwards' threads sleep and wake at each parallel region whatever
        GOMP_SPINCOUNT says (measured in docs/measurements.md)."""
        try:
            # Loading and the start-up measurements (linear kernel, row shape, dense weights)
            # hold the cores like a forward: the draft and the target load at once, and a
            # kernel timed while the other engine quantizes or times its own measured the
            # contention (two servers on one 2-vCPU machine chose different target kernels,
            # and the one measured against the draft's load decoded 24 % slower).
            with self._turns:
                self.engine = CausalLMEngine(**settings)
        except BaseException as error:  # initialize raises it
            built.put(error)
            return
        built.put(None)
        self._run_engine()

    def _run_engine(self) -> None:
        """The engine thread: admit queued calls, run one forward, answer finished calls."""
        self.engine.bind_thread()
        returning = 0  # calls answered by the last forward: their requests' next calls are on the way
        answered = 0  # calls queued when they were answered
        forward_seconds = 0.0
        while True:
            with self._wake:
                while not self._incoming and not self.engine.pending() and not self._stopping:
                    self._wake.wait()
                # Let the streams just answered come back before the next forward:
                # a call that misses a forward waits a whole forward for the next.
                # Only calls queued after the answers count: new requests that came
                # during the forward are no one's next call (counted, a burst's first
                # request lost a whole prefill forward after its one-token first call).
                deadline = time.monotonic() + join_wait(forward_seconds)
                while self._arrivals - answered < returning and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if self._stopping:
                    return
            with self._turns:  # calls that come while the other engine has the cores join this forward
                with self._wake:
                    incoming, self._incoming = self._incoming, []
                for sender, engine_request, streaming in incoming:
                    try:
                        call = self.engine.submit(engine_request, on_tokens=self._stream if streaming else None)
                    except EngineRequestError as error:
                        _send_error(sender, f"{self.name}: {error}")
                        continue
                    self._senders[id(call)] = (sender, streaming)
                started, forwards = time.monotonic(), self.engine.forwards
                try:
                    done = self.engine.step()
                except Exception as error:  # outside a forward: fail what is in flight, keep the thread alive
                    log.exception("%s: engine step failed", self.name)
                    done = self.engine.fail_all(error)
                forward_seconds = time.monotonic() - started
            with self._wake:
                answered = self._arrivals
            for call in done:
                self._answer(call)
            returning = len(done)
            self._report(self.engine.forwards - forwards, forward_seconds)

    def _stream(self, call, tokens) -> None:
        """A streaming call's new tokens; the last step's go out with the final flag (``_answer``),
        as TensorRT-LLM's last streamed response carries it: no response is a flag alone."""
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
            log.error("%s: call failed: %s", self.name, error)
            _send_error(sender, f"{self.name}: internal error: {error}")
            return
        tokens, logits, log_probs = result.tokens, result.logits, result.log_probs
        if streaming and call.plain is not None:  # the earlier tokens went out as they came
            tokens, logits = tokens[streamed:], None
            log_probs = None if log_probs is None else log_probs[streamed:]
        _send(sender, tokens, logits, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, log_probs=log_probs)

    def _report(self, forwards: int = 0, seconds: float = 0.0) -> None:
        """Update the metrics after a step that ran ``forwards`` forwards in ``seconds``."""
        if self._gauges is not None:
            gauges = self._gauges[0]
            if forwards:
                gauges["forwards"].increment(forwards)
                gauges["forward_seconds"].increment(seconds)
            gauges["cached_sequences"].set(len(self.engine.pool))
            gauges["cached_tokens"].set(self.engine.pool.cached_tokens)
            sequences, rows = self.engine.last_forward
            gauges["batch_sequences"].set(sequences)
            gauges["batch_rows"].set(rows)
            gauges["running_calls"].set(self.engine.pending())

    def finalize(self):
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self.engine.pool.clear()
        if not self._thread.is_alive():
            self._turns.close()


def join_wait(forward_seconds: float) -> float:
    """How long the engine holds a forward for the calls it just answered to
    come back: a twentieth of a forward (a BLS round trip is a few ms), at
    most 20 ms. Joining costs the waiting calls at most that; missing costs a
    whole forward."""
    return min(0.05 * forward_seconds, 0.02)


def _send(sender, tokens, logits, flags, log_probs=None) -> None:
    n = len(tokens)
    outputs = [
        pb_utils.Tensor("output_ids", np.asarray(tokens, dtype=np.int32).reshape(1, 1, n)),
        pb_utils.Tensor("sequence_length", np.asarray([[n]], dtype=np.int32)),
    ]
    if log_probs is not None:  # as TensorRT-LLM's: [batch, beam, n] and their sum [batch, beam]
        values = np.asarray(log_probs, dtype=np.float32)[:n]
        outputs.append(pb_utils.Tensor("output_log_probs", values.reshape(1, 1, -1)))
        outputs.append(pb_utils.Tensor("cum_log_probs", np.asarray([[values.sum()]], dtype=np.float32)))
    if logits is not None:
        outputs.append(pb_utils.Tensor("generation_logits", logits.astype(np.float32).reshape(1, 1, n, -1)))
    sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)


def _send_error(sender, message: str) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


ENGINE_GAUGES = {
    "cached_sequences": ("specdec_engine_cached_sequences",
                         "Sequences whose KV cache the CPU engine keeps for prefix reuse (bounded by max_cached_sequences)"),
    "cached_tokens": ("specdec_engine_cached_tokens", "Tokens held in the CPU engine's KV-cache pool"),
    "batch_sequences": ("specdec_engine_batch_sequences", "Sequences carried by the CPU engine's latest forward"),
    "batch_rows": ("specdec_engine_batch_rows", "Rows of work (tokens) in the CPU engine's latest forward"),
    "running_calls": ("specdec_engine_running_calls", "Calls in flight in the CPU engine (prefilling or decoding)"),
}
# Counters: what the forwards themselves took, so a client can tell the serving
# stack's share of a request's time from the model's (specdec-compare does).
ENGINE_COUNTERS = {
    "forwards": ("specdec_engine_forwards_total", "Forward passes the CPU engine ran"),
    "forward_seconds": ("specdec_engine_forward_seconds_total",
                        "Seconds the CPU engine spent in steps that ran a forward (the forward, then sampling or "
                        "verifying its rows)"),
}


def _engine_gauges(model_name: str):
    """The engine's metrics on Triton's metrics port, labelled by model: the
    KV-cache pool, the in-flight batch and the time in forwards. None when
    metrics are off."""
    try:
        families = {key: pb_utils.MetricFamily(name=name, description=text, kind=kind)
                    for table, kind in ((ENGINE_GAUGES, pb_utils.MetricFamily.GAUGE),
                                        (ENGINE_COUNTERS, pb_utils.MetricFamily.COUNTER))
                    for key, (name, text) in table.items()}
    except Exception as error:  # metrics disabled or unsupported: serve without them
        log.warning("%s: no engine metrics: %s", model_name, error)
        return None
    labels = {"model": model_name}
    # keep the families alive as long as the metrics
    return {key: family.Metric(labels=labels) for key, family in families.items()}, families


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name, default):
    value = _optional(request, name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0].item()


def _read_request(request) -> EngineRequest:
    return read_request(lambda name: _optional(request, name))

