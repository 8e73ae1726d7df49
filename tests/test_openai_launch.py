"""How specdec-serve starts, watches and stops the OpenAI frontend
(launcher/openai_frontend.py, launcher/launch.py). No server, no model."""

from __future__ import annotations

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
