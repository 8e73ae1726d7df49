"""How specdec-serve starts, watches and stops the OpenAI frontend
(launcher/openai_frontend.py, launcher/launch.py). No server, no model."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import launch, openai_frontend


def test_the_openai_port_defaults_to_9000_and_0_turns_it_off(monkeypatch):
    monkeypatch.delenv("SPECDEC_OPENAI_PORT", raising=False)
    assert launch._parse_args([]).openai_port == 9000
    assert launch._parse_args(["--openai-port", "9100"]).openai_port == 9100
    monkeypatch.setenv("SPECDEC_OPENAI_PORT", "0")
    assert launch._parse_args([]).openai_port == 0


def test_the_frontend_is_pointed_at_the_grpc_port_and_the_targets_tokenizer():
    command = openai_frontend.command("127.0.0.1:8001", Path("/models/target"), "0.0.0.0", 9000)
    assert command[:3] == [sys.executable, "-m", "frontend.openai_server"]
    options = dict(zip(command[3::2], command[4::2]))
    assert options == {"--host": "0.0.0.0", "--port": "9000", "--grpc-url": "127.0.0.1:8001",
                       "--tokenizer-dir": "/models/target"}
    assert openai_frontend.base_url("0.0.0.0", 9000) == "http://127.0.0.1:9000"
    assert openai_frontend.base_url("10.0.0.5", 9000) == "http://10.0.0.5:9000"


def test_the_frontend_never_sees_the_admin_key(monkeypatch):
    monkeypatch.setenv(launch.ADMIN_KEY_VAR, "k" * 32)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = openai_frontend.environment(secret_vars=(launch.ADMIN_KEY_VAR,))
    assert launch.ADMIN_KEY_VAR not in env and env["OMP_NUM_THREADS"] == "1"


def sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_a_frontend_that_dies_stops_the_server():
    server = sleeper(60)
    frontend = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    assert launch._supervise(server, [frontend], stopping=lambda: False) == 3
    assert server.poll() is not None and time.monotonic() - started < 30


def test_the_frontend_stops_with_the_server():
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    frontend = sleeper(60)
    assert launch._supervise(server, [frontend], stopping=lambda: False) == 0
    assert frontend.poll() is not None


def test_waiting_for_a_frontend_that_exits_fails_fast():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(RuntimeError, match="exited with code 1"):
        openai_frontend.wait_until_ready(process, "http://127.0.0.1:9", timeout=30)


# ------------------------------------------- the trtllm image's entrypoint ----

ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "trtllm-entrypoint.sh"
FAKE = """#!/bin/bash
echo "{name} $*" >> "$LOG"
echo "{name} has SPECDEC_API_KEY=${{SPECDEC_API_KEY:-}}" >> "$LOG"
sleep "${{{var}_SECONDS:-30}}" > /dev/null 2>&1 &
trap 'echo "{name} stopped" >> "$LOG"; kill $!; exit 0' TERM
wait $!
exit "${{{var}_EXIT:-0}}"
"""


def entrypoint_tail(tmp_path, openai_port: str, **env) -> tuple[list[str], dict, Path]:
    """The entrypoint from where it starts its processes, with fake mpirun and
    python3 that log their command lines and the signals they get."""
    text = ENTRYPOINT.read_text()
    tail = text[text.index("children=()"):]
    program = ('restricted=x; admin_key=k; api_key=the-api-key; inference_flags=(--inference-flag); '
               'MODEL_REPOSITORY=/models; cuda_pools=(); '
               f'SPECDEC_TOKENIZER_DIR=/engines/tokenizer; OPENAI_PORT={openai_port}; WATCHDOG_PORT=8003; '
               'ENGINE_DOWN_LIMIT=180\n' + tail)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, var in (("mpirun", "TRITON"), ("python3", "FRONTEND")):
        (bin_dir / name).write_text(FAKE.format(name=name, var=var))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    log.touch()
    return ["bash", "-euo", "pipefail", "-c", program], {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), **env}, log


def run_entrypoint_tail(tmp_path, openai_port: str, **env) -> tuple[int, str]:
    command, environment, log = entrypoint_tail(tmp_path, openai_port, **env)
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)
    return run.returncode, log.read_text()


def test_the_trtllm_entrypoint_starts_the_frontend_next_to_triton_and_stops_triton_when_it_dies(tmp_path):
    code, log = run_entrypoint_tail(tmp_path, "9000", FRONTEND_SECONDS="0.5", FRONTEND_EXIT="3")
    assert code == 3
    frontend = next(line for line in log.splitlines() if line.startswith("python3 -m frontend."))
    assert frontend.split()[1:5] == ["-m", "frontend.openai_server", "--host", "0.0.0.0"]
    assert "--port 9000 --grpc-url 127.0.0.1:8001 --tokenizer-dir /engines/tokenizer" in frontend
    assert "mpirun stopped" in log
    # The API key: on Triton's command line (its only way to take it), in the
    # frontend's and the watchdog's environment, never on their command lines.
    assert "--inference-flag" in next(line for line in log.splitlines() if line.startswith("mpirun "))
    assert log.count("python3 has SPECDEC_API_KEY=the-api-key") == 2
    assert "mpirun has SPECDEC_API_KEY=\n" in log
    assert not [line for line in log.splitlines() if line.startswith("python3 -m") and "the-api-key" in line]


def test_the_trtllm_entrypoint_stops_the_frontend_with_triton(tmp_path):
    code, log = run_entrypoint_tail(tmp_path, "9000", TRITON_SECONDS="0.5", TRITON_EXIT="0")
    assert code == 0 and "python3 stopped" in log


def test_the_trtllm_entrypoint_without_an_openai_port_runs_triton_alone(tmp_path):
    code, log = run_entrypoint_tail(tmp_path, "0", TRITON_SECONDS="0.2", TRITON_EXIT="4", SPECDEC_WATCHDOG="0")
    assert code == 4 and "python3" not in log and log.startswith("mpirun ")


def test_the_trtllm_entrypoint_starts_the_watchdog_and_stops_triton_when_it_gives_up(tmp_path):
    code, log = run_entrypoint_tail(tmp_path, "0", FRONTEND_SECONDS="0.5", FRONTEND_EXIT="1")
    assert code == 1 and "mpirun stopped" in log
    watchdog = next(line for line in log.splitlines() if line.startswith("python3 -m selfheal."))
    assert watchdog.split()[1:3] == ["-m", "selfheal.watchdog"]
    assert "--detect probe" in watchdog and "--metrics-port 8003" in watchdog


def test_a_signal_to_the_trtllm_entrypoint_reaches_both(tmp_path):
    command, environment, log = entrypoint_tail(tmp_path, "9000")
    process = subprocess.Popen(command, env=environment)
    deadline = time.monotonic() + 30
    while log.read_text().count("\n") < 2:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) != 0
    assert {"mpirun stopped", "python3 stopped"} <= set(log.read_text().splitlines())
