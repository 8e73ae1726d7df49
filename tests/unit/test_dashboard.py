"""The Grafana dashboard (k8s/base/grafana-dashboard.json), offline: every
PromQL expression parses (promql-parser), every metric it names is one the
coordinator or the engine watchdog exports, and every overlay provisions it
as a ConfigMap that Grafana's sidecar picks up."""

from __future__ import annotations

import json
import re

import pytest

from coordinator.response.metrics import all_specs
from selfheal.exposition import METRICS as WATCHDOG_METRICS
from tests.unit.test_k8s import K8S, OVERLAYS, render

DASHBOARD = K8S / "base" / "grafana-dashboard.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def exported() -> set[str]:
    names = set()
    for spec in all_specs():
        names.add(spec.name)
        if spec.kind == "histogram":
            names.update(spec.name + suffix for suffix in HISTOGRAM_SUFFIXES)
    names.update(name for name, *_ in WATCHDOG_METRICS)
    return names


def selectors(node) -> list[str]:
    """The metric names of every vector selector in a parsed expression."""
    import promql_parser

    if isinstance(node, promql_parser.VectorSelector):
        return [node.name]
    found = []
    for attribute in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None and not isinstance(child, (str, int, float)):
            found += selectors(child)
    for child in getattr(node, "args", None) or ():
        found += selectors(child)
    return found


def test_every_expression_parses_and_names_only_exported_metrics():
    import promql_parser

    known = exported()
    seen = set()
    for title, expr in expressions():
        grafana = expr.replace("$__rate_interval", "5m")  # Grafana fills its variables before querying
        try:
            tree = promql_parser.parse(grafana)
        except Exception as error:
            pytest.fail(f"panel {title!r}: PromQL does not parse: {error}\n{expr}")
        names = selectors(tree)
        assert names, f"panel {title!r}: no metric found in {expr}"
        assert set(names) == set(re.findall(r"\bspecdec_[a-z_]+", expr))  # the walk missed none
        unknown = set(names) - known
        assert not unknown, f"panel {title!r} names metrics nobody exports: {sorted(unknown)}"
        seen.update(names)
    # what the rollout watches is on the dashboard
    for name in ("specdec_request_latency_seconds_bucket", "specdec_time_to_first_token_seconds_bucket",
                 "specdec_inter_token_latency_seconds_bucket", "specdec_request_tokens_per_second_sum",
                 "specdec_accepted_at_position_total", "specdec_accepted_draft_tokens_total",
                 "specdec_load_speculating", "specdec_engine_up", "specdec_engine_recoveries_total"):
        assert name in seen


def test_latency_panels_split_by_arm():
    for title, expr in expressions():
        if "histogram_quantile" in expr and "arm" in title:
            assert "arm" in expr.split("sum by (")[1].split(")")[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_provisions_the_dashboard_for_grafanas_sidecar(overlay):
    maps = [doc for doc in render(f"overlays/{overlay}")
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "specdec-grafana-dashboard"]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["specdec-dashboard.json"]) == json.loads(DASHBOARD.read_text())


def test_the_rollout_alerts_parse_and_name_only_exported_metrics():
    import promql_parser

    from tests.unit.test_k8s import rule_expressions

    rules = dict(rule_expressions(render("overlays/cpu")))
    for name in ("SpecDecP99LatencyHigh", "SpecDecSpeculativeArmSlower"):
        names = selectors(promql_parser.parse(rules[name]))
        assert names and not set(names) - exported(), f"{name}: {sorted(set(names) - exported())}"
    assert 'arm="control"' in rules["SpecDecSpeculativeArmSlower"]
