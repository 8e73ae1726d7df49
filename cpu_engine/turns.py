"""Forwards of engines that share the cores take turns.

Target and draft run in two stub processes, each with its own OpenMP team
sized to the cores. When a draft forward and a verification of different
requests run at once, the two teams oversubscribe the cores: both forwards
slow down, and the target's threads spin on cores the draft holds
(measured in docs/measurements.md). Holding a lock on a file around each
forward lets one engine's forward have the cores to itself.

A lock alone is not fair: an engine that releases it and asks again at once
may win again and again while the other waits. A second lock, the queue,
makes the turns alternate: an engine takes the queue, then the cores, then
lets the queue go; the engine that just finished a forward must take the
queue before the cores, and the queue is held by the engine waiting for
them. The kernel drops a process's locks when it dies, so a crashed engine
never holds the cores.

Imports nothing heavy: the adapter and its tests use it without torch."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

TURNS_VARIABLE = "SPECDEC_FORWARD_TURNS"


class ForwardTurns:
    """A context manager around one forward; without a path, a no-op."""

    def __init__(self, path_prefix: str | os.PathLike | None):
        self._queue = self._cores = None
        if not path_prefix:
            return
        prefix = Path(path_prefix)
        try:
            prefix.parent.mkdir(parents=True, exist_ok=True)
            self._queue = os.open(f"{prefix}.queue", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._cores = os.open(f"{prefix}.cores", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            self.close()
            raise ValueError(f"{TURNS_VARIABLE}: cannot open lock files at {prefix}: {error}") from None

    @classmethod
    def from_environment(cls, env) -> "ForwardTurns":
        return cls(env.get(TURNS_VARIABLE, "").strip() or None)

    @property
    def enabled(self) -> bool:
        return self._cores is not None

    def __enter__(self) -> "ForwardTurns":
        if self._cores is not None:
            fcntl.flock(self._queue, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._cores, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._queue, fcntl.LOCK_UN)
        return self

    def __exit__(self, *exc) -> None:
        if self._cores is not None:
            fcntl.flock(self._cores, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._queue, self._cores):
            if fd is not None:
                os.close(fd)
        self._queue = self._cores = None
