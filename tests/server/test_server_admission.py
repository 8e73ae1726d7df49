"""Admission control on the session's real server: with max_inflight_requests
requests in flight, the next one is refused at once on every path (gRPC,
Triton's HTTP generate, the OpenAI frontend) with the setting named, the
refusals are counted, and the requests in flight complete untouched. Then a
burst of three times a smaller bound, sent at once. The pure bound and the
adapter: tests/unit/test_admission.py."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from coordinator.request.access import grpc_headers
from coordinator.request.admission import is_refusal
from selfheal import triton_admin
from tests._config_helpers import model_config, parameter
from tests.server_client import complete, grpc_error, http_status, humaneval_prompts, metric, metrics_text, tensor
from tools.client import build_inputs, stream_completion
from tools.stream import RequestFailed

pytestmark = pytest.mark.slow

# Each request in flight is held to up to TOKENS tokens, at least as many as its
# min_length lets it (the model's other end ids still end it): no request ends
# while the refusals are checked, which the test verifies.
TOKENS = 32
# A fixed window: requests that leave the window to the server are the ones the
# load governor learns from (coordinator/policy/governor.py), and a crowd of
# eight on two cores would teach it a verdict for the loads later tests run at.
FIXED_WINDOW = dict(speculation_window=4, adaptive_window=False)


def fill(server, prompts: list[str], results: list, failures: list) -> list[threading.Thread]:
    """One streamed request of up to TOKENS tokens per prompt, each on a thread."""
    def run(prompt):
        inputs = build_inputs(prompt, TOKENS, **FIXED_WINDOW) + [
            tensor("min_length", np.array([TOKENS], np.int32), "INT32")]
        try:
            with grpcclient.InferenceServerClient(server.grpc_url) as client:
                results.append(stream_completion(client, inputs, timeout=900, headers=grpc_headers(server.api_key)))
        except BaseException as error:  # reported by the test
            failures.append(error)

    threads = [threading.Thread(target=run, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    return threads


def in_flight(server) -> float:
    return metric(metrics_text(server), "specdec_inflight_requests")


def wait_for_in_flight(server, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while in_flight(server) != count:
        assert time.monotonic() < deadline, f"{in_flight(server)} requests in flight after {timeout:g} s, not {count}"
        time.sleep(0.05)


def test_a_full_server_refuses_the_next_request_at_once_and_loses_none_in_flight(triton_server, openai_frontend):
    server = triton_server
    before = metrics_text(server)
    limit = int(metric(before, "specdec_max_inflight_requests"))
    assert limit == int(parameter(model_config("coordinator", "cpu"), "max_inflight_requests")) == 8
    wait_for_in_flight(server, 0, timeout=120)  # earlier tests' cancelled requests are gone
    # A first request warms what the server does once (its first forwards, the
    # drafters), which would otherwise hold up the filling requests' arrival.
    assert complete(server, "def k():", max_tokens=2).completion_tokens == 2
    before = metrics_text(server)

    results: list = []
    failures: list = []
    threads = fill(server, humaneval_prompts(*range(limit)), results, failures)
    try:
        filling = time.monotonic()
        wait_for_in_flight(server, limit, timeout=300)  # every filling request arrived (slow on busy cores)
        started = time.monotonic()
        print(f"\n{limit} requests in flight {started - filling:.1f} s after they were sent")

        # gRPC: an error response naming the setting (the stream stays usable) ...
        message = grpc_error(server, build_inputs("def k():", 2), timeout=30)
        assert is_refusal(message) and f"{limit} requests are in flight" in message, message
        # ... and with the triton_grpc_error header, the closest status Triton 2.51's
        # Python backend can give (it has no RESOURCE_EXHAUSTED): UNAVAILABLE.
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            with pytest.raises(RequestFailed) as refused:
                stream_completion(client, build_inputs("def k():", 2), timeout=30,
                                  headers={**(grpc_headers(server.api_key) or {}), "triton_grpc_error": "true"})
        assert refused.value.kind == "server busy" and "UNAVAILABLE" in str(refused.value.status()), refused.value
        # Triton's HTTP generate answers a model's error with 400 (its mapping), the message intact.
        status, body = http_status(server, "/v2/models/coordinator/generate", "POST",
                                   body=b'{"text_input": "def k():", "max_tokens": 2}')
        assert status == 400 and is_refusal(body), (status, body)
        # The OpenAI frontend: 429 with Retry-After (the openai package retries it; here it may not).
        client = openai.OpenAI(base_url=openai_frontend, api_key=server.api_key or "none", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model="coordinator", prompt="def k():", max_tokens=2)
        assert limited.value.response.headers["retry-after"] == "1"
        assert "max_inflight_requests" in limited.value.message

        refusing = time.monotonic() - started
        assert in_flight(server) == limit, "a request in flight ended while the refusals were checked: inconclusive"
    finally:
        for thread in threads:
            thread.join(timeout=900)
    print(f"\nfour refusals in {refusing:.2f} s with {limit} requests in flight")
    assert refusing < 10, "refused at once, not after waiting for a slot"

    # Nothing in flight was lost, and the refusals are counted apart from the requests.
    assert not failures, failures  # every request in flight got its final response, none an error
    assert len(results) == limit and all(1 <= r.completion_tokens <= TOKENS and r.text for r in results), results
    after = metrics_text(server)
    assert metric(after, "specdec_refused_requests_total") - metric(before, "specdec_refused_requests_total") == 4
    assert (metric(after, "specdec_requests_total", outcome="success")
            - metric(before, "specdec_requests_total", outcome="success")) == limit
    assert (metric(after, "specdec_requests_total", outcome="error")
            == metric(before, "specdec_requests_total", outcome="error"))
    # The server keeps serving: the next request is admitted.
    wait_for_in_flight(server, 0, timeout=30)
    assert complete(server, "def k():", max_tokens=2).completion_tokens == 2


# The bound for the burst test, and the burst: three times the bound, sent at once.
BURST_BOUND = 4
BURST = 12


def burst(server, prompts: list[str]) -> list[tuple[str, object, float]]:
    """Every prompt as a streamed request of TOKENS tokens, all released at
    once; per request (outcome, completion or error, seconds to its answer)."""
    gate = threading.Barrier(len(prompts))
    outcomes: list = [None] * len(prompts)

    def run(index: int, prompt: str) -> None:
        inputs = build_inputs(prompt, TOKENS, **FIXED_WINDOW) + [
            tensor("min_length", np.array([TOKENS], np.int32), "INT32")]
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            gate.wait()
            sent = time.monotonic()
            try:
                answer = stream_completion(client, inputs, timeout=900, headers=grpc_headers(server.api_key))
                outcomes[index] = ("served", answer, time.monotonic() - sent)
            except RequestFailed as failed:
                outcomes[index] = (failed.kind, failed, time.monotonic() - sent)

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    return outcomes


def test_a_burst_of_three_times_the_bound_gets_the_bound_served_and_the_rest_refused_at_once(triton_server):
    """max_inflight_requests set to 4 on the running server (a config load
    through the model-repository API, as an operator may change it), then 12
    requests at once: 4 complete in full, 8 are refused before any of those
    ends, naming the setting; nothing is lost and the bound comes back."""
    server = triton_server
    original = triton_admin.config(server.http_url, "coordinator", server.admin_key, timeout=60)
    bounded = copy.deepcopy(original)
    bounded["parameters"]["max_inflight_requests"] = {"string_value": str(BURST_BOUND)}
    wait_for_in_flight(server, 0, timeout=120)
    triton_admin.load_config(server.http_url, "coordinator", bounded, server.admin_key, timeout=300)
    try:
        assert metric(metrics_text(server), "specdec_max_inflight_requests") == BURST_BOUND
        assert complete(server, "def k():", max_tokens=2).completion_tokens == 2  # the new instance's first call
        before = metrics_text(server)
        outcomes = burst(server, humaneval_prompts(*range(BURST)))
        after = metrics_text(server)
    finally:
        triton_admin.load_config(server.http_url, "coordinator", original, server.admin_key, timeout=300)

    assert all(outcomes), "a request of the burst never answered"
    served = [(answer, seconds) for kind, answer, seconds in outcomes if kind == "served"]
    refused = [(error, seconds) for kind, error, seconds in outcomes if kind != "served"]
    print(f"\nburst of {BURST} at bound {BURST_BOUND}: {len(served)} served in "
          f"{min(s for _, s in served):.1f}-{max(s for _, s in served):.1f} s, {len(refused)} refused in "
          f"{max(s for _, s in refused):.2f} s at most")
    assert len(served) == BURST_BOUND and len(refused) == BURST - BURST_BOUND, [o[0] for o in outcomes]
    for error, _ in refused:
        assert error.kind == "server busy" and f"{BURST_BOUND} requests are in flight" in error.detail, error
        assert "max_inflight_requests" in error.detail, error
    slowest_refusal = max(seconds for _, seconds in refused)
    assert slowest_refusal < 10, "refused at once, not after waiting for a slot"
    assert slowest_refusal < min(seconds for _, seconds in served), "a refusal came after a slot was freed"
    assert all(1 <= answer.completion_tokens <= TOKENS and answer.text for answer, _ in served), served
    assert metric(after, "specdec_refused_requests_total") - metric(before, "specdec_refused_requests_total") == 8
    assert (metric(after, "specdec_requests_total", outcome="success")
            - metric(before, "specdec_requests_total", outcome="success")) == BURST_BOUND
    assert (metric(after, "specdec_requests_total", outcome="error")
            == metric(before, "specdec_requests_total", outcome="error"))
    # The repository's bound is back, and the server serves.
    assert metric(metrics_text(server), "specdec_max_inflight_requests") == 8
    assert complete(server, "def k():", max_tokens=2).completion_tokens == 2
