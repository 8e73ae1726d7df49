"""tools.scrape: reading the metrics port's text format."""

from __future__ import annotations

import pytest

from tools.scrape import engine_cached_tokens, metric_samples, metric_value

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
