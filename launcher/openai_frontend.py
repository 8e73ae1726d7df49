"""Start the OpenAI-compatible frontend (``frontend.openai_server``) as a child
process pointed at Triton's gRPC port, and wait until it answers.

``specdec-serve`` starts it once Triton is ready and stops it with Triton;
the tests' ``openai_frontend`` fixture starts it the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from coordinator.request.access import API_KEY_VAR
from selfheal import readiness

DEFAULT_PORT = 9000
PORT_VAR = "SPECDEC_OPENAI_PORT"


def command(grpc_url: str, tokenizer_dir: Path, address: str, port: int) -> list[str]:
    return [sys.executable, "-m", "frontend.openai_server", "--host", address, "--port", str(port),
            "--grpc-url", grpc_url, "--tokenizer-dir", str(tokenizer_dir)]


def environment(secret_vars: tuple[str, ...] = (), api_key: str | None = None) -> dict[str, str]:
    """The launcher's environment without ``secret_vars``, with the API key in
    API_KEY_VAR (the frontend reads it there, never from its command line,
    which every user can read) or without one."""
    env = {name: value for name, value in os.environ.items() if name not in secret_vars and name != API_KEY_VAR}
    if api_key is not None:
        env[API_KEY_VAR] = api_key
    # transformers imports torch for the chat template; it never computes here,
    # so one thread keeps it off the engines' cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start(grpc_url: str, tokenizer_dir: Path, address: str, port: int, secret_vars: tuple[str, ...] = (),
          api_key: str | None = None, **popen_kwargs) -> subprocess.Popen:
    return subprocess.Popen(command(grpc_url, tokenizer_dir, address, port),
                            env=environment(secret_vars, api_key), **popen_kwargs)


def base_url(address: str, port: int) -> str:
    return readiness.local_url(address, port)


def wait_until_ready(process: subprocess.Popen, url: str, timeout: float = 180.0) -> None:
    """Until ``url``/health answers 200 (the frontend listens and the coordinator is ready)."""
    readiness.wait_for(process, f"{url}/health", "the OpenAI frontend", timeout)


def stop(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
