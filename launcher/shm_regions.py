"""The Python backend's shared-memory regions in /dev/shm, named per server.

Each Python-backend stub talks to tritonserver through a region in /dev/shm
(1 MiB and up). Triton removes a region when it unloads the model, but not
when it exits on its exit timeout: after an engine crash it waits for calls
the dead stub will never answer and then exits "immediately", leaving every
region behind. The files outlive the server (on a host until reboot; in
Kubernetes as long as the pod's /dev/shm volume). So specdec-serve names its
server's regions after itself (the backend's ``shm-region-prefix-name``),
removes them when tritonserver has exited, and at start removes those of
servers whose launcher is gone (a launcher killed before it could)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from selfheal.stubs import SHM_DIR, alive

_NAME = re.compile(r"specdec_(\d+)_")


def prefix(launcher_pid: int) -> str:
    """The region prefix of the server started by the launcher ``launcher_pid``."""
    return f"specdec_{launcher_pid}_"


def backend_arg(region_prefix: str) -> str:
    return f"--backend-config=python,shm-region-prefix-name={region_prefix}"


def remove(region_prefix: str, shm_dir: Path | None = None) -> list[str]:
    """Remove this server's regions (call it once tritonserver has exited)."""
    removed = []
    for path in (shm_dir or SHM_DIR).glob(f"{region_prefix}*"):
        try:
            path.unlink()
        except OSError:  # removed meanwhile, or not ours
            continue
        removed.append(path.name)
    return removed


def remove_orphans(own_pid: int, shm_dir: Path | None = None) -> list[str]:
    """Remove regions of servers whose launcher is gone, and any with this
    launcher's own pid (a previous process with the same pid: in a container
    the launcher's pid repeats across restarts). Only files owned by this user."""
    removed = []
    for path in (shm_dir or SHM_DIR).glob("specdec_*"):
        match = _NAME.match(path.name)
        if not match:
            continue
        pid = int(match.group(1))
        try:
            if path.stat().st_uid != os.getuid() or (pid != own_pid and alive(pid)):
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed
