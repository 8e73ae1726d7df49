"""Admission control: the pure bound (coordinator/request/admission.py), its
setting, and the coordinator's Triton adapter, which refuses a request at the
bound at once with UNAVAILABLE, counts it, and frees a request's slot before
its final response goes out. The real server: tests/server/test_server_admission.py."""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from types import SimpleNamespace

import pytest

from coordinator.engines.contract import EngineError
from coordinator.request.admission import Admission, is_refusal, refusal_message
from coordinator.request.parse import InputError
from coordinator.response import metrics as specs
from coordinator.response.metrics import MetricsRecorder
from coordinator.settings import CoordinatorSettings, SettingsError


def test_the_bound_admits_up_to_its_limit_and_a_release_makes_room():
    admission = Admission(2)
    first, second = admission.admit(), admission.admit()
    assert first and second and admission.in_flight == 2
    assert admission.admit() is None and admission.in_flight == 2
    first.release()
    first.release()  # twice: still one slot
    assert admission.in_flight == 1
    assert admission.admit() is not None and admission.admit() is None


@pytest.mark.parametrize("limit", [0, -1])
def test_a_bound_below_one_is_refused(limit):
    with pytest.raises(ValueError, match="max_inflight_requests must be at least 1"):
        Admission(limit)


def test_the_refusal_names_the_setting_and_is_recognised_behind_prefixes():
    message = refusal_message(8)
    assert message.startswith("server busy: 8 requests are in flight") and "(max_inflight_requests)" in message
    assert is_refusal(message) and is_refusal(f"[request id: 3] {message}") and is_refusal(f"coordinator: {message}")
    assert not is_refusal("max_tokens must be between 1 and 1024, got 0")
    assert not is_refusal("target: the model stopped serving")


def test_the_setting_comes_from_the_config_or_the_environment():
    assert CoordinatorSettings.from_parameters({"max_inflight_requests": "8"}, {}).max_inflight_requests == 8
    assert CoordinatorSettings.from_parameters({"max_inflight_requests": "8"},
                                               {"SPECDEC_MAX_INFLIGHT": "3"}).max_inflight_requests == 3
    assert CoordinatorSettings().max_inflight_requests == 64
    for bound in ("0", "-1"):
        with pytest.raises(SettingsError, match=r"max_inflight_requests \(SPECDEC_MAX_INFLIGHT\) must be at least 1"):
            CoordinatorSettings.from_parameters({"max_inflight_requests": "8"}, {"SPECDEC_MAX_INFLIGHT": bound})
    with pytest.raises(SettingsError, match="max_inflight_requests must be int"):
        CoordinatorSettings.from_parameters({}, {"SPECDEC_MAX_INFLIGHT": "lots"})


# ------------------------------------------------------------ the adapter ----

FINAL = 1
UNAVAILABLE = 14


class FakeBackend(types.ModuleType):
    """What the adapter's request path uses of triton_python_backend_utils."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    def __init__(self):
        super().__init__("triton_python_backend_utils")

        class TritonError:
            UNAVAILABLE = UNAVAILABLE
            INTERNAL = 13

            def __init__(self, message, code=13):
                self.text, self.code = message, code

        class InferenceResponse:
            def __init__(self, output_tensors=None, error=None):
                self.output_tensors, self.error = output_tensors, error

        self.TritonError = TritonError
        self.InferenceResponse = InferenceResponse

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return None


class Instrument:
    def __init__(self):
        self.value = 0.0

    def increment(self, value):
        self.value += value

    def set(self, value):
        self.value = value

    def observe(self, value):
        pass


class Sender:
    """Records each response with the requests in flight when it was sent."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self.sent: list[tuple[object, int, int]] = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags, self.admission.in_flight))


class Request:
    def __init__(self, sender):
        self.sender = sender

    def get_response_sender(self):
        return self.sender

    def parameters(self):
        return ""

    def is_cancelled(self):
        return False


@pytest.fixture
def adapter(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakeBackend())
    monkeypatch.delitem(sys.modules, "coordinator.triton.coordinator_model", raising=False)
    module = importlib.import_module("coordinator.triton.coordinator_model")
    yield module
    sys.modules.pop("coordinator.triton.coordinator_model", None)


def model(module, limit: int, chunks=None, failure: Exception | None = None):
    """A coordinator instance without engines: ``chunks`` are what generating yields."""
    instruments: dict = {}
    coordinator = object.__new__(module.TritonPythonModel)
    coordinator.settings = CoordinatorSettings(max_inflight_requests=limit)
    coordinator.metrics = MetricsRecorder(lambda spec: instruments.setdefault(spec, Instrument()))
    coordinator.admission = Admission(limit)
    coordinator.metrics.admission(0, limit)
    coordinator.governor = SimpleNamespace(disrupted=lambda: None)
    coordinator.codec = coordinator.draft = coordinator.target = coordinator.costs = None
    coordinator.instruments = instruments

    async def generate(*args, **kwargs):
        for chunk in chunks or ():
            await asyncio.sleep(0)
            yield chunk
        if failure is not None:
            raise failure

    module.parse_request = lambda raw, settings, new_seed: SimpleNamespace(stream=True)
    module.generate_text = generate
    module._response = lambda text, final: ("response", text)
    return coordinator


def chunk(text: str, final: bool = False):
    return SimpleNamespace(text=text, final=final)


def test_a_request_at_the_bound_is_refused_at_once_with_unavailable_and_counted(adapter):
    coordinator = model(adapter, limit=1)
    held = coordinator.admission.admit()  # one request in flight
    sender = Sender(coordinator.admission)
    asyncio.run(coordinator._serve(Request(sender)))
    [(response, flags, in_flight)] = sender.sent
    assert flags == FINAL and response.error.code == UNAVAILABLE
    assert is_refusal(response.error.text) and "1 requests are in flight" in response.error.text
    assert coordinator.instruments[specs.REFUSED].value == 1
    assert coordinator.instruments[specs.REQUESTS["error"]].value == 0  # it never started
    assert in_flight == 1 and coordinator.admission.in_flight == 1  # the request in flight is untouched
    held.release()


def test_a_slot_is_free_before_the_final_response_goes_out(adapter):
    coordinator = model(adapter, limit=1, chunks=[chunk("a"), chunk("b", final=True)])
    sender = Sender(coordinator.admission)
    asyncio.run(coordinator._serve(Request(sender)))
    assert [(flags, in_flight) for _, flags, in_flight in sender.sent] == [(0, 1), (FINAL, 0)]
    assert coordinator.instruments[specs.INFLIGHT].value == 0
    assert coordinator.instruments[specs.MAX_INFLIGHT].value == 1
    # the next request of a client that got the final response is admitted
    again = Sender(coordinator.admission)
    asyncio.run(model(adapter, limit=1, chunks=[chunk("c", final=True)])._serve(Request(again)))
    assert again.sent[-1][1] == FINAL and again.sent[-1][0][0] == "response"


@pytest.mark.parametrize("failure,message", [
    (InputError("max_tokens must be between 1 and 1024, got 0"), "max_tokens must be between 1 and 1024, got 0"),
    (EngineError("target: out of memory"), "target: out of memory"),
    (ZeroDivisionError("bug"), "coordinator internal error: bug"),
])
def test_every_failure_frees_its_slot_before_its_error_response(adapter, failure, message):
    coordinator = model(adapter, limit=2, chunks=[chunk("a")], failure=failure)
    sender = Sender(coordinator.admission)
    asyncio.run(coordinator._serve(Request(sender)))
    response, flags, in_flight = sender.sent[-1]
    assert flags == FINAL and in_flight == 0
    assert response.error.text == message
    assert coordinator.admission.in_flight == 0


def test_the_in_flight_gauge_counts_the_requests_being_served(adapter):
    seen = []
    coordinator = model(adapter, limit=3)

    async def generate(*args, **kwargs):
        seen.append(coordinator.instruments[specs.INFLIGHT].value)
        await asyncio.sleep(0.01)
        yield chunk("x", final=True)

    adapter.generate_text = generate

    async def three():
        await asyncio.gather(*(coordinator._serve(Request(Sender(coordinator.admission))) for _ in range(4)))

    asyncio.run(three())
    assert max(seen) == 3  # the fourth was refused
    assert coordinator.instruments[specs.REFUSED].value == 1 and coordinator.admission.in_flight == 0
