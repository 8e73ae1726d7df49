"""Shared fixtures. ``triton_server`` runs ``specdec-serve`` (the production
launch: tritonserver with the real model pair, cpu profile, its engine
watchdog and the OpenAI-compatible frontend) once per test session, on free
ports.

It runs as production does with an inference API key (SPECDEC_API_KEY):
every test client sends it, the tools (tools.stream, the soak, locust,
AIPerf) from the variable SPECDEC_API_KEY, which this fixture sets in the
tests' own environment for the session, and the helpers of
tests/server_client.py from ``ServerAddress.api_key``; the security tests
send none or a wrong one on purpose. The only test-only settings are a known
admin key (so the security tests can use the restricted APIs) and the CPU
engine's fault injection
(cpu_engine/faults.py), whose rules fire only for requests carrying one of
the reserved seeds in ``FAULT_SEEDS`` (>= 2^63; requests without a seed get
one below 2^63). Every other request is served exactly as in production, so
one server covers the ordinary and the failure tests (a second server would
need another ~6 GB and a minute or more). The tests that kill its engines
(tests/server/test_server_selfheal.py) run last."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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
    api_key: str | None = field(default=None, repr=False)  # inference key; None: none (or unknown)
    pid: int | None = None  # tritonserver's process id, when the tests started it
    faults: bool = False  # the FAULT_SEEDS rules are active
    draft_deadline: float | None = None
    log_path: Path | None = None
    openai_url: str | None = None  # the OpenAI-compatible API's base URL, as OpenAI clients take it (.../v1)
    watchdog_url: str | None = None  # the engine watchdog's /metrics
    launcher_pid: int | None = None  # specdec-serve's process id, when the tests started it


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


SLOW_FOLDER = Path(__file__).resolve().parent / "server"


def pytest_collection_modifyitems(items):
    """The folders and the ``slow`` marker say the same: tests/server/ holds the
    tests that start a real tritonserver or load the real model pair (all
    ``slow``), tests/unit/ the fast ones (none). The tests that kill the session
    server's engines run after all others."""
    misplaced = [item.nodeid for item in items
                 if (item.get_closest_marker("slow") is not None) != (SLOW_FOLDER in Path(item.fspath).parents)]
    if misplaced:
        raise pytest.UsageError("a slow test outside tests/server/ or a fast one inside it: " + ", ".join(misplaced))
    items.sort(key=lambda item: item.get_closest_marker("kills_engines") is not None)


@contextmanager
def specdec_serve(env: dict[str, str], log_path: Path, timeout: float = 900):
    """``specdec-serve`` (``python -m launcher.launch``) with ``env`` added to
    this environment, its output in ``log_path``; yields the launcher's Popen
    and tritonserver's process id once it says it is ready; stopped on exit
    as a supervisor stops it (SIGTERM)."""
    from launcher.launch import PROJECT_ROOT
    from tools.soak import process_memory, process_tree

    with open(log_path, "wb") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "launcher.launch"], cwd=PROJECT_ROOT,
                                    env=dict(os.environ, **env), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while "specdec: ready" not in log_path.read_text(errors="replace"):
            if launcher.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-5000:]
                raise RuntimeError(f"specdec-serve not ready (exit code {launcher.poll()}); log tail:\n{tail}")
            time.sleep(1.0)
        server_pid = next(pid for pid in process_tree(launcher.pid)
                          if (process_memory(pid) or ("",))[0] == "tritonserver")
        yield launcher, server_pid
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        else:  # stopped as a supervisor stops it: nothing of it is left in /dev/shm, killed engines or not
            from launcher import shm_regions

            left = sorted(p.name for p in shm_regions.SHM_DIR.glob(f"{shm_regions.prefix(launcher.pid)}*"))
            assert not left, f"specdec-serve left its shared-memory regions in {shm_regions.SHM_DIR}: {left}"


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> ServerAddress:
    # Point the tests at an already running server (e.g. `make serve`) to iterate quickly.
    external = os.environ.get("SPECDEC_TEST_SERVER")
    if external:
        host = external.rsplit(":", 1)[0]
        yield ServerAddress(external, f"http://{host}:8000", f"http://{host}:8002",
                            admin_key=os.environ.get("SPECDEC_ADMIN_KEY") or None,
                            api_key=os.environ.get("SPECDEC_API_KEY") or None,
                            openai_url=f"http://{host}:9000/v1", watchdog_url=f"http://{host}:8003/metrics")
        return

    from cpu_engine.faults import ALLOW_VAR, FAULTS_VAR
    from coordinator.request.access import API_KEY_VAR
    from launcher.launch import ADMIN_KEY_VAR, new_admin_key
    from selfheal.exposition import PORT_VAR as WATCHDOG_PORT_VAR
    from launcher.openai_frontend import PORT_VAR as OPENAI_PORT_VAR

    admin_key, api_key = new_admin_key(), new_admin_key()
    http, grpc, metrics, openai, watchdog = (free_port() for _ in range(5))
    env = {
        "SPECDEC_HTTP_PORT": str(http), "SPECDEC_GRPC_PORT": str(grpc), "SPECDEC_METRICS_PORT": str(metrics),
        OPENAI_PORT_VAR: str(openai), WATCHDOG_PORT_VAR: str(watchdog), ADMIN_KEY_VAR: admin_key,
        API_KEY_VAR: api_key,
        FAULTS_VAR: fault_rules(), ALLOW_VAR: "1",
        # Calls a killed engine had are never released, so a stop after the engine-killing
        # tests would wait Triton's whole exit timeout (30 s by default) for them.
        "SPECDEC_TRITON_ARGS": "--exit-timeout-secs=5",
    }
    log_path = Path(tmp_path_factory.mktemp("triton")) / "specdec-serve.log"
    previous = os.environ.get(API_KEY_VAR)
    os.environ[API_KEY_VAR] = api_key  # what the tools read, as a user of the server sets it
    try:
        with specdec_serve(env, log_path) as (launcher, server_pid):
            yield ServerAddress(
                f"127.0.0.1:{grpc}",
                f"http://127.0.0.1:{http}",
                f"http://127.0.0.1:{metrics}",
                admin_key=admin_key,
                api_key=api_key,
                pid=server_pid,
                faults=True,
                draft_deadline=_configured_draft_deadline(),
                log_path=log_path,
                openai_url=f"http://127.0.0.1:{openai}/v1",
                watchdog_url=f"http://127.0.0.1:{watchdog}/metrics",
                launcher_pid=launcher.pid,
            )
    finally:
        if previous is None:
            os.environ.pop(API_KEY_VAR, None)
        else:
            os.environ[API_KEY_VAR] = previous


@pytest.fixture(scope="session")
def openai_frontend(triton_server) -> str:
    """The base URL of the OpenAI-compatible API (frontend/openai_server.py)
    that specdec-serve runs in front of ``triton_server``."""
    return triton_server.openai_url
