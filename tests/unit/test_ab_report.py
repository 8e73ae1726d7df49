"""specdec-ab-report on synthetic scrapes whose answer is known: the arms'
latencies and tokens/s drawn from known distributions, recorded through the
server's own MetricsRecorder specs and buckets, exposed as Prometheus text."""

from __future__ import annotations

import json
import math

import numpy as np

from coordinator.response import metrics as specs
from tools import ab_report

NAMES = {"ttft": specs.TTFT_BY_ARM, "itl": specs.ITL_BY_ARM, "e2e": specs.E2E_BY_ARM,
         "tps": specs.TOKENS_PER_SECOND_BY_ARM}


def exposition(observations: dict[str, dict[str, list[float]]], requests: dict[str, int]) -> str:
    """Prometheus text for each arm's observations (kind -> values) and success counts."""
    lines = []
    for kind, family in NAMES.items():
        name = family["none"].name
        lines.append(f"# TYPE {name} histogram")
        for arm, by_kind in observations.items():
            values = np.asarray(by_kind.get(kind, []), dtype=float)
            for bound in family[arm].buckets:
                lines.append(f'{name}_bucket{{arm="{arm}",le="{bound}"}} {int((values <= bound).sum())}')
            lines.append(f'{name}_bucket{{arm="{arm}",le="+Inf"}} {len(values)}')
            lines.append(f'{name}_sum{{arm="{arm}"}} {values.sum()}')
            lines.append(f'{name}_count{{arm="{arm}"}} {len(values)}')
    lines.append("# TYPE specdec_requests_total counter")
    for arm, count in requests.items():
        lines.append(f'specdec_requests_total{{arm="{arm}",outcome="success"}} {count}')
        lines.append(f'specdec_requests_total{{arm="{arm}",outcome="error"}} 0')
    return "\n".join(lines) + "\n"


def arm(rng, n: int, tokens_per_second: float) -> dict[str, list[float]]:
    """n requests of 128 tokens at a log-normal speed around ``tokens_per_second``."""
    speed = tokens_per_second * rng.lognormal(0.0, 0.25, n)
    e2e = 128 / speed
    return {"tps": list(speed), "e2e": list(e2e), "ttft": list(0.05 * rng.lognormal(0, 0.2, n)),
            "itl": list(np.repeat(e2e / 128, 4))}


def report(control_speed, speculative_speed, n, seed=0, before=None):
    rng = np.random.default_rng(seed)
    observations = {"control": arm(rng, n, control_speed), "speculative": arm(rng, n, speculative_speed)}
    text = exposition(observations, {"control": n, "speculative": n})
    samples = ab_report.difference(ab_report.parse_exposition(text), before)
    return ab_report.analyse(samples), observations


def test_a_faster_speculative_arm_is_reported_as_helping():
    result, observations = report(control_speed=20.0, speculative_speed=30.0, n=400)
    assert result["verdict"].startswith("speculation helps")
    assert result["arms"]["control"]["requests"] == 400 and result["arms"]["speculative"]["requests"] == 400
    for name in ("control", "speculative"):
        true_median = float(np.median(observations[name]["e2e"]))
        estimate = result["arms"][name]["e2e_p50"]
        assert estimate["low"] <= true_median <= estimate["high"]
        assert abs(estimate["value"] / true_median - 1) < 0.1  # within the bucket resolution
        true_p99 = float(np.quantile(observations[name]["e2e"], 0.99))
        assert result["arms"][name]["e2e_p99"]["low"] <= true_p99 <= result["arms"][name]["e2e_p99"]["high"]
        true_mean = float(np.mean(observations[name]["tps"]))
        assert math.isclose(result["arms"][name]["tokens_per_second"]["value"], true_mean, rel_tol=1e-9)
    gap = result["difference"]["tokens_per_second"]
    assert gap["low"] > 0 and gap["low"] <= 10.0 * 1.03 <= gap["high"] + 1.0
    assert result["difference"]["e2e_p50"]["high"] < 0  # speculative requests finish sooner


def test_a_slower_speculative_arm_is_reported_as_hurting():
    result, _ = report(control_speed=30.0, speculative_speed=20.0, n=400)
    assert result["verdict"].startswith("speculation hurts")


def test_equal_arms_or_too_few_requests_are_not_yet_decided():
    assert report(25.0, 25.0, n=400, seed=3)[0]["verdict"].startswith("not yet decided")
    assert report(20.0, 30.0, n=3, seed=1)[0]["verdict"].startswith("not yet decided")


def test_an_arm_without_requests_is_not_decided():
    rng = np.random.default_rng(0)
    text = exposition({"speculative": arm(rng, 50, 30.0)}, {"speculative": 50})
    result = ab_report.analyse(ab_report.parse_exposition(text))
    assert result["verdict"].startswith("not yet decided")


def test_two_scrapes_report_only_the_requests_between_them():
    rng = np.random.default_rng(5)
    early = {"control": arm(rng, 200, 30.0), "speculative": arm(rng, 200, 20.0)}  # before the change
    late = {"control": arm(rng, 400, 20.0), "speculative": arm(rng, 400, 30.0)}
    both = {name: {kind: early[name][kind] + late[name][kind] for kind in early[name]} for name in early}
    before = ab_report.parse_exposition(exposition(early, {"control": 200, "speculative": 200}))
    after = ab_report.parse_exposition(exposition(both, {"control": 600, "speculative": 600}))
    result = ab_report.analyse(ab_report.difference(after, before))
    assert result["arms"]["control"]["requests"] == 400
    assert result["verdict"].startswith("speculation helps")


def test_the_prometheus_api_gives_the_same_report():
    rng = np.random.default_rng(2)
    text = exposition({"control": arm(rng, 300, 20.0), "speculative": arm(rng, 300, 30.0)},
                      {"control": 300, "speculative": 300})
    samples = ab_report.parse_exposition(text)
    asked = []

    def get(url):
        query = __import__("urllib.parse").parse.parse_qs(url.split("?", 1)[1])["query"][0]
        asked.append(query)
        name = query.split("(increase(")[1].split("[")[0]
        result = [{"metric": dict(labels), "value": [0, str(value)]}
                  for (sample, labels), value in samples.items() if sample == name]
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})

    via_api = ab_report.analyse(ab_report.prometheus_scrape("http://prom:9090", "30m", get))
    assert via_api == ab_report.analyse(samples)
    assert all("[30m]" in query for query in asked)


def test_the_cli_prints_both_arms_and_a_verdict_as_text_and_json(tmp_path, capsys):
    rng = np.random.default_rng(4)
    path = tmp_path / "after.txt"
    path.write_text(exposition({"control": arm(rng, 300, 20.0), "speculative": arm(rng, 300, 30.0)},
                               {"control": 300, "speculative": 300}))
    assert ab_report.main(["--after", str(path)]) == 0
    out = capsys.readouterr().out
    assert "control" in out and "speculative" in out and "speculation helps" in out.splitlines()[-1]
    assert ab_report.main(["--after", str(path), "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert set(parsed["arms"]) == {"control", "speculative"} and parsed["verdict"].startswith("speculation helps")
