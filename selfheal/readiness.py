"""Waiting for a server to answer: specdec-serve waits so for tritonserver
and the OpenAI frontend, the engine watchdog for tritonserver (also in the
GPU image, which has no launcher)."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request


def local_host(address: str) -> str:
    """Where this machine reaches a server bound to ``address`` (a wildcard bind: loopback)."""
    return "127.0.0.1" if address in ("0.0.0.0", "") else address


def local_url(address: str, port: int) -> str:
    return f"http://{local_host(address)}:{port}"


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_for(process: subprocess.Popen | None, url: str, name: str, timeout: float) -> None:
    """Until ``url`` answers 200; an error naming ``name`` if its process
    (None: started elsewhere) exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = None if process is None else process.poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with code {code} before it was ready (see its log above)")
        if answers(url):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{name} was not ready within {timeout:.0f} s ({url})")
