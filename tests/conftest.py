"""Shared fixtures. ``triton_server`` starts a real tritonserver with the real
model pair (cpu profile) once per test session, on free ports.

That server is the production launch (``coordinator.serving.launch``, the
cpu profile's configs unchanged) plus two test-only settings: a known admin
key (so the security tests can use the restricted APIs) and the CPU engine's
fault injection (coordinator/cpu_engine/faults.py), whose rules fire
only for requests carrying one of the reserved seeds in ``FAULT_SEEDS``
(>= 2^63; requests without a seed get one below 2^63). Every other request
is served exactly as in production, so one server covers the ordinary and the
failure tests (a second server would need another ~6 GB and ~90 s)."""

from __future__ import annotations

import os
import socket
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


def _free_port() -> int:
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


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> ServerAddress:
    # Point the tests at an already running server (e.g. `make serve`) to iterate quickly.
    external = os.environ.get("SPECDEC_TEST_SERVER")
    if external:
        host = external.rsplit(":", 1)[0]
        yield ServerAddress(external, f"http://{host}:8000", f"http://{host}:8002",
                            admin_key=os.environ.get("SPECDEC_ADMIN_KEY") or None)
        return

    from coordinator.cpu_engine.faults import ALLOW_VAR, FAULTS_VAR
    from coordinator.serving.launch import ServerOptions, new_admin_key, prepare, start, wait_until_ready

    admin_key = new_admin_key()
    options = ServerOptions(
        http_port=_free_port(), grpc_port=_free_port(), metrics_port=_free_port(), admin_key=admin_key,
        extra_env={FAULTS_VAR: fault_rules(), ALLOW_VAR: "1"},
    )
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
        admin_key=admin_key,
        pid=process.pid,
        faults=True,
        draft_deadline=_configured_draft_deadline(),
        log_path=log_path,
    )
    process.terminate()
    try:
        process.wait(timeout=60)
    except Exception:
        process.kill()
