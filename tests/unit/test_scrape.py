"""tools.scrape: reading the metrics port's text format."""

from __future__ import annotations

import pytest

from tools.scrape import (engine_cached_tokens, engine_forward_time, engine_running_calls, metric_samples,
                          metric_value)

# As Triton exports them (python-backend custom metrics next to Triton's own).
EXPOSITION = """\
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="coordinator",version="1"} 12
# HELP specdec_requests_total Requests finished, by outcome
# TYPE specdec_requests_total counter
specdec_requests_total{outcome="success"} 7
specdec_requests_total{outcome="error"} 1
specdec_requests_total{outcome="cancelled"} 2
# HELP specdec_engine_cached_tokens Tokens held by the engine's KV-cache pool
# TYPE specdec_engine_cached_tokens gauge
specdec_engine_cached_tokens{model="target"} 1536
specdec_engine_cached_tokens{model="draft"} 1472
# HELP specdec_engine_forwards_total Forward passes the CPU engine ran
# TYPE specdec_engine_forwards_total counter
specdec_engine_forwards_total{model="target"} 120
specdec_engine_forwards_total{model="draft"} 300
# HELP specdec_engine_forward_seconds_total Seconds the CPU engine spent in steps that ran a forward
# TYPE specdec_engine_forward_seconds_total counter
specdec_engine_forward_seconds_total{model="target"} 24.5
specdec_engine_forward_seconds_total{model="draft"} 9.25
# HELP specdec_engine_running_calls Calls in flight in the CPU engine (prefilling or decoding)
# TYPE specdec_engine_running_calls gauge
specdec_engine_running_calls{model="target"} 0
specdec_engine_running_calls{model="draft"} 1
"""


def test_values_are_summed_over_the_samples_matching_the_labels():
    assert metric_value(EXPOSITION, "specdec_requests_total") == 10
    assert metric_value(EXPOSITION, "specdec_requests_total", outcome="cancelled") == 2
    assert metric_samples(EXPOSITION, "specdec_requests_total", outcome="timeout") == []


def test_a_metric_the_server_does_not_export_is_an_error():
    with pytest.raises(KeyError, match="specdec_requests_total.*timeout"):
        metric_value(EXPOSITION, "specdec_requests_total", outcome="timeout")
    with pytest.raises(KeyError):
        metric_value(EXPOSITION, "specdec_nothing")


def test_engine_pool_sizes_by_model():
    assert engine_cached_tokens(EXPOSITION) == {"target": 1536, "draft": 1472}
    assert engine_cached_tokens("") == {}


def test_engine_forward_time_by_model():
    assert engine_forward_time(EXPOSITION) == {"target": (120, 24.5), "draft": (300, 9.25)}
    assert engine_forward_time("") == {}  # engines without the counters (the trtllm profile)


def test_engine_running_calls_by_model():
    assert engine_running_calls(EXPOSITION) == {"target": 0, "draft": 1}
    assert engine_running_calls("") == {}
