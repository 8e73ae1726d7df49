"""Triton's Python-backend stub processes, read from /proc.

Each model instance of the Python backend (the cpu profile's engines) runs
in a ``triton_python_backend_stub`` child of tritonserver whose command line
names the instance (``target_0_0``: model, group, instance). A stub that
was killed (OOM, segfault, kill -9) is gone or a zombie at once, while
Triton 2.51 still calls the model ready; watching the stubs notices it
within a check interval and costs no inference."""

from __future__ import annotations

import os
import re
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


def instance_model(name: str) -> str | None:
    """``target_0_0`` -> ``target``; None for anything else."""
    match = re.fullmatch(r"(.+)_\d+_\d+", name)
    return match.group(1) if match else None


def _live_stubs(proc: Path):
    """(pid, argv as text, parent pid) of every live stub process in ``proc``."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [arg.decode(errors="replace") for arg in (entry / "cmdline").read_bytes().split(b"\0")]
            state, parent = _stat(entry)
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if argv and os.path.basename(argv[0]) == STUB_BINARY and state not in ("Z", "X"):
            yield int(entry.name), argv, parent


def stub_pids(model: str, parent: int | None, proc: Path = Path("/proc")) -> set[int]:
    """Pids of the live stubs of ``model``'s instances (children of ``parent``, when given)."""
    return {pid for pid, argv, ppid in _live_stubs(proc)
            if (parent is None or ppid == parent) and model in {instance_model(arg) for arg in argv[1:]}}


def shm_region(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The name of the shared-memory region Triton made for this stub: the
    stub's second argument (``<stub> <model.py> <region> <size> ...``; its
    prefix is the backend's ``shm-region-prefix-name``). None when the process
    is gone or is no stub."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) < 3 or os.path.basename(argv[0].decode(errors="replace")) != STUB_BINARY:
        return None
    return argv[2].decode(errors="replace") or None


def server_stub_pids(region_prefix: str, proc: Path = Path("/proc")) -> set[int]:
    """Pids of the live stubs whose region carries ``region_prefix``: one server's
    stubs, found by name since a stub that outlives tritonserver has a new parent."""
    return {pid for pid, argv, _ in _live_stubs(proc) if len(argv) > 2 and argv[2].startswith(region_prefix)}


def release_region(region: str, shm_dir: Path | None = None) -> bool:
    """Remove a dead stub's region from ``shm_dir`` (/dev/shm). Triton 2.51 never
    finishes unloading an instance whose stub died with calls in flight, so it
    never removes the region, and the file would outlive tritonserver. Once
    removed, its memory returns when the last mapping goes (tritonserver's, at
    its exit). True when a file was removed."""
    if not region or "/" in region or region in (".", ".."):
        raise ValueError(f"not a shared-memory region's name: {region!r}")
    try:
        ((shm_dir or SHM_DIR) / region).unlink()
    except FileNotFoundError:
        return False
    return True


def alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        return _stat(proc / str(pid))[0] not in ("Z", "X")
    except OSError:
        return False


def _stat(entry: Path) -> tuple[str, int]:
    """(state, parent pid) from /proc/<pid>/stat; the name field may hold spaces and parentheses."""
    text = (entry / "stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])
