"""Start the engine watchdog (``selfheal.watchdog``) as a child process next
to tritonserver: it reloads a ``target`` or ``draft`` whose stub process
died. ``specdec-serve`` starts it once Triton is ready and stops it with
Triton; a watchdog that gives up exits, and specdec-serve then stops
tritonserver too (a supervisor or Kubernetes restarts the whole)."""

from __future__ import annotations

import os
import subprocess
import sys

from coordinator.request.access import API_KEY_VAR
from selfheal import exposition

ENABLED_VAR = "SPECDEC_WATCHDOG"  # 0: no watchdog


def command(http_url: str, server_pid: int, metrics_address: str, metrics_port: int) -> list[str]:
    return [sys.executable, "-m", "selfheal.watchdog", "--http-url", http_url, "--detect", "stubs",
            "--server-pid", str(server_pid), "--metrics-address", metrics_address,
            "--metrics-port", str(metrics_port)]


def environment(admin_key: str, admin_key_var: str, api_key: str | None = None) -> dict[str, str]:
    """The launcher's environment plus the admin key, which the watchdog
    needs for Triton's model-repository API, and the inference API key, which
    its probes need (it removes both from its own environment at start)."""
    env = dict(os.environ)
    env[admin_key_var] = admin_key
    env.pop(API_KEY_VAR, None)
    if api_key is not None:
        env[API_KEY_VAR] = api_key
    return env


def enabled() -> bool:
    return os.environ.get(ENABLED_VAR, "1") != "0"


def start(http_url: str, server_pid: int, admin_key: str, admin_key_var: str, metrics_address: str = "127.0.0.1",
          metrics_port: int = exposition.DEFAULT_PORT, api_key: str | None = None, **popen_kwargs) -> subprocess.Popen:
    return subprocess.Popen(command(http_url, server_pid, metrics_address, metrics_port),
                            env=environment(admin_key, admin_key_var, api_key), **popen_kwargs)
