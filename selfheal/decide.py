"""When an engine counts as down, when to reload it and when to give up.

Pure bookkeeping over check results and clock readings (no I/O), so every
rule is tested in milliseconds; ``selfheal.watchdog`` runs the checks and
the reloads."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

UP, RELOADING, FAILED = "up", "reloading", "failed"


@dataclass(frozen=True)
class Settings:
    # Consecutive failed checks before an engine counts as down: a single slow
    # probe on a loaded server is not a crash.
    failures_to_act: int = 2
    # Reloads of one engine allowed within window_seconds; one more means the
    # engine keeps dying (bad engine, memory pressure) and a reload will not
    # fix it: the watchdog gives up and the process restarts (Kubernetes).
    max_reloads: int = 3
    window_seconds: float = 600.0

    def __post_init__(self):
        if self.failures_to_act < 1 or self.max_reloads < 1 or self.window_seconds <= 0:
            raise ValueError(f"invalid watchdog settings: {self}")


@dataclass(frozen=True)
class Reload:
    model: str
    reason: str


@dataclass(frozen=True)
class GiveUp:
    model: str
    reason: str


class EngineHealth:
    """One engine's state: up, reloading, or failed for good."""

    def __init__(self, model: str, settings: Settings = Settings()):
        self.model = model
        self.settings = settings
        self.state = UP
        self.failures = 0  # consecutive failed checks while up
        self.reason = ""  # why the latest check or reload failed
        self.recoveries = 0  # reloads that brought the engine back
        self.down_since: float | None = None
        self.last_downtime: float | None = None  # seconds from detection to the engine serving again
        self._reloads: deque[float] = deque()

    @property
    def serving(self) -> bool:
        """The latest check passed and no reload is under way."""
        return self.state == UP and self.failures == 0

    def checked(self, ok: bool, reason: str, now: float) -> Reload | GiveUp | None:
        """Record one check of a serving engine; the action it calls for."""
        if self.state != UP:
            return None  # a reload's outcome decides, not checks made meanwhile
        if ok:
            self.failures = 0
            return None
        self.failures += 1
        self.reason = reason
        if self.failures < self.settings.failures_to_act:
            return None
        self.down_since = now
        return self._reload(now, reason)

    def reloaded(self, ok: bool, reason: str, now: float) -> Reload | GiveUp | None:
        """Record the outcome of a reload; another reload, giving up, or nothing (back up)."""
        if self.state != RELOADING:
            raise RuntimeError(f"{self.model}: a reload finished that was never started")
        if ok:
            self.state, self.failures, self.reason = UP, 0, ""
            self.recoveries += 1
            if self.down_since is not None:
                self.last_downtime = now - self.down_since
            self.down_since = None
            return None
        self.reason = reason
        return self._reload(now, f"reload failed: {reason}")

    def _reload(self, now: float, reason: str) -> Reload | GiveUp:
        while self._reloads and now - self._reloads[0] > self.settings.window_seconds:
            self._reloads.popleft()
        if len(self._reloads) >= self.settings.max_reloads:
            self.state = FAILED
            return GiveUp(self.model, f"{reason} ({len(self._reloads)} reloads within "
                                      f"{self.settings.window_seconds:g} s did not keep it up)")
        self._reloads.append(now)
        self.state = RELOADING
        return Reload(self.model, reason)


def engines_alive(engines, now: float, down_limit: float) -> tuple[bool, str]:
    """Whether the engines allow the container to live on: none given up, and
    none down longer than ``down_limit`` seconds (0: no limit). A reload that
    hangs (Triton keeps a decoupled model unloading while calls to it are open,
    triton-inference-server/server#7626) never ends in a give-up of its own;
    the limit turns it into a failed liveness probe and a container restart."""
    for health in engines:
        if health.state == FAILED:
            return False, f"{health.model} was given up: {health.reason}"
        if down_limit and health.down_since is not None and now - health.down_since > down_limit:
            return False, (f"{health.model} has been down for {now - health.down_since:.0f} s "
                           f"(limit {down_limit:g} s): {health.reason}")
    return True, "ok"
