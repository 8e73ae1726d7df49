"""Smoke run of the locust load test against a real tritonserver with the real
model pair (the ``triton_server`` fixture): 2 users, one with speculation and
one without, for 30 s. Zero failures, and the reports `make loadtest` relies on."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).parent / "locust"
REQUEST_NAMES = {(kind, name) for kind in ("ttft", "itl", "completion") for name in ("spec", "plain")}


@pytest.mark.slow
def test_locust_smoke_run_has_no_failures_and_writes_the_reports(triton_server, tmp_path):
    prefix = tmp_path / "locust"
    html = tmp_path / "locust.html"
    proc = subprocess.run(
        [str(LOCUST), "-f", str(REPO / "loadtests" / "locustfile.py"), "--headless", "--only-summary",
         "--host", triton_server.grpc_url, "--steps", "2", "--modes", "mix", "--step-seconds", "30",
         # HumanEval 13-16: short prompts (53-67 tokens), so one request fits the
         # phase also where the engine prefills a few rows per forward (AVX2-only CPUs).
         "--max-tokens", "16", "--humaneval", "13-16", "--request-timeout", "90",
         # A fixed window, so the speculative user drafts whatever the load governor
         # decides at 2 streams (it holds adaptive requests back where the machine's
         # forward costs price plain decoding faster): the report's acceptance is checked.
         "--spec-window", "4", "--adaptive-window", "false",
         # At the end, let the requests in flight finish (a loaded machine may
         # need longer than the phase for one request) rather than cancel them.
         "--stop-timeout", "60",
         "--csv", str(prefix), "--html", str(html)],
        cwd=tmp_path, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    with open(f"{prefix}_stats.csv") as source:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(source) if row["Type"]}
    assert REQUEST_NAMES <= set(stats), f"request names: {sorted(stats)}; locust's output:\n{output[-5000:]}"
    assert sum(int(row["Failure Count"]) for row in stats.values()) == 0
    with open(f"{prefix}_failures.csv") as source:
        assert list(csv.DictReader(source)) == []
    assert html.stat().st_size > 10_000 and "locust" in html.read_text(errors="replace").lower()
    # The load test's own per-step table: one row per mode, acceptance only with speculation.
    with open(f"{prefix}_specdec_summary.csv") as source:
        rows = {row["speculation"]: row for row in csv.DictReader(source)}
    assert set(rows) == {"on", "off"}
    for row in rows.values():
        assert row["users"] == "2" and row["errors"] == "0" and int(row["requests"]) >= 1
        assert float(row["tokens_per_second_per_stream"]) > 0
    assert int(rows["on"]["draft_tokens"]) > 0 and 0 <= float(rows["on"]["acceptance"]) <= 1
    assert rows["off"]["draft_tokens"] == "0" and rows["off"]["acceptance"] == ""
    assert Path(f"{prefix}_specdec.png").stat().st_size > 10_000
    assert "| users | speculation | requests | requests/s | p50 TTFT s" in output
