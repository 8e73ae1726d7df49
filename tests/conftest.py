"""Shared fixtures. ``triton_server`` starts a real tritonserver with the real
model pair (cpu profile) once per test session, on free ports."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class ServerAddress:
    grpc_url: str
    http_url: str
    metrics_url: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> ServerAddress:
    # Point the tests at an already running server (e.g. `make serve`) to iterate quickly.
    external = os.environ.get("SPECDEC_TEST_SERVER")
    if external:
        host = external.rsplit(":", 1)[0]
        yield ServerAddress(external, f"http://{host}:8000", f"http://{host}:8002")
        return

    from coordinator.serving.launch import ServerOptions, prepare, start, wait_until_ready

    options = ServerOptions(http_port=_free_port(), grpc_port=_free_port(), metrics_port=_free_port())
    pair = prepare(options)
    log_path = Path(tmp_path_factory.mktemp("triton")) / "tritonserver.log"
    with open(log_path, "wb") as log:
        process = start(options, pair, stdout=log, stderr=log)
    try:
        wait_until_ready(process, options, timeout=900)
    except Exception:
        process.kill()
        print(log_path.read_text()[-5000:])
        raise
    yield ServerAddress(
        f"127.0.0.1:{options.grpc_port}",
        f"http://127.0.0.1:{options.http_port}",
        f"http://127.0.0.1:{options.metrics_port}",
    )
    process.terminate()
    try:
        process.wait(timeout=60)
    except Exception:
        process.kill()
