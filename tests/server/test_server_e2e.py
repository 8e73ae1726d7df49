"""End-to-end tests against a real tritonserver with the real model pair.

Prompts are real HumanEval problems from the development range (0-99)."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

from coordinator.request.access import http_headers
from tools.client import build_inputs
from tests.server_client import complete, concurrently, grpc_error, humaneval_prompts, metric, metrics_text, tensor

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def test_streaming_completion_is_sensible_and_reports_statistics(triton_server):
    # A fixed window: the adaptive default may price speculation away on a
    # machine where a plain step is cheap, and this test reads the statistics.
    result = complete(triton_server, "def fibonacci(n):\n    ", max_tokens=24, speculation_window=4,
                      adaptive_window=False)
    assert result.chunks >= 2  # streamed in several pieces while speculating
    assert "return" in result.text or "fib" in result.text or "if" in result.text
    assert "def fibonacci" not in result.text  # the completion only, never the prompt
    assert result.completion_tokens == 24
    assert 0 < result.accepted_draft_tokens <= result.draft_tokens
    assert result.acceptance_rate == pytest.approx(result.accepted_draft_tokens / result.draft_tokens, rel=1e-6)


@pytest.mark.parametrize("prompt", humaneval_prompts(2, 23, 53))
def test_greedy_speculation_is_byte_identical_to_plain_decoding(triton_server, prompt):
    """A fixed window, so speculation is not priced away. The first speculative
    request decodes plainly while the draft prefills the prompt in the
    background (how many of its rounds speculate depends on timing); the second
    finds the prompt in the draft's prefix cache and speculates from its second
    round. Both must be the plain text."""
    plain = complete(triton_server, prompt, max_tokens=MAX_TOKENS, speculation_window=0)
    kwargs = dict(max_tokens=MAX_TOKENS, speculation_window=5, adaptive_window=False)
    cold = complete(triton_server, prompt, **kwargs)
    warm = complete(triton_server, prompt, **kwargs)
    assert cold.text == plain.text and warm.text == plain.text
    assert plain.draft_tokens == 0 and plain.acceptance_rate == 0.0
    assert warm.draft_tokens > 0, warm.fallback_reason
    assert warm.speculative_rounds >= warm.plain_rounds, warm
    for speculative in (cold, warm):
        assert speculative.accepted_draft_tokens <= speculative.draft_tokens
        assert speculative.acceptance_rate == pytest.approx(
            speculative.accepted_draft_tokens / max(speculative.draft_tokens, 1), rel=1e-6)


def test_seeded_sampling_repeats_with_rejection_sampling(triton_server):
    """Sampled requests verify by rejection sampling on the draft's logits (lossless
    in distribution: tests/unit/test_rejection_sampling.py). With a fixed window the
    rounds fall the same way, so the same seed gives the same text."""
    prompt = humaneval_prompts(11)[0]
    kwargs = dict(max_tokens=16, temperature=0.8, top_p=0.95, seed=20261129)
    first = complete(triton_server, prompt, speculation_window=4, adaptive_window=False, **kwargs)
    again = complete(triton_server, prompt, speculation_window=4, adaptive_window=False, **kwargs)
    assert first.text == again.text and first.completion_tokens == 16
    assert first.draft_tokens > 0 and first.accepted_draft_tokens > 0
    plain = complete(triton_server, prompt, speculation_window=0, **kwargs)
    assert plain.text == complete(triton_server, prompt, speculation_window=0, **kwargs).text
    other = complete(triton_server, prompt, speculation_window=4, adaptive_window=False,
                     **{**kwargs, "seed": 7})
    assert other.text != first.text


def test_separate_draft_temperature_is_served(triton_server):
    result = complete(triton_server, humaneval_prompts(12)[0], max_tokens=16, temperature=1.0, draft_temperature=0.5,
                      seed=3, speculation_window=3, adaptive_window=False)
    assert result.completion_tokens == 16 and result.draft_tokens > 0


def test_concurrent_seeded_sampled_streams_repeat_their_texts(triton_server):
    """Every engine call has its own seed, so a seeded sampled request gives the
    same text whatever runs beside it, as long as its rounds fall the same way.
    A draft call past draft_timeout_seconds turns a round plain (same
    distribution, another sample), so the prompts are short ones (38-45
    tokens): a crowd's draft prefills stay well within the deadline even on a
    slow machine. (Greedy streams in a crowd: tests/server/test_server_reliability.py.)"""
    jobs = [(p, dict(max_tokens=16, temperature=0.8, top_k=40, seed=100 + i, speculation_window=3,
                     adaptive_window=False)) for i, p in enumerate(humaneval_prompts(23, 45, 53))]
    alone = [complete(triton_server, prompt, **kwargs) for prompt, kwargs in jobs]
    together = concurrently(triton_server, jobs)
    late = [c.fallback_reason for c in alone + together if "draft_timeout_seconds" in (c.fallback_reason or "")]
    assert not late, f"a draft call ran past the deadline, so the rounds fell differently: {late}"
    assert [c.text for c in together] == [c.text for c in alone]
    assert all(c.draft_tokens > 0 and c.completion_tokens == 16 for c in alone + together)


def test_http_generate_endpoint(triton_server):
    body = json.dumps({"text_input": "def add(a, b):", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{triton_server.http_url}/v2/models/coordinator/generate", data=body,
                                     headers=http_headers(triton_server.api_key))
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    assert answer["text_output"] and answer["completion_tokens"] == 8
    assert answer["total_accepted_draft_tokens"] <= answer["total_draft_tokens"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt="def f():", max_tokens=0), "max_tokens must be between 1 and 1024, got 0"),
        (dict(prompt="def f():", max_tokens=5000), "max_tokens must be between 1 and 1024, got 5000"),
        (dict(prompt="def f():", max_tokens=4, speculation_window=-1), "speculation_window must be between 0 and 8"),
        (dict(prompt="def f():", max_tokens=4, speculation_window=9), "speculation_window must be between 0 and 8"),
        (dict(prompt="", max_tokens=4), "text_input is empty"),
        (dict(prompt="x = 1\n" * 2100, max_tokens=8), "exceeds the context limit of 4096 tokens"),
        (dict(prompt="def f():", max_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(triton_server, kwargs, message):
    prompt = kwargs.pop("prompt")
    assert message in grpc_error(triton_server, build_inputs(prompt, kwargs.pop("max_tokens"), **kwargs))
    assert complete(triton_server, "def g():", max_tokens=2).completion_tokens == 2


def test_wrong_dtype_shape_and_unknown_inputs_are_refused_by_name(triton_server):
    text = tensor("text_input", np.array([b"def f():"], dtype=object), "BYTES")
    wrong_dtype = tensor("max_tokens", np.array([4.0], dtype=np.float32), "FP32")
    assert "max_tokens" in grpc_error(triton_server, [text, wrong_dtype])
    wrong_shape = tensor("max_tokens", np.array([4, 4], dtype=np.int32), "INT32")
    assert "max_tokens" in grpc_error(triton_server, [text, wrong_shape])
    unknown = tensor("bogus", np.array([1], dtype=np.int32), "INT32")
    assert "bogus" in grpc_error(triton_server, [text, unknown])
    assert complete(triton_server, "def g():", max_tokens=2).completion_tokens == 2


def test_metrics_port_serves_specdec_metrics_matching_the_responses(triton_server):
    before = metrics_text(triton_server)
    assert 'nv_inference_request_success{model="coordinator"' in before
    results = [complete(triton_server, p, max_tokens=24, speculation_window=4, adaptive_window=False)
               for p in humaneval_prompts(31, 32)]
    after = metrics_text(triton_server)

    def delta(name):
        return metric(after, name) - metric(before, name)

    assert delta("specdec_draft_tokens_total") == sum(r.draft_tokens for r in results) > 0
    assert delta("specdec_accepted_draft_tokens_total") == sum(r.accepted_draft_tokens for r in results)
    assert delta("specdec_emitted_tokens_total") == sum(r.completion_tokens for r in results) == 48
    assert delta("specdec_rounds_total") == sum(r.speculative_rounds + r.plain_rounds for r in results)
    assert delta("specdec_accepted_tokens_per_round_count") == sum(r.speculative_rounds for r in results)
    assert delta("specdec_time_to_first_token_seconds_count") == 2
    # counted under the arm "none" (they set speculation_window themselves), a label the sum covers
    assert metric(after, "specdec_requests_total", outcome="success") - metric(before, "specdec_requests_total",
                                                                           outcome="success") == 2
    for gauge in ("specdec_speculation_window", "specdec_fallback_active", "specdec_draft_cost_ratio"):
        metric(after, gauge)


def test_the_coordinator_timed_its_engines_before_the_server_reported_ready(triton_server):
    """specdec-serve's first request has the coordinator time both engines
    (coordinator/policy/startup_profile.py) before it reports ready: a first
    burst is priced by the batch forecast, not let through blind."""
    if not triton_server.log_path:
        pytest.skip("an external server: its log is not here")
    log = triton_server.log_path.read_text(errors="replace")
    profile = re.search(r"engine profile: target ([0-9.]+) ms a forward at 1 row, ([0-9.]+) ms at (\d+) rows; "
                        r"draft ([0-9.]+) ms a forward at 1 row", log)
    assert profile, "no engine profile in the server's log"
    assert profile.start() < log.index("specdec: ready")
    assert all(float(profile.group(i)) > 0 for i in (1, 2, 4)) and int(profile.group(3)) > 1
