"""Smoke run of the AIPerf sweep (``specdec-aiperf``, ``make aiperf``) with the
real AIPerf of ``.venv-aiperf`` against the session's real tritonserver: 2
requests at concurrency 1 of 16 tokens, speculation on and off, over Triton's
generate_stream. Zero errors, one side-by-side row, and the off run's requests
carry ``speculation_window`` 0. The OpenAI endpoints AIPerf's chat and
completions modes call are driven by the ``openai`` package in
tests/server/test_openai_api.py; `make aiperf` runs AIPerf over them (docs/aiperf.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tools import aiperf_sweep

REPO = Path(__file__).resolve().parents[2]
REQUESTS = 2


def aiperf_executable() -> str:
    path = Path(os.environ.get("SPECDEC_AIPERF") or REPO / ".venv-aiperf" / "bin" / "aiperf")
    if not path.is_file():
        pytest.fail(f"no aiperf at {path}: `make test` installs it (make .venv-aiperf/.deps-stamp), "
                    "or set SPECDEC_AIPERF")
    return str(path)


def run_sweep(tmp_path: Path, tokenizer: Path, *options: str) -> dict:
    out = tmp_path / "aiperf"
    status = aiperf_sweep.main([
        "--aiperf", aiperf_executable(), "--concurrency", "1", "--modes", "on,off",
        "--requests", str(REQUESTS), "--input-tokens", "32", "--output-tokens", "16",
        "--tokenizer", str(tokenizer), "--request-timeout", "120", "--run-timeout", "240",
        "--out", str(out), *options,
    ])
    report = json.loads((out / "aiperf_sweep.json").read_text())
    failures = [run["failure"] for run in report["runs"] if run["failure"]]
    assert status == aiperf_sweep.EXIT_OK, f"rows: {report['rows']}, failures: {failures}"
    return report


def check_rows(report: dict, endpoint: str) -> None:
    assert [(row["endpoint"], row["concurrency"]) for row in report["rows"]] == [(endpoint, 1)]
    row = report["rows"][0]
    for mode in ("on", "off"):
        figures = row[mode]
        assert figures["errors"] == 0 and figures["failure"] == "" and figures["requests"] == REQUESTS, figures
        for key in ("output_token_throughput", "request_throughput", "ttft_ms", "itl_ms", "request_latency_ms"):
            assert figures[key] is not None and figures[key] > 0, (mode, key, figures)
    assert row["ratio"]["output_token_throughput"] > 0
    off_run = next(run for run in report["runs"] if run["mode"] == "off")
    sent = json.loads((Path(off_run["artifact_dir"]) / "inputs.json").read_text())
    bodies = [payload for entry in sent["data"] for payload in entry["payloads"]]
    assert bodies and all(body["speculation_window"] == 0 for body in bodies)


@pytest.mark.slow
def test_aiperf_template_endpoint_smoke_run(triton_server, real_target_dir, tmp_path):
    report = run_sweep(tmp_path, real_target_dir, "--endpoints", "template", "--url", triton_server.http_url)
    check_rows(report, "template")
