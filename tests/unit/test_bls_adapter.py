"""The coordinator's Triton adapter against a stand-in for the Python backend's
``triton_python_backend_utils`` that behaves as Triton 2.51's does where it
matters here: ``exec(decoupled=True)`` returns a ``ResponseIterator`` whose
``next`` blocks until the engine's next response, and ``async_exec`` is
unsafe (python_backend r24.10, src/pb_stub.cc: its decoupled callback reads a
``shared_ptr`` captured by reference after it is gone; fixed upstream in
python_backend PR 439), so the adapter must not call it."""

from __future__ import annotations

import asyncio
import importlib
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest

from coordinator.sampling.params import SamplingParams
from coordinator.request.tokenizer import SpecialTokens

TIMEOUT = 10.0


class _Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def as_numpy(self):
        return self._array


class _Response:
    def __init__(self, tokens=None, error=None):
        self.tensors = {}
        if tokens is not None:
            self.tensors = {"output_ids": _Tensor("output_ids", np.array([[tokens]], dtype=np.int32)),
                            "sequence_length": _Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32))}
        self._error = error

    def has_error(self):
        return self._error is not None

    def error(self):
        return types.SimpleNamespace(message=lambda: self._error)


class _BlockingIterator:
    """A decoupled call's responses; ``next`` waits until the test releases them."""

    def __init__(self, responses, released: threading.Event):
        self._responses, self._released = list(responses), released
        self.reader_threads: set[str] = set()

    def __iter__(self):
        return self

    def __next__(self):
        self.reader_threads.add(threading.current_thread().name)
        if not self._released.wait(TIMEOUT):
            raise RuntimeError("never released")
        if not self._responses:
            raise StopIteration
        return self._responses.pop(0)


class FakeBackend(types.ModuleType):
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self):
        super().__init__("triton_python_backend_utils")
        self.engines: dict[str, tuple[list, threading.Event]] = {}
        self.iterators: list[_BlockingIterator] = []
        self.sent: list[tuple[str, dict]] = []  # (model, input tensors) of every request made
        self.make_iterator = _BlockingIterator
        backend = self

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names):
                self.model_name = model_name
                backend.sent.append((model_name, {tensor._name: tensor.as_numpy() for tensor in inputs}))

            def exec(self, decoupled=False):
                responses, released = backend.engines[self.model_name]
                if not decoupled:
                    released.wait(TIMEOUT)
                    return responses[0]
                iterator = backend.make_iterator(responses, released)
                backend.iterators.append(iterator)
                return iterator

            def async_exec(self, decoupled=False):
                raise AssertionError("async_exec is unsafe in Triton 2.51's Python backend")

        self.InferenceRequest = InferenceRequest
        self.Tensor = _Tensor
        self.not_ready: set[str] = set()  # models Triton no longer calls ready (unloaded)

    def is_model_ready(self, model_name, model_version=""):
        return model_name not in self.not_ready

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return response.tensors.get(name)


@pytest.fixture
def bls(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    monkeypatch.delitem(sys.modules, "coordinator.triton.coordinator_model", raising=False)
    module = importlib.import_module("coordinator.triton.coordinator_model")
    yield module, backend
    sys.modules.pop("coordinator.triton.coordinator_model", None)


SPECIAL = SpecialTokens(eos_token_ids=(0,), pad_token_id=0)


def test_a_call_waiting_for_its_engine_does_not_hold_other_calls(bls):
    """While one stream waits for its engine, another stream's call goes
    through: reading a response never blocks the event loop."""
    module, backend = bls
    slow_released, fast_released = threading.Event(), threading.Event()
    fast_released.set()
    backend.engines["slow"] = ([_Response([5, 6]), _Response([7])], slow_released)
    backend.engines["fast"] = ([_Response([1, 2, 3])], fast_released)
    slow = module.BlsEngine("slow", SPECIAL, decoupled=True)
    fast = module.BlsEngine("fast", SPECIAL, decoupled=True)

    async def both():
        waiting = asyncio.ensure_future(slow.generate([9, 9], 3, SamplingParams()))
        done = await fast.generate([9], 3, SamplingParams())  # while "slow" is still waiting
        assert not waiting.done()
        slow_released.set()
        return done, await waiting

    fast_out, slow_out = asyncio.run(asyncio.wait_for(both(), TIMEOUT))
    assert fast_out.tokens == [1, 2, 3]
    assert slow_out.tokens == [5, 6, 7]
    readers = set().union(*(it.reader_threads for it in backend.iterators))
    assert readers and all(name.startswith("engine-call") for name in readers)


def test_a_draft_or_verification_call_takes_one_thread_hop_however_many_responses(bls, monkeypatch):
    """generate reads the call and all its responses in one job on the
    engine-call pool; a stream still hops per response, as its reader acts on
    each (the hops' wake-ups dominated the coordinator's time per round)."""
    module, backend = bls
    released = threading.Event()
    released.set()
    hops = []
    answer = module._engine_answer

    async def counted(model_name, call, *args):
        hops.append(model_name)
        return await answer(model_name, call, *args)

    monkeypatch.setattr(module, "_engine_answer", counted)
    backend.engines["draft"] = ([_Response([1]), _Response([2]), _Response([3]), _Response()], released)
    engine = module.BlsEngine("draft", SPECIAL, decoupled=True)
    assert asyncio.run(engine.generate([9], 3, SamplingParams())).tokens == [1, 2, 3]
    assert hops == ["draft"]
    assert len(backend.iterators[0].reader_threads) == 1

    backend.engines["draft"] = ([_Response([1]), _Response([2]), _Response([3]), _Response()], released)
    hops.clear()

    async def read_stream():
        return [chunk.tokens async for chunk in engine.stream([9], 3, SamplingParams())]

    assert asyncio.run(read_stream()) == [[1], [2], [3]]
    assert len(hops) == 6  # the call, four responses, the end


def test_a_stream_read_in_part_is_drained_off_the_event_loop(bls):
    module, backend = bls
    released = threading.Event()
    released.set()
    backend.engines["draft"] = ([_Response([1]), _Response([2]), _Response([3])], released)
    engine = module.BlsEngine("draft", SPECIAL, decoupled=True)

    async def first_only():
        async for chunk in engine.stream([9], 3, SamplingParams()):
            return chunk.tokens

    assert asyncio.run(first_only()) == [1]
    assert backend.iterators[0]._responses == []  # the rest was read, so the engine releases the request


def test_an_engine_error_is_raised_with_the_models_name(bls):
    module, backend = bls
    released = threading.Event()
    released.set()
    backend.engines["target"] = ([_Response(error="out of memory")], released)
    for decoupled in (True, False):
        engine = module.BlsEngine("target", SPECIAL, decoupled=decoupled)
        with pytest.raises(module.EngineError, match="target: out of memory"):
            asyncio.run(engine.generate([9], 1, SamplingParams()))


def test_a_model_that_is_not_decoupled_answers_once(bls):
    module, backend = bls
    released = threading.Event()
    released.set()
    backend.engines["target"] = ([_Response([4, 2])], released)
    engine = module.BlsEngine("target", SPECIAL, decoupled=False)
    assert asyncio.run(engine.generate([9], 2, SamplingParams())).tokens == [4, 2]


def test_a_call_to_an_engine_that_died_ends_once_its_model_is_unloaded(bls, monkeypatch):
    """An engine killed mid-call never answers (Triton 2.51); the call waits
    while the model is still called ready, and fails once the watchdog has
    unloaded it, instead of hanging its request."""
    module, backend = bls
    monkeypatch.setattr(module, "ENGINE_CHECK_SECONDS", 0.05)
    never = threading.Event()
    backend.engines["target"] = ([_Response([1])], never)
    engine = module.BlsEngine("target", SPECIAL, decoupled=True)

    async def call():
        waiting = asyncio.ensure_future(engine.generate([9], 2, SamplingParams()))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # still ready: a slow engine is waited for
        backend.not_ready.add("target")
        return await waiting

    with pytest.raises(module.EngineError, match="target: the model stopped serving"):
        asyncio.run(asyncio.wait_for(call(), TIMEOUT))
    never.set()  # let the blocked reader thread finish


def test_a_failing_readiness_check_never_fails_a_call(bls, monkeypatch):
    module, backend = bls
    monkeypatch.setattr(module, "ENGINE_CHECK_SECONDS", 0.02)

    def broken(model_name, model_version=""):
        raise RuntimeError("IPC failed")

    monkeypatch.setattr(backend, "is_model_ready", broken)
    released = threading.Event()
    backend.engines["draft"] = ([_Response([3])], released)
    threading.Timer(0.2, released.set).start()
    engine = module.BlsEngine("draft", SPECIAL, decoupled=True)
    assert asyncio.run(asyncio.wait_for(engine.generate([9], 1, SamplingParams()), TIMEOUT)).tokens == [3]


class _RecordingMetric:
    """A pb_utils.Metric that records each call and the thread that made it."""

    def __init__(self, calls: list):
        self.calls = calls

    def increment(self, value):
        self.calls.append(("increment", value, threading.current_thread().name))

    def set(self, value):
        self.calls.append(("set", value, threading.current_thread().name))

    def observe(self, value):
        self.calls.append(("observe", value, threading.current_thread().name))


def test_metric_updates_are_batched_and_sent_off_the_event_loop_before_the_final_response(bls, monkeypatch):
    """No round makes a round trip to Triton: counters add up, gauges keep their
    last value, histograms keep every observation, and a flush sends them from
    the metric-sender thread; a final response's flush returns only once Triton
    has them all (the metrics port never lags the responses)."""
    module, _ = bls
    monkeypatch.setattr(module, "METRIC_FLUSH_SECONDS", 3600.0)
    module._last_flush[0] = time.monotonic()
    calls: list = []
    counter = module._BatchedCounter(_RecordingMetric(calls))
    gauge = module._BatchedGauge(_RecordingMetric(calls))
    histogram = module._BatchedHistogram(_RecordingMetric(calls))
    for value in (0.5, 0.25, 0.25):
        counter.increment(2)
        gauge.set(value)
        histogram.observe(value)
    assert calls == []  # nothing sent while the rounds run
    module.flush_metrics()  # as before a final response: returns once all are sent
    assert sorted(c[:2] for c in calls) == sorted([("increment", 6), ("set", 0.25), ("observe", 0.5),
                                                  ("observe", 0.25), ("observe", 0.25)])
    assert {c[2] for c in calls} == {"metric-sender"}
    gauge.set(0.25)  # unchanged since it was sent: nothing to send
    module.flush_metrics()
    assert len(calls) == 5
    assert module._sender.wait(0)  # nothing pending: a final response need not wait for the sender


class _StubMap:
    """The stub's own owner of every decoupled call's iterator (python_backend r24.10,
    src/pb_stub.cc ``response_iterator_map_``): reading the final response queues the
    entry's erase (pb_response_iterator.cc ``Clear``), which the stub's utils thread does
    in order with the other questions it serves, such as ``is_cancelled``. Whatever that
    erase frees is freed without the interpreter lock."""

    def __init__(self):
        self.owned: dict[int, object] = {}
        self.queued: list[int] = []
        self.erased = 0
        self.freed_by_erase = 0
        self.alive: list[weakref.ref] = []

    def is_cancelled(self) -> bool:
        while self.queued:
            ref = weakref.ref(self.owned.pop(self.queued.pop(0)))
            self.erased += 1
            if ref() is None:
                self.freed_by_erase += 1
            else:
                self.alive.append(ref)
        return False


class _StubOwnedIterator(_BlockingIterator):
    def __init__(self, responses, released, stub: _StubMap):
        super().__init__(responses, released)
        self._stub = stub
        stub.owned[id(self)] = self

    def __next__(self):
        try:
            return super().__next__()
        except StopIteration:
            self._stub.queued.append(id(self))
            raise


def test_a_finished_stream_is_freed_under_the_interpreter_lock_not_by_the_stubs_erase(bls):
    """Triton 2.51's stub frees a tensor's numpy arrays wherever its last owner lets go,
    with or without the interpreter lock (python_backend PR 390 made it take the lock,
    from r25.01): the adapter holds each finished stream until an is_cancelled answer
    shows the erase queued before it was done, then lets go itself."""
    module, backend = bls
    stub = _StubMap()
    backend.make_iterator = lambda responses, released: _StubOwnedIterator(responses, released, stub)
    released = threading.Event()
    released.set()
    backend.engines["target"] = ([_Response([1, 2])], released)
    engine = module.BlsEngine("target", SPECIAL, decoupled=True)

    async def calls():
        verified = await engine.generate([9], 2, SamplingParams())  # every response, read in one job
        streamed = [out.tokens async for out in engine.stream([9], 2, SamplingParams())]  # one by one
        return verified.tokens, streamed

    assert asyncio.run(asyncio.wait_for(calls(), TIMEOUT)) == ([1, 2], [[1, 2]])
    backend.iterators.clear()  # the stand-in's own list of what it handed out
    assert stub.queued and not module.asked_cancelled(stub.is_cancelled)
    assert stub.erased == 2 and stub.freed_by_erase == 0  # the erase never dropped the last reference
    assert all(ref() is None for ref in stub.alive)  # the adapter let go once the answer came


def test_streams_held_after_a_question_was_asked_wait_for_the_next_answer():
    from coordinator.triton.held_streams import HeldStreams

    held = HeldStreams()
    first, second = object(), object()
    held.hold(first)
    mark = held.mark()
    held.hold(second)  # its erase may be queued after the question: not covered by this answer
    assert held.release_through(mark) == 1 and len(held) == 1
    assert held.release_through(held.mark()) == 1 and len(held) == 0


def test_a_requests_calls_carry_its_prompt_length_only_where_the_engine_takes_it(bls):
    """The CPU engine's prompt_length input (coordinator/engines/contract.py):
    sent with every call of one request's view of the target, never by an
    engine configured without it (TensorRT-LLM has no such input)."""
    module, backend = bls
    released = threading.Event()
    released.set()
    backend.engines["target"] = ([_Response([4])], released)
    taking = module.BlsEngine("target", SPECIAL, decoupled=False, sends_prompt_length=True)
    plain = module.BlsEngine("target", SPECIAL, decoupled=False)
    assert plain.for_prompt(3) is plain
    request = taking.for_prompt(3)
    asyncio.run(request.generate([9, 8, 7, 4], 1, SamplingParams()))
    asyncio.run(plain.generate([9, 8, 7, 4], 1, SamplingParams()))
    asyncio.run(taking.generate([9], 1, SamplingParams()))  # the shared engine itself: no request's prompt
    assert [inputs.get("prompt_length", np.array(None)).tolist() for _, inputs in backend.sent] == [[[3]], None, None]
