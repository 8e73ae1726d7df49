"""docker/gpu-smoke.sh and tools/gpu_smoke.py, offline.

The smoke test runs on a GPU host; here its ``--dry-run`` runs on fake
Hugging Face checkpoints (a config.json each, as in
test_engine_build_script.py) with no Docker and no GPU: it must check its
arguments, run build_engines.sh --dry-run for real, print every docker
command with the pods' security context, and write a report that lists
every step. The Python checks' arithmetic is tested directly, and the engine
check (step 4) runs against a fake engine that follows TensorRT-LLM's
semantics as trtllm_emulation/ models them."""

from __future__ import annotations

import io
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_engine_build_script import BASH, HEADS, fake_bin, write_checkpoint
from tools import gpu_smoke
from tools.gpu_smoke import (DRAFTING, ERROR, PLAIN, EngineReply, Process, agreement, chi2_sf,
                             distribution_check, first_difference, parse_compute_apps, parse_process_table,
                             percentile, pick_draft_worker, recovery_timeline)
from trtllm_emulation.calls import generate, verify
from trtllm_emulation.requests import read_request

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "gpu-smoke.sh"
STEPS = ("1", "2a", "2b", "3", "4", "5", "6", "7a", "7b", "8", "9")
SECURITY = (("--user", "10001:10001"), ("--read-only",), ("--cap-drop", "ALL"),
            ("--security-opt", "no-new-privileges"))


@pytest.fixture
def checkpoints(tmp_path):
    for role, (heads, kv_heads) in HEADS.items():
        write_checkpoint(tmp_path / f"{role}-hf", heads, kv_heads)
    return tmp_path


def smoke(tmp_path: Path, *extra: str, checkpoints: bool = True) -> subprocess.CompletedProcess:
    """docker/gpu-smoke.sh --dry-run with a PATH whose docker and nvidia-smi
    must never run (they leave a mark) and whose python3 is this interpreter
    (build_engines.sh --dry-run reads config.json with it)."""
    assert BASH, "bash is needed to run docker/gpu-smoke.sh"
    bin_dir = fake_bin(tmp_path)
    for tool in ("docker", "nvidia-smi"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> {shlex.quote(str(tmp_path / 'ran'))}\nexit 99\n")
        (bin_dir / tool).chmod(0o755)
    command = [BASH, str(SCRIPT), "--dry-run", "--work-dir", str(tmp_path / "work"),
               "--report", str(tmp_path / "report.md")]
    if checkpoints:
        command += ["--target-hf", str(tmp_path / "target-hf"), "--draft-hf", str(tmp_path / "draft-hf")]
    return subprocess.run(command + list(extra), capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, cwd=tmp_path)


def printed(result: subprocess.CompletedProcess) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def docker_runs(result: subprocess.CompletedProcess) -> list[list[str]]:
    return [words for words in printed(result) if words[:2] == ["docker", "run"]]


def has(words: list[str], *option: str) -> bool:
    return any(words[i:i + len(option)] == list(option) for i in range(len(words)))


def named(runs: list[list[str]], suffix: str) -> list[str]:
    [run] = [w for w in runs if w[w.index("--name") + 1].endswith(suffix)]
    return run


# ------------------------------------------------------------------ dry run ----

def test_dry_run_plans_every_step_and_writes_a_skeleton_report(checkpoints):
    result = smoke(checkpoints)
    assert result.returncode == 0, result.stderr
    assert not (checkpoints / "ran").exists(), "the dry run called docker or nvidia-smi"
    report = (checkpoints / "report.md").read_text()
    headings = re.findall(r"^## (\d+[ab]?)\. (.+): (.+)$", report, re.MULTILINE)
    assert [h[0] for h in headings] == list(STEPS)
    assert {int(re.match(r"\d+", h[0]).group()) for h in headings} == set(range(1, 10))
    assert {h[2] for h in headings} == {"not run (dry run)"}
    rows = re.findall(r"^\| (\d+[ab]?) \| [^|]+ \| ([^|]+) \|", report, re.MULTILINE)
    assert [r[0] for r in rows] == list(STEPS) and {r[1] for r in rows} == {"not run (dry run)"}
    for step in STEPS:  # every step announced with its elapsed time
        assert re.search(rf"^\[\d\d:\d\d\] step {step}: ", result.stderr, re.MULTILINE), step


def test_every_container_runs_with_the_pods_security_context(checkpoints):
    result = smoke(checkpoints)
    assert result.returncode == 0, result.stderr
    runs = docker_runs(result)
    assert len(runs) >= 12  # environment, two builds, server, checks 4-9
    for words in runs:
        for option in SECURITY:
            assert has(words, *option), f"{option} missing from: {shlex.join(words)}"
        assert has(words, "--pull", "never")


def test_the_server_starts_as_kubernetes_starts_it(checkpoints):
    runs = docker_runs(smoke(checkpoints))
    server = named(runs, "-server")
    assert has(server, "-d") and has(server, "--restart", "on-failure:2")
    tmpfs = server[server.index("--tmpfs") + 1]
    assert tmpfs.startswith("/tmp:") and "exec" in tmpfs.split(",")
    assert has(server, "--shm-size", "8g") and has(server, "--memory", "48g")
    [engines] = [server[i + 1] for i, w in enumerate(server) if w == "-v"]
    assert re.fullmatch(rf"{checkpoints}/work/run-[0-9-]+/engines-bf16:/opt/specdec/engines:ro", engines)
    published = [server[i + 1] for i, w in enumerate(server) if w == "-p"]
    assert len(published) == 5 and all(p.startswith("127.0.0.1:") for p in published)
    # the keys reach the container through its environment, never on a command line
    assert has(server, "-e", "SPECDEC_API_KEY") and has(server, "-e", "SPECDEC_ADMIN_KEY")
    assert not [w for w in server if w.startswith("SPECDEC_API_KEY=") or w.startswith("SPECDEC_ADMIN_KEY=")]
    assert "--entrypoint" not in server  # the image's own entrypoint
    assert server[-3:] == ["--exit-timeout-secs=300", "--backend-config=python,shm-default-byte-size=16777216",
                           "--backend-config=python,shm-growth-byte-size=16777216"]


def test_the_engines_are_built_in_the_image_and_checked_by_the_build_scripts_dry_run(checkpoints):
    result = smoke(checkpoints)
    runs = docker_runs(result)
    for dtype in ("bfloat16", "fp8"):
        build = named(runs, f"-build-{dtype}")
        assert build[build.index("--entrypoint") + 1] == "/opt/nvidia/nvidia_entrypoint.sh"
        assert build[build.index("--entrypoint") + 3] == "/opt/specdec/docker/build_engines.sh"
        assert build[build.index("--dtype") + 1] == dtype
        assert "/checkpoints/target:ro" in " ".join(build) and "/checkpoints/draft:ro" in " ".join(build)
    fp8 = named(runs, "-build-fp8")
    assert fp8[fp8.index("--calib-dataset") + 1] == "/calibration"
    # build_engines.sh --dry-run ran for real on the host: its trtllm-build commands are printed
    builds = [w for w in printed(result) if w[0] == "trtllm-build"]
    outputs = sorted("/".join(Path(w[w.index("--output_dir") + 1]).parts[-2:]) for w in builds)
    assert outputs == ["engines-bf16/draft", "engines-bf16/target", "engines-fp8/draft", "engines-fp8/target"]
    quantize = [w for w in printed(result) if w[0] == "python3" and w[1].endswith("quantization/quantize.py")]
    assert len(quantize) == 2 and all(w[w.index("--calib_dataset") + 1].endswith("/calibration") for w in quantize)


def test_skip_fp8_builds_bfloat16_only(checkpoints):
    result = smoke(checkpoints, "--skip-fp8")
    assert result.returncode == 0, result.stderr
    assert not [w for w in docker_runs(result) if "fp8" in w[w.index("--name") + 1]]
    assert not [w for w in printed(result) if w[0] == "python3" and w[1].endswith("quantize.py")]
    assert "would be skipped: --skip-fp8" in (checkpoints / "report.md").read_text()


def test_the_checks_run_from_the_repository_in_client_containers(checkpoints):
    runs = docker_runs(smoke(checkpoints))
    checks = {}
    for words in runs:
        if f"{ROOT}/tools/gpu_smoke.py:/opt/specdec/smoke/gpu_smoke.py:ro" in words:
            assert has(words, "--network", "host") and has(words, "--rm")
            if "/opt/specdec/smoke/gpu_smoke.py" in words:  # its check follows the file
                checks[words[words.index("/opt/specdec/smoke/gpu_smoke.py") + 1]] = words
    assert {"engine-calls", "agreement", "distribution", "nvidia-client", "concurrency", "drafting",
            "pick-worker", "recovery"} <= set(checks)
    assert has(checks["pick-worker"], "-i")  # reads the process table on stdin
    openai = named(runs, "-step-7a")
    requirement = re.search(r"^openai==(\S+)", (ROOT / "requirements" / "test.txt").read_text(), re.MULTILINE)
    assert requirement.group(1) in openai


def test_the_kill_finds_the_worker_and_runs_in_the_container(checkpoints):
    words = printed(smoke(checkpoints))
    assert ["docker", "top"] == next(w for w in words if w[:2] == ["docker", "top"])[:2]
    kill = next(w for w in words if w[:2] == ["docker", "exec"] and "kill -9" in " ".join(w))
    assert has(kill, "--user", "10001:10001")


@pytest.mark.parametrize(("args", "message"), [
    (("--timeout-minutes", "abc"), "--timeout-minutes"),
    (("--timeout-minutes", "2"), "--timeout-minutes"),
    (("--gpus", "everything"), "--gpus"),
    (("--gpus",), "--gpus needs a value"),
    (("--port-base", "80"), "--port-base"),
    (("--image", "not an image"), "--image"),
    (("--calib-dataset", "/nonexistent/calibration"), "--calib-dataset"),
    (("--nvidia-client", "/nonexistent/client.py"), "--nvidia-client"),
    (("--bogus",), "unknown option: --bogus"),
])
def test_bad_options_are_refused_by_name(checkpoints, args, message):
    result = smoke(checkpoints, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (checkpoints / "report.md").exists()


def test_a_directory_without_config_json_is_refused(checkpoints):
    (checkpoints / "empty").mkdir()
    result = smoke(checkpoints, "--draft-hf", str(checkpoints / "empty"))
    assert result.returncode == 2
    assert "--draft-hf" in result.stderr and "config.json" in result.stderr


def test_without_checkpoints_the_default_is_named(tmp_path):
    result = smoke(tmp_path, checkpoints=False)
    if Path("/srv/models/Qwen2.5-Coder-0.5B-Instruct/config.json").exists():
        pytest.skip("the default checkpoint is on this machine")
    assert result.returncode == 2
    assert "--target-hf" in result.stderr and "Qwen2.5-Coder-0.5B-Instruct" in result.stderr


def test_a_build_the_build_script_refuses_fails_the_dry_run(checkpoints):
    write_checkpoint(checkpoints / "draft-hf", 0, 0)  # head counts build_engines.sh cannot use
    result = smoke(checkpoints)
    assert result.returncode == 1
    assert "build_engines.sh --dry-run refused" in result.stderr


# --------------------------------------------------------- pure functions ----

@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([5], [6], 0),
    ([1, 2], [1, 2, 3], 2),
    ([], [], None),
    ("abc", "abd", 2),
])
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_agreement_share_and_first_differences():
    result = agreement([([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 2, 4]), ([7], [7]), ([1, 2], [3, 2])])
    assert (result.identical, result.total, result.share) == (2, 4, 0.5)
    assert result.first_differences == [None, 2, None, 0]
    assert agreement([]).share == 0.0


def test_chi2_survival_function_matches_tables():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(20.515, 5) == pytest.approx(0.001, rel=1e-3)
    for x in (0.5, 3.0, 12.0, 80.0):  # closed forms for 2 and 4 degrees of freedom
        assert chi2_sf(x, 2) == pytest.approx(np.exp(-x / 2), rel=1e-9)
        assert chi2_sf(x, 4) == pytest.approx(np.exp(-x / 2) * (1 + x / 2), rel=1e-9)
    assert chi2_sf(0.0, 3) == 1.0


def sample(rng: random.Random, weights: list[float], n: int = 200) -> list[str]:
    return rng.choices("abcdefghij"[:len(weights)], weights=weights, k=n)


def test_distribution_check_accepts_equal_distributions():
    weights = [30, 20, 15, 10, 8, 6, 5, 3, 2, 1]
    for seed in range(5):
        rng = random.Random(seed)
        result = distribution_check(sample(rng, weights), sample(rng, weights))
        assert result.passed, result.describe()
        assert result.alpha == 0.001


def test_distribution_check_rejects_a_clearly_different_one():
    rng = random.Random(0)
    target = sample(rng, [30, 20, 15, 10, 8, 6, 5, 3, 2, 1])
    other = sample(rng, [1, 2, 3, 5, 6, 8, 10, 15, 20, 30])  # the draft's distribution, say
    result = distribution_check(target, other)
    assert not result.passed and result.p_value < 1e-6
    assert result.total_variation > 0.4
    assert "DIFFERENT" in result.describe()


def test_distribution_check_pools_rare_categories_and_handles_one_category():
    rare = distribution_check(["a"] * 195 + list("vwxyz"), ["a"] * 196 + list("qrst"))
    assert rare.categories == 2 and rare.passed  # v..z and q..t pooled into one
    same = distribution_check(["a"] * 10, ["a"] * 10)
    assert (same.p_value, same.dof, same.passed) == (1.0, 0, True)


def test_percentile_interpolates_between_ranks():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(np.percentile(values, 50))
    assert percentile(values, 99) == pytest.approx(np.percentile(values, 99))
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


DOCKER_TOP = """PID                 COMMAND
4101                bash /opt/specdec/docker/trtllm-entrypoint.sh --exit-timeout-secs=300
4150                mpirun --allow-run-as-root -n 1 tritonserver --model-repository=/opt/specdec/model_repository
4160                tritonserver --model-repository=/opt/specdec/model_repository --model-config-name=trtllm
4201                /opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker
4202                /opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker
4300                /opt/tritonserver/backends/python/triton_python_backend_stub /opt/specdec/model_repository/coordinator/1/model.py
"""
COMPUTE_APPS = "4160, 402\n4201, 48113\n4202, 20011\n"


def test_the_draft_worker_is_the_one_holding_less_gpu_memory():
    processes = parse_process_table(DOCKER_TOP)
    assert [p.pid for p in processes] == [4101, 4150, 4160, 4201, 4202, 4300]
    memory = parse_compute_apps(COMPUTE_APPS)
    assert memory == {4160: 402, 4201: 48113, 4202: 20011}
    worker, reason = pick_draft_worker(processes, memory)
    assert worker.pid == 4202 and "20011 MiB" in reason


@pytest.mark.parametrize(("processes", "memory", "message"), [
    ([Process(1, "tritonserver")], {}, "no trtllmExecutorWorker"),
    ([Process(2, "/x/trtllmExecutorWorker")], {2: 100}, "expected two"),
    ([Process(2, "/x/trtllmExecutorWorker"), Process(3, "/x/trtllmExecutorWorker")], {2: 100}, "no GPU memory"),
    ([Process(2, "/x/trtllmExecutorWorker"), Process(3, "/x/trtllmExecutorWorker")], {2: 5, 3: 5}, "cannot tell"),
])
def test_an_undecidable_process_table_names_no_worker(processes, memory, message):
    worker, reason = pick_draft_worker(processes, memory)
    assert worker is None and message in reason


def test_pick_worker_reads_both_tables_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"=== docker top\n{DOCKER_TOP}=== nvidia-smi\n{COMPUTE_APPS}"))
    assert gpu_smoke.main(["pick-worker"]) == gpu_smoke.PASS
    assert "DRAFT_WORKER_PID=4202" in capsys.readouterr().out


@pytest.mark.parametrize(("events", "interrupted", "recovered", "words"), [
    ([(1.0, ERROR), (2.5, PLAIN), (30.0, DRAFTING)], 1.0, 30.0, "came back 30.0 s"),
    ([(0.5, DRAFTING), (2.0, ERROR), (9.0, DRAFTING)], 2.0, 9.0, "came back"),
    ([(1.0, ERROR), (200.0, PLAIN)], 1.0, None, "did not come back"),
    ([(1.0, DRAFTING), (30.0, DRAFTING), (61.0, DRAFTING)], None, None, "never stopped"),
    ([], None, None, "no request completed"),
])
def test_recovery_timeline(events, interrupted, recovered, words):
    outcome = recovery_timeline(events, interrupt_within=60)
    assert (outcome.interrupted_at, outcome.recovered_at) == (interrupted, recovered)
    assert outcome.passed == (recovered is not None)
    assert words in outcome.verdict


def test_markdown_table_escapes_cells():
    table = gpu_smoke.markdown_table(("a", "b"), [("x|y", 0.123456), ("line\nbreak", 3)])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 0.123 |", "| line\\nbreak | 3 |"]


def test_importing_the_checks_pulls_in_no_client_library():
    code = ("import sys, tools.gpu_smoke; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tritonclient', 'numpy', 'tokenizers', 'openai', 'coordinator')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


# ------------------------------------------- step 4 against a fake engine ----

VOCAB = 64
EOS = VOCAB - 1


class FakeTokens:
    """Character codes as tokens (the fake engine's vocabulary)."""

    special = gpu_smoke.Special([EOS], EOS)
    vocab_size = VOCAB

    def __init__(self, directory: str):
        pass

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 48 for c in text]

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def next_token_logits(token: int) -> np.ndarray:
    """A toy model: after token t comes (t + 1) mod 48, never the end token."""
    row = np.full(VOCAB, -5.0, dtype=np.float32)
    row[(int(token) + 1) % 48] = 5.0
    return row


def fake_engine(returns_end_token: bool = False):
    """call_engine as a tensorrtllm model answers (trtllm_emulation's semantics):
    greedy generation or verification of external draft tokens, one response
    per token when streaming."""

    def call(url, model, arrays, timeout=60.0):
        request = read_request(arrays.get)
        ids = [int(t) for t in request.input_ids]
        if request.draft_tokens is not None:
            drafts = [int(t) for t in request.draft_tokens]
            rows = np.stack([next_token_logits(t) for t in [ids[-1]] + drafts])
            result = verify(rows, drafts, None, request.max_new_tokens, request.sampling, request.end_id)
        else:
            result = generate(next_token_logits, ids[-1], request.max_new_tokens, request.sampling,
                              request.end_id, ids)
        tokens = list(result.tokens)
        if returns_end_token and request.end_id is not None and len(tokens) < request.max_new_tokens:
            tokens.append(request.end_id)
        logits = [np.asarray(r) for r in result.logits] + [next_token_logits(0)] * (len(tokens) - len(result.logits))
        streaming = bool(arrays["streaming"].item())
        groups = [[i] for i in range(len(tokens))] if streaming else [list(range(len(tokens)))]
        replies = []
        for group in groups:
            reply = EngineReply((1, 1, max(len(group), 1)), (1, 1), [tokens[i] for i in group])
            if request.return_logits:
                reply.logits_shape = (1, 1, len(group), VOCAB)
                reply.logits_argmax = [int(np.argmax(logits[i])) for i in group]
            replies.append(reply)
        return replies

    return call


def engine_check(monkeypatch, capsys, engine) -> tuple[int, str]:
    monkeypatch.setattr(gpu_smoke, "Tokens", FakeTokens)
    monkeypatch.setattr(gpu_smoke, "call_engine", engine)
    code = gpu_smoke.main(["engine-calls", "--grpc", "fake:8001"])
    return code, capsys.readouterr().out


def test_engine_calls_pass_against_an_engine_with_tensorrt_llms_semantics(monkeypatch, capsys):
    code, out = engine_check(monkeypatch, capsys, fake_engine())
    assert code == gpu_smoke.PASS, out
    assert "FAILED" not in out
    for check in ("target, streamed: same tokens", "end_id stops generation", "generation_logits: shape",
                  "draft verification: correct draft", "draft verification: wrong draft", "draft engine"):
        assert check in out


def test_engine_calls_fail_when_the_end_token_is_returned(monkeypatch, capsys):
    code, out = engine_check(monkeypatch, capsys, fake_engine(returns_end_token=True))
    assert code == gpu_smoke.FAIL
    assert re.search(r"\| end_id stops generation \| FAILED \|", out)


def test_engine_calls_fail_when_the_engine_cannot_be_reached(monkeypatch, capsys):
    def unreachable(*_args, **_kwargs):
        raise ConnectionError("connection refused")

    code, out = engine_check(monkeypatch, capsys, unreachable)
    assert code == gpu_smoke.FAIL and "connection refused" in out


# ------------------------------------ steps 5 and 9 against a fake coordinator ----

def fake_coordinator(diverging: tuple[str, ...] = (), drafts: bool = True):
    """coordinator_request: a greedy text per prompt; the speculative arm drafts
    with the draft model (unless ``drafts`` is false) and departs from the plain
    text on the prompts in ``diverging``."""
    from tools.client import Completion

    def request(url, prompt, max_tokens, timeout=120.0, **options):
        completion = Completion(text=prompt[::-1], completion_tokens=len(prompt))
        if options.get("speculation_window") != 0:
            if prompt in diverging:
                completion.text = completion.text[:3] + "#"
            if drafts and options.get("drafter") == "draft_model" and options.get("adaptive_window") is False:
                completion.draft_tokens, completion.accepted_draft_tokens = 8, 6
        return completion

    return request


@pytest.mark.parametrize(("diverging", "drafts", "expected"), [
    ((), True, gpu_smoke.PASS),
    (gpu_smoke.PROMPTS[:4], True, gpu_smoke.PASS),  # 12 of 16 identical: the threshold
    (gpu_smoke.PROMPTS[:5], True, gpu_smoke.FAIL),
    ((), False, gpu_smoke.FAIL),  # nothing drafted: speculation was not exercised
])
def test_agreement_check(monkeypatch, capsys, diverging, drafts, expected):
    monkeypatch.setattr(gpu_smoke, "Tokens", FakeTokens)
    monkeypatch.setattr(gpu_smoke, "coordinator_request", fake_coordinator(diverging, drafts))
    assert gpu_smoke.main(["agreement"]) == expected
    out = capsys.readouterr().out
    assert f"identical: {16 - len(diverging)} of 16" in out


def test_recovery_check_reports_the_time_until_drafting_is_back(monkeypatch, capsys):
    import time

    states = iter([(ERROR, "the draft died"), (PLAIN, "target alone"), (DRAFTING, "8 drafted")])
    monkeypatch.setattr(gpu_smoke, "drafting_state", lambda url, timeout: next(states))
    code = gpu_smoke.main(["recovery", "--killed-at", str(time.time()), "--interval", "0"])
    out = capsys.readouterr().out
    assert code == gpu_smoke.PASS
    assert re.search(r"^RECOVERY_SECONDS=\d+\.\d$", out, re.MULTILINE)


def test_recovery_check_fails_when_drafting_never_stops(monkeypatch, capsys):
    import time

    monkeypatch.setattr(gpu_smoke, "drafting_state", lambda url, timeout: (DRAFTING, "8 drafted"))
    code = gpu_smoke.main(["recovery", "--killed-at", str(time.time() - 61), "--interval", "0"])
    assert code == gpu_smoke.FAIL
    assert "never stopped" in capsys.readouterr().out


# ------------------------------- the real path, against a fake docker ----

FAKE_DOCKER = r'''
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_CALLS"], "a") as calls:
    calls.write(json.dumps(args) + "\n")
fail = os.environ.get("FAKE_DOCKER_FAIL", "")


def value(option):
    return args[args.index(option) + 1] if option in args else ""


command = args[0]
if command == "version":
    print("docker client 27.0.0, server 27.0.0")
elif command == "info":
    print("runtimes: nvidia runc ; default runc")
elif command == "image":
    print("sha256:0123456789abcdef0123")
elif command == "inspect":
    print("running 0")
elif command == "top":
    print("PID COMMAND")
    print("1 /opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker")
    print("2 /opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker")
elif command == "logs":
    print("specdec-watchdog: draft is back")
elif command in ("exec", "rm"):
    pass
elif command == "run":
    name = value("--name")
    if "-d" in args:
        print("0123456789abcdef")
    elif name.endswith("-environment"):
        assert sys.stdin.read().strip(), "the probe comes on stdin"
        print("smoke: compute_cap=" + os.environ.get("FAKE_COMPUTE_CAP", "9.0"))
        print("smoke: gpu=NVIDIA H100 80GB HBM3")
        print("smoke: driver=560.35.03")
        print("smoke: cuda_driver=12.6")
        print("smoke: cuda_image=12.8.0.038")
        print("smoke: package tensorrt_llm=0.17.0")
    elif "-build-" in name:
        if os.environ.get("FAKE_DOCKER_HANG"):
            import time
            print("converting the target", flush=True)
            time.sleep(60)
        mounts = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
        output = Path(next(m for m in mounts if m.endswith(":/opt/specdec/engines")).split(":")[0])
        for file in ("target/config.json", "draft/config.json", "tokenizer/tokenizer.json",
                     "tokenizer/special_tokens.json", "build-info.json"):
            (output / file).parent.mkdir(parents=True, exist_ok=True)
            (output / file).write_text("{}")
        print("build_engines: done")
    else:
        check = args[args.index("/opt/specdec/smoke/gpu_smoke.py") + 1] if "/opt/specdec/smoke/gpu_smoke.py" in args \
            else "openai"
        if fail and fail == check:
            print(f"| {check} | FAILED | the fake failed it |")
            sys.exit(1)
        if check == "pick-worker":
            tables = sys.stdin.read()
            assert "=== docker top" in tables and "=== nvidia-smi" in tables, tables
            print("DRAFT_WORKER_PID=1")
        elif check == "recovery":
            print("RECOVERY: drafting stopped 1.0 s after the kill and came back 12.5 s after it")
            print("RECOVERY_SECONDS=12.5")
        elif check == "nvidia-client" and os.environ.get("FAKE_NO_NVIDIA_CLIENT"):
            print("NVIDIA's end_to_end_grpc_client.py is not in the image")
            sys.exit(77)
        print(f"{check}: ok")
else:
    sys.exit(f"fake docker: unexpected command {args}")
'''


def fake_tools(tmp_path: Path, environment: dict[str, str]) -> dict[str, str]:
    """A PATH whose docker and nvidia-smi answer as the real ones would when
    everything works; the environment to run docker/gpu-smoke.sh in."""
    bin_dir = fake_bin(tmp_path)
    (bin_dir / "docker").write_text(f"#!{sys.executable}\n{FAKE_DOCKER}")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\ncase \"$*\" in *compute-apps*) echo '1, 30000'; echo '2, 9000' ;; "
                                        "*) echo 'NVIDIA-SMI 560.35.03' ;; esac\n")
    for tool in ("docker", "nvidia-smi"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DOCKER_CALLS": str(tmp_path / "docker-calls.jsonl"),
            **environment}


def real_command(tmp_path: Path, *extra: str) -> list[str]:
    return [BASH, str(SCRIPT), "--target-hf", str(tmp_path / "target-hf"), "--draft-hf", str(tmp_path / "draft-hf"),
            "--work-dir", str(tmp_path / "work"), "--report", str(tmp_path / "report.md"), *extra]


def docker_calls(tmp_path: Path) -> list[list[str]]:
    import json

    path = tmp_path / "docker-calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def real_run(tmp_path: Path, *extra: str, **environment: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """docker/gpu-smoke.sh without --dry-run, against the fake docker."""
    result = subprocess.run(real_command(tmp_path, *extra), capture_output=True, text=True, timeout=300,
                            env=fake_tools(tmp_path, environment), cwd=tmp_path)
    return result, docker_calls(tmp_path)


def report_statuses(tmp_path: Path) -> dict[str, str]:
    return dict(re.findall(r"^## (\d+[ab]?)\. .+: (.+)$", (tmp_path / "report.md").read_text(), re.MULTILINE))


def test_a_run_where_everything_works_passes_every_step_and_removes_its_containers(checkpoints):
    result, calls = real_run(checkpoints)
    assert result.returncode == 0, result.stderr
    assert report_statuses(checkpoints) == {step: "PASS" for step in STEPS}
    runs = [c for c in calls if c[0] == "run"]
    assert all(has(c, *option) for c in runs for option in SECURITY)
    names = {c[c.index("--name") + 1] for c in runs}
    removed = {c[-1] for c in calls if c[:2] == ["rm", "-f"]}
    assert names <= removed, names - removed
    kill = next(c for c in calls if c[0] == "exec" and "kill -9 \"$1\"" in c)
    assert kill[-1] == "1"  # the worker's pid in the container (NSpid of host pid 1 here)
    report = (checkpoints / "report.md").read_text()
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0" in report
    assert "drafting again 12.5 s after the kill" in report
    assert "SPECDEC_API_KEY=" not in report and "SPECDEC_API_KEY=" not in result.stderr
    lines = report.splitlines()
    assert lines.count("````text") == lines.count("````") == len(STEPS)  # every excerpt fenced on its own lines


def test_a_failed_step_is_explained_and_the_later_ones_still_run(checkpoints):
    result, _ = real_run(checkpoints, FAKE_DOCKER_FAIL="agreement", FAKE_NO_NVIDIA_CLIENT="1")
    assert result.returncode == 1
    statuses = report_statuses(checkpoints)
    assert statuses["5"] == "FAIL" and statuses["7b"] == "SKIP"
    assert {statuses[s] for s in ("6", "7a", "8", "9", "2b")} == {"PASS"}
    report = (checkpoints / "report.md").read_text()
    assert "the fake failed it" in report  # the log excerpt of the failed step
    assert "not in the image" in report
    assert "step 5: FAIL" in result.stderr and "the fake failed it" in result.stderr


def test_fp8_is_skipped_below_compute_capability_8_9(checkpoints):
    result, calls = real_run(checkpoints, FAKE_COMPUTE_CAP="8.0")
    assert result.returncode == 0, result.stderr
    assert report_statuses(checkpoints)["2b"] == "SKIP"
    assert "compute capability 8.0 is below 8.9" in (checkpoints / "report.md").read_text()
    assert not [c for c in calls if c[0] == "run" and "-build-fp8" in c[c.index("--name") + 1]]


def test_an_interrupted_run_stops_its_command_removes_its_containers_and_still_reports(checkpoints):
    import signal
    import time

    process = subprocess.Popen(real_command(checkpoints), env=fake_tools(checkpoints, {"FAKE_DOCKER_HANG": "1"}),
                               cwd=checkpoints, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not [c for c in docker_calls(checkpoints) if c[0] == "run" and "-build-" in " ".join(c)]:
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.1)
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    statuses = report_statuses(checkpoints)
    assert statuses["1"] == "PASS" and statuses["2a"] == "FAIL"
    assert "the run stopped during this step" in (checkpoints / "report.md").read_text()
    build = next(c for c in docker_calls(checkpoints) if c[0] == "run" and "-build-" in " ".join(c))
    assert ["rm", "-f", build[build.index("--name") + 1]] in docker_calls(checkpoints)


@pytest.mark.parametrize(("model", "options"), [
    ("target", {}),
    ("target", {"streaming": True, "draft": [5, 6, 7]}),
    ("target", {"return_logits": True}),
    ("draft", {"streaming": True, "return_logits": True}),
])
def test_direct_engine_requests_use_only_the_configs_inputs(model, options):
    """Step 4 sends what model_repository/<engine>/configs/trtllm.pbtxt declares,
    in its data types, with every required input, batch dimension first."""
    from tests._config_helpers import data_type_name, model_config

    config = model_config(model, "trtllm")
    declared = {i.name: i for i in config.input}
    arrays = gpu_smoke.engine_arrays([1, 2, 3], 4, 7, 7, **options)
    assert set(arrays) <= set(declared), set(arrays) - set(declared)
    assert {name for name, spec in declared.items() if not spec.optional} <= set(arrays)
    numpy_type = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_, "TYPE_UINT64": np.uint64}
    for name, array in arrays.items():
        assert array.dtype == numpy_type[data_type_name(declared[name].data_type)], name
        assert array.shape[0] == 1 and array.ndim == len(declared[name].dims) + 1, (name, array.shape)
