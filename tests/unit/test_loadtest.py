"""The locust load test (loadtests/) without a model: its workload options, the
per-step report, the timed gRPC stream and whole locust runs (local and
master/worker) against loadtests/fake_triton.py, a stand-in that speaks the
coordinator's streaming contract and misbehaves on request. The run against
the real server is tests/server/test_loadtest_smoke.py (slow)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.client import build_inputs, stream_completion
from loadtests import fake_triton, report, workload
from loadtests.grpc_stream import RequestFailed, Timing, timed_completion
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtests" / "locustfile.py"
LOCUST = Path(sys.executable).parent / "locust"
REQUEST_NAMES = {(kind, name) for kind in ("ttft", "itl", "completion") for name in ("spec", "plain")}


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==(\S+)$", line)
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


# ------------------------------------------------------- requirements ----


def test_loadtest_requirements_are_pinned_and_installed_by_make_test():
    loadtest = _pins(REPO / "requirements" / "loadtest.txt")
    assert "locust" in loadtest
    serve = _pins(REPO / "requirements" / "cpu-serve.txt")
    differing = {name: (pin, serve[name]) for name, pin in loadtest.items() if name in serve and serve[name] != pin}
    assert not differing, f"requirements/loadtest.txt and cpu-serve.txt pin differently: {differing}"
    includes = [line.strip() for line in (REPO / "requirements" / "test.txt").read_text().splitlines()]
    assert "-r loadtest.txt" in includes, "requirements/test.txt must include loadtest.txt (make test runs the smoke run)"
    content = (REPO / "requirements" / "loadtest.txt").read_text()
    for line in content.splitlines():
        if line.strip() and not line.startswith("#"):
            assert "==" in line, f"unpinned: {line}"


def test_the_client_side_needs_no_model_packages():
    """The locust image installs only requirements/loadtest.txt: what the
    locustfile imports from the project must not pull torch & co."""
    code = (
        "import sys\n"
        "import tools.client, tools.bench\n"
        "import loadtests.workload, loadtests.report, loadtests.grpc_stream, loadtests.fake_triton\n"
        "print(' '.join(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'safetensors', 'gguf',"
        " 'accelerate', 'pytriton', 'tqdm') if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"the load-test client imports {proc.stdout.strip()}"


def test_the_image_holds_what_the_locustfile_imports():
    dockerfile = (REPO / "loadtests" / "Dockerfile").read_text()
    copies = " ".join(re.findall(r"^COPY (.+)$", dockerfile.replace("\\\n", " "), re.MULTILINE))
    for module in sorted((REPO / "loadtests").glob("*.py")):
        assert f"loadtests/{module.name}" in copies, f"loadtests/Dockerfile does not copy {module.name}"
    assert "coordinator ./coordinator" in copies and "tools ./tools" in copies
    assert "requirements/loadtest.txt" in copies
    assert '"/opt/specdec/loadtests/locustfile.py"' in dockerfile


# ----------------------------------------------------------- workload ----


def test_numbers_and_phases():
    assert workload.numbers("64", int) == [64]
    assert workload.numbers("16, 32,64", int) == [16, 32, 64]
    assert workload.numbers("0,0.7", float) == [0.0, 0.7]
    with pytest.raises(ValueError):
        workload.numbers("", int)
    assert workload.build_phases("1,2,4", "on,off") == [(1, "on"), (1, "off"), (2, "on"), (2, "off"), (4, "on"), (4, "off")]
    assert workload.build_phases("2", "mix") == [(2, "mix")]
    for steps, modes in (("1,0", "on"), ("1", "sideways"), ("1", "")):
        with pytest.raises(ValueError):
            workload.build_phases(steps, modes)


def test_options_have_locust_style_environment_variables():
    names = {workload.env_name(flag) for flag, _ in workload.OPTIONS}
    assert {"LOCUST_STEPS", "LOCUST_MODES", "LOCUST_STEP_SECONDS", "LOCUST_PROMPTS_FILE", "LOCUST_MAX_TOKENS",
            "LOCUST_TEMPERATURE", "LOCUST_STREAM_RATIO", "LOCUST_SPEC_WINDOW"} <= names


def test_default_prompts_are_humaneval_0_to_99():
    prompts = workload.load_prompts()
    assert [name for name, _ in prompts] == [f"HumanEval/{n}" for n in range(100)]
    assert prompts[0][1].startswith("from typing import List")
    assert [name for name, _ in workload.load_prompts(humaneval="5-7")] == ["HumanEval/5", "HumanEval/6", "HumanEval/7"]
    with pytest.raises(ValueError):
        workload.humaneval_range("7-5")


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"id": "a", "prompt": "def a():\\n"}\n\n"plain string"\n{"text_input": "x"}\n')
    assert workload.load_prompts(str(jsonl)) == [("a", "def a():\n"), ("mine.jsonl:3", "plain string"),
                                                 ("mine.jsonl:4", "x")]
    listed = tmp_path / "mine.json"
    listed.write_text(json.dumps(["one", {"prompt": "two", "id": 2}]))
    assert workload.load_prompts(str(listed)) == [("mine.json:0", "one"), ("2", "two")]
    text = tmp_path / "mine.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert [p for _, p in workload.load_prompts(str(text))] == ["first prompt", "second prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 1 is neither"):
        workload.load_prompts(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        workload.load_prompts(str(empty))


def test_address_names_and_contract_checks():
    assert workload.grpc_url("127.0.0.1:8001") == "127.0.0.1:8001"
    assert workload.grpc_url("grpc://triton:8001/") == "triton:8001"
    with pytest.raises(ValueError):
        workload.grpc_url("")
    assert workload.request_name("spec", True) == "spec"
    assert workload.request_name("plain", False) == "plain, stream=false"
    fine = Timing(completion_tokens=8, draft_tokens=10, accepted_draft_tokens=6)
    workload.check_statistics(fine, 8, speculation=True)
    for timing, max_tokens, speculation, message in (
        (Timing(completion_tokens=9), 8, True, "9 tokens for max_tokens 8"),
        (Timing(completion_tokens=4, draft_tokens=3, accepted_draft_tokens=4), 8, True, "4 accepted of 3"),
        (Timing(completion_tokens=4, draft_tokens=3, accepted_draft_tokens=1), 8, False, "speculation_window 0"),
    ):
        with pytest.raises(RequestFailed, match=message) as failure:
            workload.check_statistics(timing, max_tokens, speculation=speculation)
        assert failure.value.kind == "bad statistics"


def test_timing_derives_ttft_and_per_token_itl():
    timing = Timing(latency=2.0, chunk_times=[0.5, 1.0, 2.0], completion_tokens=7)
    assert timing.ttft == 0.5
    assert timing.itl == pytest.approx(1.5 / 6)  # first to last chunk over the tokens after the first
    assert timing.tokens_per_second == 3.5
    assert Timing(chunk_times=[0.5], completion_tokens=1).itl is None
    assert Timing().ttft is None


# -------------------------------------------------------------- report ----


def _record(started, ended, mode="on", ok=True, ttft=0.1, tokens=10, drafted=8, accepted=6, error=""):
    return report.RequestRecord(started=started, ended=ended, mode=mode, stream=True, prompt="p", max_tokens=16,
                                temperature=0.0, ok=ok, error=error, ttft=ttft if ok else None,
                                itl=0.05 if ok else None, latency=ended - started, tokens=tokens if ok else 0,
                                draft_tokens=drafted if ok else 0, accepted_draft_tokens=accepted if ok else 0)


def test_summary_counts_each_request_where_it_belongs():
    phases = [report.Phase(0, 1, "on", 100.0, 110.0), report.Phase(1, 2, "on", 110.0, 120.0)]
    records = [
        _record(100.5, 104.5, ttft=0.2),  # phase 0, inside
        _record(104.5, 108.5, ttft=0.4),  # phase 0, inside
        _record(108.5, 112.5),  # straddles: throughput of phase 1, no latency anywhere
        _record(110.5, 114.5, ttft=1.0, tokens=20, drafted=10, accepted=5),  # phase 1
        _record(111.0, 111.5, ok=False, error="timeout"),  # phase 1 error
        _record(119.0, 125.0),  # ends after the run: nowhere but spanning
    ]
    first, second = report.summarize(records, phases)
    assert (first.users, first.speculation, first.requests, first.measured, first.spanning, first.errors) == (1, "on", 2, 2, 1, 0)
    assert first.requests_per_second == pytest.approx(0.2)
    assert first.tokens_per_second_total == pytest.approx(2.0)
    assert first.ttft_p50 == pytest.approx(0.3)
    assert first.acceptance == pytest.approx(12 / 16)
    assert first.tokens_per_second_per_stream == pytest.approx(2.5)
    assert (second.requests, second.measured, second.spanning, second.errors) == (2, 1, 1, 1)
    assert second.ttft_p50 == pytest.approx(1.0)
    assert second.acceptance == pytest.approx(0.5)
    table = report.markdown_table([first, second])
    assert table.splitlines()[0].startswith("| users | speculation | requests | requests/s | p50 TTFT s | p95 TTFT s")
    assert "| 1 | on | 2 | 0.200 | 0.30 |" in table
    assert "0.75 (12/16)" in table
    assert "2 request(s) straddled" in report.render_text([first, second])


def test_mixed_phases_split_by_mode_and_compare():
    phases = [report.Phase(0, 2, "mix", 0.0, 10.0)]
    records = [_record(0.5, 2.5), _record(0.5, 4.5, mode="off", drafted=0, accepted=0)]
    rows = report.summarize(records, phases)
    assert [(r.speculation, r.requests) for r in rows] == [("on", 1), ("off", 1)]
    assert rows[1].acceptance is None and "| – | 0 |" in report.markdown_table(rows)
    (line,) = report.comparison_lines(rows)
    assert line.startswith("2 user(s), speculation on / off: per-stream tokens/s 2.00x")


def test_report_files_round_trip(tmp_path, capsys):
    phases = [report.Phase(0, 1, "on", 0.0, 10.0), report.Phase(1, 1, "off", 11.0, 21.0)]
    records = [_record(1.0, 3.0), _record(3.0, 5.0, ok=False, error="rpc error"),
               _record(12.0, 15.0, mode="off", drafted=0, accepted=0)]
    prefix = str(tmp_path / "run" / "locust")
    text, written = report.write_reports(prefix, records, phases, title="test")
    names = {p.name for p in written}
    assert names == {"locust_specdec_requests.csv", "locust_specdec_phases.csv", "locust_specdec_summary.csv",
                     "locust_specdec_summary.md", "locust_specdec.png"}
    assert (tmp_path / "run" / "locust_specdec.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "run" / "locust_specdec_summary.csv") as source:
        rows = list(csv.DictReader(source))
    assert [(r["users"], r["speculation"], r["errors"]) for r in rows] == [("1", "on", "1"), ("1", "off", "0")]
    assert report.main([prefix]) == 0  # re-render from the CSVs: the same table
    assert capsys.readouterr().out.startswith(text)


# ------------------------------------------------- the gRPC stream itself ----


@pytest.fixture(scope="module")
def fake_server():
    server, servicer, port = fake_triton.serve(0, token_seconds=0.01, first_token_seconds=0.02)
    yield f"127.0.0.1:{port}"
    server.stop(grace=0)


def _client(url):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url)


def test_timed_completion_streams_and_reads_statistics(fake_server):
    with _client(fake_server) as client:
        timing = timed_completion(client, build_inputs("def f():", 12, stream=True), timeout=30)
        assert timing.completion_tokens == 12
        assert len(timing.chunk_times) == 2  # rounds of window + 1 = 6 tokens
        assert 0 < timing.ttft <= timing.latency
        assert timing.itl is not None and timing.itl > 0
        assert (timing.draft_tokens, timing.accepted_draft_tokens) == (10, 10)
        plain = timed_completion(client, build_inputs("def f():", 5, speculation_window=0, stream=True), timeout=30)
        assert (plain.completion_tokens, len(plain.chunk_times), plain.draft_tokens) == (5, 5, 0)
        whole = timed_completion(client, build_inputs("def f():", 12, stream=False), timeout=30)
        assert len(whole.chunk_times) == 1 and whole.text.count("tok") == 12


@pytest.mark.parametrize("marker, kind", [
    ("#fake:error", "error response"),
    ("#fake:nofinal", "stream ended"),
    ("#fake:hang", "timeout"),
    ("#fake:abort", "rpc error"),
    ("#fake:busy", "server busy"),
])
def test_timed_completion_names_each_failure(fake_server, marker, kind):
    with _client(fake_server) as client:
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failure:
            timed_completion(client, build_inputs(f"x {marker}", 16, stream=True), timeout=2)
        assert failure.value.kind == kind, failure.value
        assert time.monotonic() - started < 10
        # The stream was closed: the same client serves the next request.
        assert timed_completion(client, build_inputs("ok", 4, stream=True), timeout=30).completion_tokens == 4


# ------------------------------------------------------ locust, whole runs ----


def _locust(args, cwd, timeout=120, env=None):
    return subprocess.run([str(LOCUST), "-f", str(LOCUSTFILE), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def _stats(prefix: Path) -> dict[tuple[str, str], dict]:
    with open(f"{prefix}_stats.csv") as source:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(source) if row["Type"]}


def test_locust_step_ramp_against_the_fake_server(fake_server, tmp_path):
    prefix = tmp_path / "locust"
    proc = _locust(["--headless", "--only-summary", "--host", fake_server, "--steps", "1,2", "--modes", "on,off",
                    "--step-seconds", "2", "--max-tokens", "8,16", "--stream-ratio", "0.8",
                    "--csv", str(prefix), "--html", str(tmp_path / "locust.html")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    stats = _stats(prefix)
    assert REQUEST_NAMES <= set(stats), sorted(stats)
    assert all(int(row["Failure Count"]) == 0 for row in stats.values())
    assert (tmp_path / "locust.html").stat().st_size > 10_000
    with open(f"{prefix}_specdec_summary.csv") as source:
        rows = list(csv.DictReader(source))
    assert [(r["users"], r["speculation"]) for r in rows] == [("1", "on"), ("1", "off"), ("2", "on"), ("2", "off")]
    assert all(int(r["requests"]) > 0 and r["errors"] == "0" for r in rows)
    assert float(rows[0]["acceptance"]) == 1.0 and rows[1]["acceptance"] == ""
    # The fake answers a speculative request in rounds of 6 tokens: several times faster.
    assert float(rows[0]["tokens_per_second_per_stream"]) > 2 * float(rows[1]["tokens_per_second_per_stream"])
    with open(f"{prefix}_specdec_requests.csv") as source:
        requests = list(csv.DictReader(source))
    completions = sum(int(stats[("completion", n)]["Request Count"]) for n in ("spec", "plain", "spec, stream=false",
                                                                               "plain, stream=false") if ("completion", n) in stats)
    assert len(requests) == completions
    assert {r["mode"] for r in requests} == {"on", "off"}
    assert "| users | speculation | requests | requests/s | p50 TTFT s" in output
    assert Path(f"{prefix}_specdec.png").exists()


def test_locust_counts_every_failure(fake_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": m, "prompt": f"x #fake:{m}"}) for m in
                                 ("error", "nofinal", "hang", "abort")) + "\n" + json.dumps({"prompt": "fine"}) + "\n")
    prefix = tmp_path / "locust"
    proc = _locust(["--headless", "--only-summary", "--host", fake_server, "--steps", "2", "--modes", "mix",
                    "--step-seconds", "5", "--max-tokens", "8", "--request-timeout", "1",
                    "--prompts-file", str(prompts), "--csv", str(prefix)], tmp_path)
    assert proc.returncode == 1, "a run with failures must exit non-zero"
    with open(f"{prefix}_failures.csv") as source:
        errors = " ".join(row["Error"] for row in csv.DictReader(source))
    for kind in ("error response", "stream ended", "timeout", "rpc error"):
        assert kind in errors, errors
    with open(f"{prefix}_specdec_requests.csv") as source:
        requests = list(csv.DictReader(source))
    failed = {r["prompt"]: r["error"] for r in requests if r["ok"] == "False"}
    assert failed == {"error": "error response", "nofinal": "stream ended", "hang": "timeout", "abort": "rpc error"}
    assert {r["prompt"] for r in requests if r["ok"] == "True"} == {"prompts.jsonl:5"}  # its line


def test_a_run_without_a_finished_request_fails_unless_requests_may_finish(fake_server, tmp_path):
    prompts = tmp_path / "slow.jsonl"
    prompts.write_text(json.dumps({"id": "slow", "prompt": "x #fake:slow"}) + "\n")
    common = ["--headless", "--only-summary", "--host", fake_server, "--steps", "1", "--modes", "on",
              "--step-seconds", "1", "--max-tokens", "4", "--prompts-file", str(prompts)]
    cut = _locust([*common, "--csv", str(tmp_path / "cut")], tmp_path)
    assert cut.returncode == 1, "zero requests is no result"
    assert "no request finished" in cut.stderr
    assert "no request started and ended within 1 user(s)/on" in cut.stdout
    waited = _locust([*common, "--stop-timeout", "20", "--csv", str(tmp_path / "waited")], tmp_path)
    assert waited.returncode == 0, (waited.stdout + waited.stderr)[-3000:]
    with open(tmp_path / "waited_specdec_summary.csv") as source:
        (row,) = list(csv.DictReader(source))
    assert (row["requests"], row["measured"], row["spanning"]) == ("1", "1", "0")


def test_phases_never_overlap(fake_server, tmp_path):
    """With --stop-timeout the users of a phase finish their requests before
    the next phase's users start: no request of one mode runs under the other's load."""
    prompts = tmp_path / "slow.jsonl"
    prompts.write_text(json.dumps({"id": "slow", "prompt": "x #fake:slow"}) + "\n")
    prefix = tmp_path / "locust"
    proc = _locust(["--headless", "--only-summary", "--host", fake_server, "--steps", "1", "--modes", "on,off",
                    "--step-seconds", "1", "--max-tokens", "4", "--prompts-file", str(prompts),
                    "--adaptive-window", "false", "--stop-timeout", "20", "--csv", str(prefix)], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    with open(f"{prefix}_specdec_requests.csv") as source:
        requests = {r["mode"]: r for r in csv.DictReader(source)}
    with open(f"{prefix}_specdec_phases.csv") as source:
        phases = list(csv.DictReader(source))
    assert [p["mode"] for p in phases] == ["on", "off"]
    spec, plain = requests["on"], requests["off"]
    assert float(spec["ended"]) <= float(phases[1]["start"]) <= float(plain["started"])
    with open(f"{prefix}_specdec_summary.csv") as source:
        rows = {r["speculation"]: r for r in csv.DictReader(source)}
    # The speculative request outlived its 1 s phase: throughput of nobody, latency of nobody.
    assert (rows["on"]["measured"], rows["on"]["spanning"]) == ("0", "1")
    assert rows["off"]["measured"] == "1"  # the last phase lasts until its users stopped


def test_web_ui_mode_as_in_kubernetes(fake_server, tmp_path):
    """k8s/loadtest runs the master with --autostart --autoquit (web UI, not headless):
    the run starts by itself, /specdec serves the table, the reports are written."""
    import urllib.request

    port = free_port()
    prefix = tmp_path / "locust"
    process = subprocess.Popen(
        [str(LOCUST), "-f", str(LOCUSTFILE), "--autostart", "--autoquit", "5", "--web-host", "127.0.0.1",
         "--web-port", str(port), "--host", fake_server, "--steps", "1", "--modes", "on", "--step-seconds", "2",
         "--max-tokens", "4", "--csv", str(prefix)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        table = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "| 1 | on |" not in table:
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/specdec", timeout=5) as response:
                    table = response.read().decode()
            except OSError:
                continue
        assert "| 1 | on |" in table, table
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    with open(f"{prefix}_specdec_summary.csv") as source:
        (row,) = list(csv.DictReader(source))
    assert int(row["requests"]) > 0 and row["errors"] == "0"
    assert output.count("specdec load test:") == 1, "the report is written once per run"


def test_locust_master_and_worker(fake_server, tmp_path):
    """The distributed mode of k8s/loadtest: records travel from the worker to the master."""
    port = free_port()
    worker = subprocess.Popen([str(LOCUST), "-f", str(LOCUSTFILE), "--worker", "--master-port", str(port)],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL)
    try:
        prefix = tmp_path / "locust"
        proc = _locust(["--master", "--master-bind-port", str(port), "--expect-workers", "1",
                        "--expect-workers-max-wait", "60", "--headless", "--only-summary"],
                       tmp_path, env={"LOCUST_HOST": fake_server, "LOCUST_STEPS": "2", "LOCUST_MODES": "on,off",
                                      "LOCUST_STEP_SECONDS": "2", "LOCUST_MAX_TOKENS": "8",
                                      "LOCUST_CSV": str(prefix)})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        worker.wait(timeout=30)  # the master's quit ends the worker
    finally:
        if worker.poll() is None:
            worker.kill()
    stats = _stats(prefix)
    with open(f"{prefix}_specdec_requests.csv") as source:
        requests = list(csv.DictReader(source))
    assert len(requests) == sum(int(stats[("completion", n)]["Request Count"]) for n in ("spec", "plain")) > 0
    assert {r["worker"] for r in requests} == {"0"}


def test_locust_refuses_to_start_without_a_server(tmp_path):
    proc = _locust(["--headless", "--host", f"127.0.0.1:{free_port()}", "--steps", "1", "--step-seconds", "1"],
                   tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "no Triton server answers" in proc.stderr


def test_locust_refuses_bad_options(fake_server, tmp_path):
    proc = _locust(["--headless", "--host", fake_server, "--modes", "sideways"], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "--modes takes on, off and mix" in proc.stderr


def test_requests_carry_the_api_key_from_the_environment(monkeypatch):
    from coordinator.request.access import GRPC_API_KEY_HEADER

    key = "the-api-key-0123456789"
    server, _, port = fake_triton.serve(0, token_seconds=0.0, first_token_seconds=0.0, api_key=key)
    try:
        with _client(f"127.0.0.1:{port}") as client:
            monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
            with pytest.raises(RequestFailed, match="expecting header 'triton-grpc-protocol-specdec-api-key'"):
                timed_completion(client, build_inputs("x", 2, stream=True), timeout=10)
            monkeypatch.setenv("SPECDEC_API_KEY", key)
            assert timed_completion(client, build_inputs("x", 2, stream=True), timeout=10).completion_tokens == 2
            with pytest.raises(RequestFailed, match="expecting header"):  # explicit headers win over the environment
                stream_completion(client, build_inputs("x", 2), timeout=10, headers={GRPC_API_KEY_HEADER: "wrong"})
            assert stream_completion(client, build_inputs("x", 2), timeout=10).completion_tokens == 2
    finally:
        server.stop(grace=0)
