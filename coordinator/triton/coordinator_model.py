"""Triton Python-backend adapter of the coordinator (a thin shim).

``execute`` is a coroutine and every engine call is an awaited BLS request,
so one instance serves many streams at once; each request's loop lives in
``coordinator.decoding.generation``.

Engine calls run ``InferenceRequest.exec`` on a thread pool of their own, and
a decoupled call's responses are read there too: a stream's one by one, a
draft's or a verification's (whose reader needs them all) in the same job as
the call, because:

* ``async_exec(decoupled=True)`` of the Python backend up to Triton 2.51
  (python_backend r24.10) captures a local ``shared_ptr`` by reference in
  the callback it runs on a worker thread; the stub reads it after it is
  gone and, now and then, crashes (fixed upstream in python_backend PR 439).
* reading a decoupled call's ``ResponseIterator`` blocks until the next
  response arrives; read on the event loop it would hold every other
  stream's round until this one's engine answers.
* the event loop's default executor (min(32, CPUs + 4) threads) would cap
  the engine calls in flight at 6 on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import copy
import faulthandler
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import numpy as np
import triton_python_backend_utils as pb_utils

from coordinator.decoding.generation import Chunk, RequestCancelled, generate_text
from coordinator.engines.contract import EngineError, EngineOutput, for_prompt
from coordinator.engines.tensors import (
    REQUESTED_OUTPUTS,
    engine_inputs,
    generated_tokens,
    generation_logits,
    output_log_probs,
)
from coordinator.policy.costmodel import CostModel
from coordinator.policy.governor import LoadGovernor
from coordinator.policy.startup_profile import PROMPT as PROFILE_PROMPT, profile_engines
from coordinator.request.admission import Admission, refusal_message
from coordinator.request.api import INPUT_NAMES
from coordinator.request.parse import InputError, check_parameters, parse_request
from coordinator.request.tokenizer import Codec, SpecialTokens
from coordinator.response.metrics import COUNTER, GAUGE, MetricSpec, MetricsRecorder
from coordinator.sampling.params import SamplingParams
from coordinator.settings import CoordinatorSettings
from coordinator.triton import tracing
from coordinator.triton.held_streams import HeldStreams
from coordinator.triton.logs import log_to_stderr

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DRAIN_SECONDS = 10.0  # longest wait for the rest of an engine stream its reader left early
# While an engine's answer is late, how often to ask Triton whether the model
# still serves. An engine whose process died never answers the calls it had
# (Triton 2.51 neither fails nor finishes them); once the engine watchdog
# (selfheal/) unloads the dead model to reload it, this check ends such a call
# with an error instead of a hang.
ENGINE_CHECK_SECONDS = 1.0
# Each engine call in flight holds one thread while it waits for its next
# response (a request holds up to three: target, draft, draft warm-up);
# threads are started only when needed.
ENGINE_CALL_THREADS = 256
_engine_calls = ThreadPoolExecutor(max_workers=ENGINE_CALL_THREADS, thread_name_prefix="engine-call")
# Finished decoupled BLS streams, until the stub has let go of them (held_streams.py)
_held_streams = HeldStreams()


class BlsEngine:
    """The loop's Engine protocol over a BLS call to a tensorrtllm-contract model."""

    def __init__(self, model_name: str, special: SpecialTokens, seed_input: str = "random_seed",
                 decoupled: bool = False, sends_prompt_length: bool = False):
        self.model_name = model_name
        self.special = special
        self.seed_input = seed_input
        self.decoupled = decoupled
        self.sends_prompt_length = sends_prompt_length
        self.prompt_length: int | None = None

    def for_prompt(self, prompt_length: int) -> "BlsEngine":
        """This engine for one request's calls: each sends the prompt's length
        where the engine takes it (the coordinator's engine_prompt_length)."""
        if not self.sends_prompt_length:
            return self
        marked = copy.copy(self)
        marked.prompt_length = prompt_length
        return marked

    async def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        draft_tokens=(),
        draft_logits=None,
        return_logits: bool = False,
    ) -> EngineOutput:
        with tracing.tracer.start_as_current_span(f"{self.model_name} call", attributes={
                "specdec.input_tokens": len(input_ids), "specdec.max_new_tokens": max_new_tokens,
                "specdec.draft_tokens": len(draft_tokens)}) as span:
            output = await self._generate(input_ids, max_new_tokens, sampling, draft_tokens, draft_logits,
                                          return_logits)
            span.set_attribute("specdec.returned_tokens", len(output.tokens))
            return output

    async def _generate(self, input_ids, max_new_tokens, sampling, draft_tokens, draft_logits,
                        return_logits) -> EngineOutput:
        tensors = self._inputs(input_ids, max_new_tokens, sampling, draft_tokens=draft_tokens,
                               draft_logits=draft_logits, return_logits=return_logits)
        tokens, logits, log_probs = [], [], []
        outputs = self._outputs(return_logits, sampling.log_probs)
        for response in await bls_all_responses(self.model_name, tensors, outputs, self.decoupled):
            new = _tokens(response)
            if new is None:  # a decoupled model's final flag alone
                continue
            tokens += new
            if sampling.log_probs:
                log_probs += _log_probs(response, len(new), self.model_name)
            if return_logits:
                tensor = pb_utils.get_output_tensor_by_name(response, "generation_logits")
                if tensor is None:
                    raise EngineError(f"{self.model_name}: generation_logits were requested but not returned")
                logits.append(generation_logits(tensor.as_numpy(), len(new)))
        reported = log_probs if sampling.log_probs else None
        if not return_logits:
            return EngineOutput(tokens, None, reported)
        return EngineOutput(tokens, np.concatenate(logits) if logits else np.zeros((0, 0), dtype=np.float32),
                            reported)

    async def stream(self, input_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams):
        """Plain decoding; the tokens as the engine generates them (one call)."""
        tensors = self._inputs(input_ids, max_new_tokens, sampling, streaming=self.decoupled)
        # not the current span: a generator's context is not its consumer's across yields
        span = tracing.tracer.start_span(f"{self.model_name} stream", attributes={
            "specdec.input_tokens": len(input_ids), "specdec.max_new_tokens": max_new_tokens})
        returned = 0
        try:
            outputs = self._outputs(False, sampling.log_probs)
            async with aclosing(bls_responses(self.model_name, tensors, outputs, self.decoupled)) as responses:
                async for response in responses:
                    new = _tokens(response)
                    if new:
                        returned += len(new)
                        log_probs = _log_probs(response, len(new), self.model_name) if sampling.log_probs else None
                        yield EngineOutput(new, None, log_probs)
        finally:
            span.set_attribute("specdec.returned_tokens", returned)
            span.end()

    def _inputs(self, input_ids, max_new_tokens, sampling, **options) -> dict:
        # The model's end ids: the first as end_id, the others as stop words, so
        # the engine stops at each; a request's own end_id stands alone.
        end_id = self.special.end_id if sampling.end_id is None else sampling.end_id
        stop_ids = self.special.eos_token_ids[1:] if sampling.end_id is None else ()
        return engine_inputs(input_ids, max_new_tokens, sampling, end_id=end_id, stop_ids=stop_ids,
                             pad_id=self.special.pad_token_id, seed_input=self.seed_input,
                             prompt_length=self.prompt_length, **options)

    @staticmethod
    def _outputs(return_logits: bool, return_log_probs: bool) -> list[str]:
        return (list(REQUESTED_OUTPUTS) + (["generation_logits"] if return_logits else [])
                + (["output_log_probs"] if return_log_probs else []))


def _request(model_name: str, tensors: dict, outputs: Sequence[str]):
    return pb_utils.InferenceRequest(
        model_name=model_name,
        inputs=[pb_utils.Tensor(name, array) for name, array in tensors.items()],
        requested_output_names=list(outputs),
    )


def _checked(model_name: str, response):
    if response.has_error():
        raise EngineError(f"{model_name}: {response.error().message()}")
    return response


async def bls_all_responses(model_name: str, tensors: dict, outputs: Sequence[str], decoupled: bool) -> list:
    """Every response of a BLS call whose reader needs them all before it acts
    (a draft's proposal, a verification): the call and all its responses are
    read in one job on the engine-call pool. Read one by one, as a stream is,
    they cost a thread hop each plus one for the call, and the hop's wake-up
    was the largest share of the coordinator's time per round at GPU step
    times (docs/gpu.md). Raises EngineError on an error response."""
    request = _request(model_name, tensors, outputs)
    if decoupled:
        responses = await _engine_answer(model_name, _read_to_end, request)
    else:
        responses = [await _engine_answer(model_name, request.exec)]
    return [_checked(model_name, response) for response in responses]


def _read_to_end(request) -> list:
    """A decoupled call's responses, all of them; its stream is held (held_streams.py)."""
    stream = request.exec(decoupled=True)
    responses = list(stream)
    _held_streams.hold(stream)
    return responses


async def bls_responses(model_name: str, tensors: dict, outputs: Sequence[str], decoupled: bool):
    """The responses of a BLS call to ``model_name`` as they come, for a reader
    that acts on each (plain decoding's stream; raises EngineError on an error
    response)."""
    request = _request(model_name, tensors, outputs)
    if decoupled:
        stream = await _engine_answer(model_name, lambda: request.exec(decoupled=True))

        async def next_response():  # blocks until the model answers: read off the event loop
            return await _engine_answer(model_name, next, stream, None)
    else:
        single = iter([await _engine_answer(model_name, request.exec)])

        async def next_response():  # already here: no thread hop
            return next(single, None)
    ended = False
    try:
        while (response := await next_response()) is not None:
            yield _checked(model_name, response)
        ended = True
    finally:
        # A reader that stops early (a cancelled request, a stop word) still
        # takes the rest of the stream, so the model's request is released;
        # bounded, because a stream whose request Triton cancelled may never end.
        if not ended:
            try:
                await asyncio.wait_for(_drain(next_response), DRAIN_SECONDS)
            except (asyncio.TimeoutError, Exception) as error:  # noqa: BLE001 - nothing is waiting for it
                log.info("%s: left a response stream unread: %r", model_name, error)
        if decoupled:
            _held_streams.hold(stream)


async def _engine_answer(model_name: str, call, *args):
    """``call(*args)`` on the engine-call pool; while it has not returned,
    every ENGINE_CHECK_SECONDS an EngineError if ``model_name`` no longer
    serves (the blocked thread is left behind: nothing can unblock it)."""
    loop = asyncio.get_running_loop()
    pending = loop.run_in_executor(_engine_calls, call, *args)
    while True:
        done, _ = await asyncio.wait({pending}, timeout=ENGINE_CHECK_SECONDS)
        if done:
            return pending.result()
        if not await loop.run_in_executor(_engine_calls, _model_ready, model_name):
            pending.add_done_callback(_ignore_outcome)
            raise EngineError(f"{model_name}: the model stopped serving while this request waited for it "
                              "(its process died; it is being reloaded)")


def _model_ready(model_name: str) -> bool:
    """Triton's view of the model; True when it cannot be asked (never fail a call on the check alone)."""
    try:
        return bool(pb_utils.is_model_ready(model_name))
    except Exception as error:  # noqa: BLE001 - the check is advisory
        log.info("could not ask whether %s is ready: %s", model_name, error)
        return True


def _ignore_outcome(future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so asyncio does not log it as never retrieved


def _tokens(response) -> list[int] | None:
    """The new tokens a response carries (None: a response without outputs)."""
    output_ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
    if output_ids is None:
        return None
    lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
    return generated_tokens(output_ids.as_numpy(), lengths)


def _log_probs(response, tokens: int, model_name: str) -> list[float]:
    tensor = pb_utils.get_output_tensor_by_name(response, "output_log_probs")
    if tensor is None:
        raise EngineError(f"{model_name}: output_log_probs were requested but not returned")
    return output_log_probs(tensor.as_numpy(), tokens)


async def _drain(next_response) -> None:
    while await next_response() is not None:
        pass


def _triton_instrument(families: dict[str, object], spec: MetricSpec):
    """A ``pb_utils.Metric`` for a spec; specs sharing a name share one family."""
    family = families.get(spec.name)
    if family is None:
        kind = {COUNTER: pb_utils.MetricFamily.COUNTER, GAUGE: pb_utils.MetricFamily.GAUGE}.get(
            spec.kind, pb_utils.MetricFamily.HISTOGRAM
        )
        family = families[spec.name] = pb_utils.MetricFamily(name=spec.name, description=spec.description, kind=kind)
    labels = dict(spec.labels)
    if spec.buckets is not None:
        return _BatchedHistogram(family.Metric(labels=labels, buckets=list(spec.buckets)))
    if spec.kind == GAUGE:
        return _BatchedGauge(family.Metric(labels=labels))
    if spec.kind == COUNTER:
        return _BatchedCounter(family.Metric(labels=labels))
    return family.Metric(labels=labels)


# Each pb_utils.Metric call is a synchronous round trip to tritonserver (a
# message and a wait for its answer), ~20 of them a speculative round plus one
# per emitted token (the inter-token latency): at GPU step times most of the
# coordinator's time per round (tools/sim_bench.py). So no round makes one:
# counters add up, gauges keep their last value and histograms their
# observations until flush_metrics hands them to the metric-sender thread,
# which makes the calls off the event loop. A flush runs at most
# METRIC_FLUSH_SECONDS after an update, and before every final response, where
# it waits until Triton has them all: the metrics port never lags the responses.
METRIC_FLUSH_SECONDS = 0.25
METRIC_WAIT_SECONDS = 5.0  # longest a final response waits for its metrics (a stuck tritonserver)
_unflushed: set = set()
_last_flush = [0.0]


class _MetricSender:
    """One thread that makes the pb_utils.Metric calls of each flush, in order."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest = threading.Event()  # set once the latest batch (and so every one before) is sent
        self._latest.set()

    def send(self, calls: list) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metric-sender", daemon=True)
                self._thread.start()
        self._latest = done = threading.Event()
        self._queue.put((calls, done))

    def wait(self, timeout: float) -> bool:
        """Until every batch handed over so far is sent (at once when none is pending)."""
        return self._latest.wait(timeout)

    def _run(self) -> None:
        while True:
            calls, done = self._queue.get()
            for call, value in calls:
                try:
                    call(value)
                except Exception as error:  # noqa: BLE001 - a metric never fails serving
                    log.warning("a metric update failed: %s", error)
            done.set()


_sender = _MetricSender()


def _updated(instrument) -> None:
    _unflushed.add(instrument)
    if time.monotonic() - _last_flush[0] >= METRIC_FLUSH_SECONDS:
        flush_metrics(wait=False)


def flush_metrics(wait: bool = True) -> None:
    """Hand every batched update to the metric sender; ``wait``: until Triton has them."""
    _last_flush[0] = time.monotonic()
    calls = []
    while _unflushed:
        calls += _unflushed.pop().take()
    if calls:
        _sender.send(calls)
    if wait and not _sender.wait(METRIC_WAIT_SECONDS):
        log.warning("metric updates not acknowledged by Triton within %g s", METRIC_WAIT_SECONDS)


class _BatchedCounter:
    __slots__ = ("metric", "pending")

    def __init__(self, metric):
        self.metric = metric
        self.pending = 0

    def increment(self, value: float) -> None:
        self.pending += value
        _updated(self)

    def take(self) -> list:
        pending, self.pending = self.pending, 0
        return [(self.metric.increment, pending)] if pending else []


class _BatchedGauge:
    __slots__ = ("metric", "value", "sent")

    def __init__(self, metric):
        self.metric = metric
        self.value = self.sent = None

    def set(self, value: float) -> None:
        self.value = value
        _updated(self)

    def take(self) -> list:
        if self.value == self.sent:  # most per-round gauges hold their value from round to round
            return []
        self.sent = self.value
        return [(self.metric.set, self.value)]


class _BatchedHistogram:
    __slots__ = ("metric", "pending")

    def __init__(self, metric):
        self.metric = metric
        self.pending: list[float] = []

    def observe(self, value: float) -> None:
        self.pending.append(value)
        _updated(self)

    def take(self) -> list:
        pending, self.pending = self.pending, []
        return [(self.metric.observe, value) for value in pending]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        log_to_stderr("coordinator")
        # a crash of this process leaves every thread's Python stack in the server's log
        faulthandler.enable(all_threads=True)
        self.settings = CoordinatorSettings.from_parameters(parameters)
        self.codec = Codec.from_dir(self.settings.tokenizer_dir)
        seed_input = self.settings.engine_seed_input
        decoupled = self.settings.engine_decoupled
        self.target = BlsEngine(self.settings.target_model_name, self.codec.special, seed_input, decoupled,
                                sends_prompt_length=self.settings.engine_prompt_length)
        self.draft = BlsEngine(self.settings.draft_model_name, self.codec.special, seed_input, decoupled)
        # server-wide engine timings and acceptance, and this process's CPU per round
        self.costs = CostModel(cpu_clock=time.process_time)
        window, prior = max(1, self.settings.speculation_window), self.settings.policy.prior_acceptance
        # server-wide: does speculation pay at this load (priced by the forecast until measured)
        self.governor = LoadGovernor(forecast=lambda streams: self.costs.forecast(streams, prior, window))
        self._profiling, self._profiled = asyncio.Lock(), False  # the engines' start-up profile (_time_engines)
        families: dict[str, object] = {}
        self.metrics = MetricsRecorder(lambda spec: _triton_instrument(families, spec), costs=self.costs,
                                       governor=self.governor)
        self._metric_families = families  # keep the families alive as long as the model
        self.admission = Admission(self.settings.max_inflight_requests)
        self.metrics.admission(0, self.admission.limit)
        flush_metrics()
        traced_to = tracing.configure(self.settings.trace_file)
        log.info("coordinator ready: %s; tracing %s", self.settings,
                 f"to {', '.join(traced_to)}" if traced_to else "off")

    async def _time_engines(self) -> None:
        """The engines' start-up profile into the cost model (startup_profile.py),
        once, before the first request is served (BLS cannot run while Triton
        loads the models; specdec-serve sends that request before it reports
        ready). Engines not ready then, or a failed call: served unpriced, as logged."""
        async with self._profiling:
            if self._profiled:
                return
            self._profiled = True
            if not self.settings.engine_profile:
                return
            loop = asyncio.get_running_loop()
            names = (self.settings.target_model_name, self.settings.draft_model_name)
            if not all([await loop.run_in_executor(_engine_calls, _model_ready, name) for name in names]):
                log.warning("engine profile skipped: %s not both ready; the first bursts are priced once "
                            "requests have timed the engines", " and ".join(names))
                return
            prompt = self.codec.encode(PROFILE_PROMPT)
            window = max(1, self.settings.speculation_window)
            try:
                profile = await profile_engines(for_prompt(self.target, len(prompt)), self.draft, prompt, window)
            except Exception as error:  # noqa: BLE001 - serving goes on without it
                log.warning("engine profile failed (%s); the first bursts are priced once requests have timed "
                            "the engines", error)
                return
            self.costs.observe_profile(profile.samples)
            log.info("engine profile: %s", profile.describe(window))

    async def execute(self, requests):
        if not self._profiled:
            await self._time_engines()
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request) -> None:
        sender = request.get_response_sender()
        slot = self.admission.admit()
        if slot is None:  # at max_inflight_requests: refused at once, before any work
            self.metrics.refused()
            flush_metrics()
            error = pb_utils.TritonError(refusal_message(self.admission.limit), pb_utils.TritonError.UNAVAILABLE)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        self.metrics.admission(self.admission.in_flight, self.admission.limit)

        def release() -> None:
            """Before the final response goes out: a client that sends its next
            request once it has this one's end finds its slot free."""
            slot.release()
            self.metrics.admission(self.admission.in_flight, self.admission.limit)
            flush_metrics()

        try:
            with tracing.tracer.start_as_current_span("specdec request") as span:
                await self._generate(request, sender, release, span)
        finally:
            release()

    async def _generate(self, request, sender, release, span) -> None:
        metrics = self.metrics.start_request()
        outcome = "error"
        try:
            check_parameters(_parameters(request))
            raw = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                raw[name] = None if tensor is None else tensor.as_numpy()
            # Seeds drawn here stay below 2^63: seeds from 2^63 up are reserved for
            # the tests' fault injection (cpu_engine/faults.py).
            generation = parse_request(raw, self.settings, new_seed=lambda: secrets.randbits(63))
            if span.is_recording():  # tracing on (coordinator/triton/tracing.py)
                span.set_attributes({"specdec.arm": generation.arm, "specdec.max_tokens": generation.max_tokens,
                                     "specdec.speculation_window": generation.speculation_window,
                                     "specdec.stream": generation.stream})
            pieces: list[str] = []
            chunks = generate_text(
                generation,
                self.codec,
                draft=self.draft,
                target=self.target,
                settings=self.settings,
                costs=self.costs,
                governor=self.governor,
                metrics=metrics,
                cancelled=lambda: _cancelled(request, sender),  # asked after every round
                on_round=tracing.RoundSpans() if span.is_recording() else None,
            )
            async for chunk in chunks:
                if chunk.final and span.is_recording():
                    span.set_attributes({"specdec.completion_tokens": chunk.stats.completion_tokens,
                                         "specdec.fallback_reason": chunk.stats.fallback_reason})
                if chunk.final:
                    # Counted before the client can see the end of its request, so the
                    # metrics port never lags the responses (the stream's clean-up follows).
                    outcome = "success"
                    metrics.finish(outcome)
                    release()
                if generation.stream:
                    if chunk.text or chunk.final:
                        sender.send(_response(chunk.text, chunk if chunk.final else None),
                                    flags=FINAL if chunk.final else 0)
                else:
                    pieces.append(chunk.text)
                    if chunk.final:
                        sender.send(_response("".join(pieces), chunk), flags=FINAL)
            outcome = "success"
        except RequestCancelled:
            outcome = "cancelled"
            release()
            log.info("request cancelled by the client; stopped after the current round")
            try:
                sender.send(flags=FINAL)
            except Exception as error:  # the client is gone; nothing is waiting for it
                log.info("final flag of a cancelled request not sent: %s", error)
        except InputError as error:
            release()
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=FINAL)
        except EngineError as error:
            log.error("engine failure: %s", error)
            self.governor.disrupted()
            release()
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=FINAL)
        except Exception as error:  # never leave a stream open
            log.exception("coordinator failure")
            release()
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"coordinator internal error: {error}")),
                flags=FINAL,
            )
        finally:
            metrics.finish(outcome)
            span.set_attribute("specdec.outcome", outcome)


def _parameters(request) -> dict:
    """The request's parameters (a JSON object in pb_utils), {} when there are none."""
    getter = getattr(request, "parameters", None)
    text = getter() if getter else ""
    try:
        parameters = json.loads(text) if text else {}
    except ValueError:
        return {}
    return parameters if isinstance(parameters, dict) else {}


def _cancelled(request, sender) -> bool:
    check = getattr(sender, "is_cancelled", None) or getattr(request, "is_cancelled", None)
    return check is not None and asked_cancelled(check)


def asked_cancelled(is_cancelled) -> bool:
    """``is_cancelled()`` of a live request or response sender. The question goes
    through the stub's queue, so a False answer also lets go of the streams held
    before it was asked (held_streams.py)."""
    mark = _held_streams.mark()
    if is_cancelled():
        return True
    _held_streams.release_through(mark)
    return False


def _response(text: str, final: Chunk | None):
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
    if final is not None:
        tensors += [pb_utils.Tensor(name, array) for name, array in final.stats.outputs().items()]
        if final.log_probs is not None:
            values = np.asarray(final.log_probs, dtype=np.float32)
            tensors += [pb_utils.Tensor("output_log_probs", values),
                        pb_utils.Tensor("cum_log_probs", np.array([values.sum()], dtype=np.float32))]
    return pb_utils.InferenceResponse(output_tensors=tensors)
