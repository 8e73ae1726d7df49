"""The CPU engine's Triton adapter builds its engine on the thread that runs the
forwards: libgomp cuts spinning short in a process with more OpenMP threads
than cores, and a team left behind by loading on the stub's main thread would
count (cpu_engine/triton_model.py, _engine_thread); and it runs each forward on
its turn of the cores (cpu_engine/turns.py)."""

import fcntl
import importlib
import json
import os
import sys
import threading
import types

import pytest

from cpu_engine.turns import TURNS_VARIABLE

pytest.importorskip("torch")


class TritonModelException(Exception):
    pass


@pytest.fixture
def adapter(monkeypatch):
    backend = types.ModuleType("triton_python_backend_utils")
    backend.TritonModelException = TritonModelException  # no MetricFamily: the adapter serves without metrics
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    monkeypatch.delitem(sys.modules, "cpu_engine.triton_model", raising=False)
    module = importlib.import_module("cpu_engine.triton_model")
    yield module
    sys.modules.pop("cpu_engine.triton_model", None)


class FakeEngine:
    threads: dict[str, str] = {}
    fail_with: BaseException | None = None

    def __init__(self, **settings):
        FakeEngine.threads["built"] = threading.current_thread().name
        if FakeEngine.fail_with is not None:
            raise FakeEngine.fail_with
        self.settings = settings
        self.row_shape = types.SimpleNamespace(describe=lambda: "rows: floor 1")
        self.linear_kernel = "default"
        self.dtype, self.weight_quantization, self.invariance = "float32", "none", "always"
        self.attention_stack = 1
        self.pool = types.SimpleNamespace(clear=lambda: None)

    def bind_thread(self):
        FakeEngine.threads["forwards"] = threading.current_thread().name

    def pending(self):
        return 0


ARGS = {"model_name": "target",
        "model_config": json.dumps({"parameters": {"model_dir": {"string_value": "/models/target"},
                                                   "num_threads": {"string_value": "2"}}})}


def test_the_engine_is_built_on_the_thread_that_runs_its_forwards(adapter, monkeypatch):
    monkeypatch.setattr(adapter, "CausalLMEngine", FakeEngine)
    monkeypatch.setattr(FakeEngine, "threads", {})
    model = adapter.TritonPythonModel()
    model.initialize(ARGS)
    try:
        assert model.engine.settings["model_dir"] == "/models/target" and model.engine.settings["num_threads"] == 2
        for _ in range(200):  # the loop binds its threads right after the build
            if "forwards" in FakeEngine.threads:
                break
            threading.Event().wait(0.01)
        assert FakeEngine.threads["built"] == FakeEngine.threads["forwards"] == "target-engine"
        assert FakeEngine.threads["built"] != threading.current_thread().name
    finally:
        model.finalize()
    assert not model._thread.is_alive()


def test_an_engine_that_fails_to_build_fails_initialize_with_its_error(adapter, monkeypatch):
    monkeypatch.setattr(adapter, "CausalLMEngine", FakeEngine)
    monkeypatch.setattr(FakeEngine, "fail_with", ValueError("max_num_tokens must be at least 8, got 4"))
    with pytest.raises(ValueError, match="max_num_tokens must be at least 8"):
        adapter.TritonPythonModel().initialize(ARGS)


def cores_held() -> bool:
    """Whether the adapter holds the cores lock now (a second open file conflicts with its)."""
    other = os.open(os.environ[TURNS_VARIABLE] + ".cores", os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(other)


class SteppingEngine(FakeEngine):
    """Runs one forward per call and records whether it had the cores."""

    def __init__(self, **settings):
        super().__init__(**settings)
        self.forwards, self.submitted, self.had_the_cores = 0, 0, []
        self.stepped = threading.Event()

    def submit(self, request, on_tokens=None):
        self.submitted += 1
        return object()

    def pending(self):
        return self.submitted - self.forwards

    def step(self):
        self.had_the_cores.append(cores_held())
        self.forwards += 1
        self.stepped.set()
        return []


def test_each_forward_runs_holding_the_cores_lock_shared_with_the_other_engine(adapter, monkeypatch, tmp_path):
    monkeypatch.setenv(TURNS_VARIABLE, str(tmp_path / "forward-turns"))
    monkeypatch.setattr(adapter, "CausalLMEngine", SteppingEngine)
    model = adapter.TritonPythonModel()
    model.initialize(ARGS)
    try:
        model._queue(sender=None, engine_request="a call", streaming=False)
        assert model.engine.stepped.wait(10)
        assert model.engine.had_the_cores == [True]
    finally:
        model.finalize()


class BuiltHoldingTheCores(FakeEngine):
    """Records whether the other engine could have taken the cores while it was built."""

    def __init__(self, **settings):
        super().__init__(**settings)
        self.built_holding_the_cores = cores_held()


def test_the_engine_loads_and_measures_the_machine_holding_the_cores_lock(adapter, monkeypatch, tmp_path):
    """Draft and target load at once: each one's start-up timings (kernel, row shape,
    dense weights) run alone, not against the other's loading or timing."""
    monkeypatch.setenv(TURNS_VARIABLE, str(tmp_path / "forward-turns"))
    monkeypatch.setattr(adapter, "CausalLMEngine", BuiltHoldingTheCores)
    model = adapter.TritonPythonModel()
    model.initialize(ARGS)
    try:
        assert model.engine.built_holding_the_cores
        assert not cores_held()  # and lets them go once built
    finally:
        model.finalize()


class BatchingEngine(FakeEngine):
    """Every forward runs the calls submitted before it and answers them all; the
    first forward waits until the test lets it end."""

    def __init__(self, **settings):
        super().__init__(**settings)
        self.forwards, self.waiting, self.batches = 0, [], []
        self.first_forward_may_end = threading.Event()
        self.in_first_forward = threading.Event()
        self.last_forward = (0, 0)

    def submit(self, request, on_tokens=None):
        self.waiting.append(request)
        return request

    def pending(self):
        return len(self.waiting)

    def step(self):
        batch, self.waiting = self.waiting, []
        self.batches.append(batch)
        self.forwards += 1
        if self.forwards == 1:
            self.in_first_forward.set()
            self.first_forward_may_end.wait(10)
        return batch

    def result(self, call):
        return types.SimpleNamespace(tokens=[1], logits=None, log_probs=None)


def test_a_call_answered_by_a_forward_joins_the_next_one_though_a_new_request_came_meanwhile(adapter, monkeypatch):
    """A burst's first request asks for one token, then for more: its next call comes a
    BLS round trip after the answer. The engine holds the next forward for it; a new
    request queued during the forward is no one's next call, and once counted as one,
    the first request lost a whole prefill forward."""
    monkeypatch.setattr(adapter, "CausalLMEngine", BatchingEngine)
    monkeypatch.setattr(adapter, "join_wait", lambda forward_seconds: 5.0)  # ample: the test sets the order
    model = adapter.TritonPythonModel()
    model.initialize(ARGS)
    answered = threading.Event()
    monkeypatch.setattr(adapter, "_send", lambda sender, *args, **kwargs: answered.set())
    monkeypatch.setattr(adapter.pb_utils, "TRITONSERVER_RESPONSE_COMPLETE_FINAL", 1, raising=False)
    try:
        model._queue(sender="first", engine_request="first call", streaming=False)
        assert model.engine.in_first_forward.wait(10)
        model._queue(sender="new", engine_request="new request", streaming=False)
        model.engine.first_forward_may_end.set()
        assert answered.wait(10)
        threading.Event().wait(0.05)  # a round trip later
        model._queue(sender="first", engine_request="first's next call", streaming=False)
        for _ in range(500):
            if len(model.engine.batches) >= 2:
                break
            threading.Event().wait(0.01)
        assert model.engine.batches[:2] == [["first call"], ["new request", "first's next call"]]
    finally:
        model.finalize()
