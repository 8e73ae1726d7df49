"""`make soak`, short, against the real test server (the soak tool's own checks:
tests/unit/test_soak.py)."""

import json

import pytest

from tools import soak


@pytest.mark.slow
def test_short_soak_against_the_real_server(triton_server, tmp_path, capsys):
    """The `make test` version of the soak: 2 users for 30 s, short prompts (the full one: `make soak`)."""
    report_path = tmp_path / "soak.json"
    argv = ["--url", triton_server.grpc_url, "--users", "2", "--duration", "30", "--max-tokens", "12",
            "--prompts", "short", "--warmup-seconds", "10", "--sample-seconds", "3", "--progress-seconds", "10",
            "--metrics-url", f"{triton_server.metrics_url}/metrics", "--json", str(report_path)]
    if triton_server.pid:
        argv += ["--pid", str(triton_server.pid)]
    code = soak.main(argv)
    report = json.loads(report_path.read_text())
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specdec-soak: ")]
    assert len(progress) >= 2 and "/30 s  completed " in progress[0], progress
    print(soak.summary(report))
    assert report["errors"] == 0, report["error_examples"]
    assert report["completed"] + report["cancelled"] >= 4 and report["server_ready_after"]
    assert report["memory"]["growth_percent"] < 10.0, report["memory"]
    assert set(report["memory"]["kv_cached_tokens_end"]) == {"target", "draft"}, report["memory"]
    assert code == 0, report["failures"]
