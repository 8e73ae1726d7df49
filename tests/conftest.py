"""Shared fixtures. ``triton_server`` starts a real tritonserver with the real
model pair (cpu profile) once per test session, on free ports.

That server is the production launch (``launcher.launch``, the
cpu profile's configs unchanged) plus two test-only settings: a known admin
key (so the security tests can use the restricted APIs) and the CPU engine's
fault injection (cpu_engine/faults.py), whose rules fire
only for requests carrying one of the reserved seeds in ``FAULT_SEEDS``
(>= 2^63; requests without a seed get one below 2^63). Every other request
is served exactly as in production, so one server covers the ordinary and the
failure tests (a second server would need another ~6 GB and ~90 s)."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

FAULT_SEEDS = {
    "draft_raises": 2**63 + 101,
    "draft_late": 2**63 + 102,
    "target_raises": 2**63 + 103,
}
DRAFT_LATE_SECONDS = 12.0  # longer than the coordinator's draft_timeout_seconds (10)


@dataclass(frozen=True)
class ServerAddress:
    grpc_url: str
    http_url: str
    metrics_url: str
    admin_key: str | None = field(default=None, repr=False)  # None: unknown (external server)
    pid: int | None = None  # tritonserver's process id, when the tests started it
    faults: bool = False  # the FAULT_SEEDS rules are active
    draft_deadline: float | None = None
    log_path: Path | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fault_rules() -> str:
    return ";".join([
        f"draft:raise@seed={FAULT_SEEDS['draft_raises']}",
        f"draft:sleep={DRAFT_LATE_SECONDS:g}@seed={FAULT_SEEDS['draft_late']}",
        f"target:raise@seed={FAULT_SEEDS['target_raises']}",
    ])


def _configured_draft_deadline() -> float:
    from tests._config_helpers import model_config, parameter

    deadline = float(parameter(model_config("coordinator", "cpu"), "draft_timeout_seconds"))
    assert deadline < DRAFT_LATE_SECONDS, "the late-draft fault must outlast the deadline"
    return deadline


@contextmanager
def running_server(options, log_path: Path):
    """A tritonserver started with ``launcher.launch`` (its output in
    ``log_path``), ready; terminated on exit."""
    from launcher.launch import prepare, start, wait_until_ready

    pair = prepare(options)
    with open(log_path, "wb") as log:
        process = start(options, pair, stdout=log, stderr=log)
    try:
        try:
            wait_until_ready(process, options, timeout=900)
        except Exception:
            process.kill()
            print(log_path.read_text(errors="replace")[-5000:])
            raise
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except Exception:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def real_target_dir() -> Path:
    """The real target model's directory, where the server keeps it (SPECDEC_CACHE_DIR,
    else ~/.cache/specdec), prepared there if it is not yet: never a skip."""
    from launcher.assets import DEFAULT_TARGET, default_cache_dir, prepare_model

    return prepare_model(DEFAULT_TARGET, default_cache_dir(), "target")


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> ServerAddress:
    # Point the tests at an already running server (e.g. `make serve`) to iterate quickly.
    external = os.environ.get("SPECDEC_TEST_SERVER")
    if external:
        host = external.rsplit(":", 1)[0]
        yield ServerAddress(external, f"http://{host}:8000", f"http://{host}:8002",
                            admin_key=os.environ.get("SPECDEC_ADMIN_KEY") or None)
        return

    from cpu_engine.faults import ALLOW_VAR, FAULTS_VAR
    from launcher.launch import ServerOptions, new_admin_key

    admin_key = new_admin_key()
    options = ServerOptions(
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), admin_key=admin_key,
        extra_env={FAULTS_VAR: fault_rules(), ALLOW_VAR: "1"},
    )
    log_path = Path(tmp_path_factory.mktemp("triton")) / "tritonserver.log"
    with running_server(options, log_path) as process:
        yield ServerAddress(
            f"127.0.0.1:{options.grpc_port}",
            f"http://127.0.0.1:{options.http_port}",
            f"http://127.0.0.1:{options.metrics_port}",
            admin_key=admin_key,
            pid=process.pid,
            faults=True,
            draft_deadline=_configured_draft_deadline(),
            log_path=log_path,
        )


@pytest.fixture(scope="session")
def openai_frontend(triton_server, real_target_dir, tmp_path_factory) -> str:
    """The OpenAI-compatible API (frontend/openai_server.py) in front of
    ``triton_server``, started as specdec-serve starts it, on a free port; its
    base URL (``http://127.0.0.1:<port>/v1``, what OpenAI clients take)."""
    from launcher import openai_frontend as frontend
    from launcher.launch import ADMIN_KEY_VAR

    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("openai")) / "frontend.log"
    with open(log_path, "wb") as log:
        process = frontend.start(triton_server.grpc_url, real_target_dir, "127.0.0.1", port,
                                 secret_vars=(ADMIN_KEY_VAR,), stdout=log, stderr=log)
    url = frontend.base_url("127.0.0.1", port)
    try:
        try:
            frontend.wait_until_ready(process, url, timeout=300)
        except Exception:
            print(log_path.read_text(errors="replace")[-5000:])
            raise
        yield f"{url}/v1"
    finally:
        frontend.stop(process)
