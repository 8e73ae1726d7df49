"""specdec-soak: process discovery and memory accounting, the verdict, and a
short soak against the real test server (slow)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tools import soak
from tools.client import Completion


def test_finds_the_process_listening_on_a_port_and_its_children():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert soak.listening_pid(server.getsockname()[1]) == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in soak.process_tree(os.getpid())
        name, rss = soak.process_memory(child.pid)
        assert rss > 0 and name
    finally:
        child.kill()
        child.wait()
    assert soak.process_memory(child.pid) is None


def test_a_descriptor_closed_while_listing_does_not_hide_the_listener(tmp_path):
    """Between listing a process's descriptors and reading them, some close
    (a gRPC channel's, say): the others must still be read."""
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242\n")
    fds = tmp_path / "4711" / "fd"
    fds.mkdir(parents=True)
    for n in range(20):  # not links: readlink fails on them, as on a descriptor closed meanwhile
        (fds / str(n)).write_text("")
    (fds / "20").symlink_to("socket:[4242]")
    assert soak.listening_pid(0x1F90, proc=tmp_path) == 4711


def test_nothing_listens_on_a_closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert soak.listening_pid(port) is None


def options(**overrides):
    base = dict(url="x:1", users=2, duration=100.0, max_tokens=8, cancel_ratio=0.1, warmup_seconds=None,
                max_growth_percent=10.0, prompts="humaneval")
    return SimpleNamespace(**{**base, **overrides})


def samples(*totals_kib):
    return [soak.MemorySample(10.0 * i, total, {"tritonserver": total}) for i, total in enumerate(totals_kib)]


def test_the_report_shows_how_the_kv_pools_grew_next_to_rss():
    memory_samples = samples(1000, 2000, 2050, 2100)
    for sample, tokens in zip(memory_samples, (0, 900, 1000, 1200)):
        sample.kv_cached_tokens = {"target": tokens, "draft": tokens // 2}
    report = soak.build_report(options(), soak.Tally(completed=5, tokens=40), memory_samples, 100.0, 42, True)
    assert report["memory"]["kv_cached_tokens_after_warmup"] == {"target": 900, "draft": 450}
    assert report["memory"]["kv_cached_tokens_end"] == {"target": 1200, "draft": 600}
    assert "KV pools draft 450 -> 600 tokens, target 900 -> 1200 tokens" in soak.summary(report)
    line = soak.progress_line(soak.Tally(completed=3), memory_samples, 30.0, 100.0)
    assert "completed 3" in line and "2 MiB (KV pools draft 600, target 1200 tokens)" in line


def test_the_metrics_url_follows_the_grpc_host_unless_given():
    assert soak.parse_args(["--url", "10.0.0.5:8001"]).metrics_url == "http://10.0.0.5:8002/metrics"
    assert soak.parse_args(["--metrics-url", ""]).metrics_url == ""
    assert soak.pool_tokens("") == {}
    assert soak.pool_tokens("http://127.0.0.1:9/metrics") == {}  # unreachable: no pool sizes, no crash


def test_growth_is_measured_from_the_end_of_the_warm_up():
    tally = soak.Tally(completed=5, tokens=40)
    report = soak.build_report(options(), tally, samples(1000, 2000, 2050, 2100), 100.0, 42, True)
    memory = report["memory"]
    assert report["warmup_seconds"] == 10.0 and memory["after_warmup_seconds"] == 10.0
    assert memory["growth_percent"] == 5.0 and report["passed"], report["failures"]
    json.dumps(report)


@pytest.mark.parametrize(
    "tally,totals,ready,failure",
    [
        (soak.Tally(completed=5, errors=1), (1000, 1000, 1000), True, "1 errors"),
        (soak.Tally(completed=5), (1000, 1000, 1200), True, "RSS grew 20.0 %"),
        (soak.Tally(completed=5), (1000, 1000), False, "server not ready"),
        (soak.Tally(completed=0), (1000, 1000), True, "no request completed"),
        (soak.Tally(completed=5), (), True, "server processes not found"),
    ],
)
def test_the_verdict_names_what_failed(tally, totals, ready, failure):
    report = soak.build_report(options(), tally, samples(*totals), 100.0, 42, ready)
    assert not report["passed"] and any(failure in f for f in report["failures"]), report["failures"]
    assert "FAIL" in soak.summary(report)


def test_a_final_response_that_breaks_the_contract_is_an_error():
    assert soak.check_completion(Completion(completion_tokens=8, draft_tokens=5, accepted_draft_tokens=4), 8, None) is None
    assert "tokens for max_tokens" in soak.check_completion(Completion(completion_tokens=9), 8, None)
    assert "accepted of" in soak.check_completion(Completion(completion_tokens=3, draft_tokens=1, accepted_draft_tokens=2), 8, None)
    assert "speculation_window 0" in soak.check_completion(Completion(completion_tokens=3, draft_tokens=2), 8, 0)


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        soak.parse_args(["--users", "0"])
    with pytest.raises(SystemExit):
        soak.parse_args(["--cancel-ratio", "2"])
    with pytest.raises(SystemExit):
        soak.parse_args(["--progress-seconds", "-1"])
    assert soak.parse_args([]).users == 4 and soak.parse_args([]).duration == 600.0
