"""``python -m selfheal.watchdog``: watch ``target`` and ``draft`` next to a
running tritonserver and reload whichever can no longer serve.

Started by ``specdec-serve`` (cpu profile: watches the Python-backend stub
processes) and by docker/trtllm-entrypoint.sh (GPU path: one-token probes).
Each engine has a thread of its own, so a long target reload does not hold
up the draft's checks. When an engine keeps dying (selfheal.decide.Settings),
the watchdog exits 1; its launcher then stops tritonserver and the process
or container is restarted whole."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from coordinator.request.access import API_KEY_VAR, api_key_from_env
from selfheal import exposition, probe, readiness, stubs, triton_admin
from selfheal.decide import EngineHealth, GiveUp, Reload, Settings, engines_alive

DETECTORS = ("stubs", "probe")


def say(message: str) -> None:
    print(f"specdec-watchdog: {message}", file=sys.stderr, flush=True)


class Watcher:
    """Checks one engine and reloads it when the decision logic says so."""

    def __init__(self, model: str, args, admin_key: str, settings: Settings, stop: threading.Event,
                 api_key: str | None = None):
        self.model = model
        self.args = args
        self.admin_key = admin_key
        self.api_key = api_key  # the probes are inference calls: Triton asks for the API key if it has one
        self.health = EngineHealth(model, settings)
        self.stop = stop
        self.gave_up = False
        self.pids: set[int] = set()
        self.regions: dict[int, str] = {}  # stub pid -> its shared-memory region, read while it lives
        self.next_probe = 0.0

    def watch_stubs(self) -> None:
        if "stubs" in self.args.detect:
            self.pids = stubs.stub_pids(self.model, self.args.server_pid)
            self.regions = {pid: region for pid in self.pids if (region := stubs.shm_region(pid))}
            if not self.pids:
                say(f"{self.model}: no Python-backend stub process found; "
                    + ("checking it by probes only" if "probe" in self.args.detect else "it is NOT watched"))

    def check(self, now: float) -> tuple[bool, str]:
        dead = sorted(pid for pid in self.pids if not stubs.alive(pid))
        if dead and self.replaced(dead):
            say(f"{self.model}: Triton replaced its stub process {', '.join(map(str, dead))} "
                f"(a reload through the model-repository API); watching {', '.join(map(str, sorted(self.pids)))}")
            dead = []
        if dead:
            return False, f"its stub process {', '.join(map(str, dead))} exited"
        if "probe" in self.args.detect and now >= self.next_probe:
            self.next_probe = now + self.args.probe_interval
            return probe.probe(self.args.grpc_url, self.model, self.args.probe_timeout, self.args.seed_input,
                               self.api_key)
        return True, ""

    def replaced(self, dead: list[int]) -> bool:
        """A stub that exited because Triton loaded the model again (someone
        with the admin key reloaded it) has a live successor; a crashed one
        has none, as Triton 2.51 never restarts a stub. Adopts the successors."""
        successors = stubs.stub_pids(self.model, self.args.server_pid) - self.pids
        if len(successors) < len(dead):
            return False
        self.pids = (self.pids - set(dead)) | successors
        self.regions = {pid: region for pid in self.pids if (region := stubs.shm_region(pid))}
        return True

    def run(self) -> None:
        try:
            self._watch()
        except Exception as error:  # noqa: BLE001 - an unwatched engine must not pass for a watched one
            say(f"{self.model}: the watchdog itself failed: {error!r}; stopping, so the server restarts whole")
            self.gave_up = True
            self.stop.set()

    def _watch(self) -> None:
        self.watch_stubs()
        while not self.stop.is_set():
            ok, reason = self.check(time.monotonic())
            if not ok and self.health.failures == 0:
                say(f"{self.model}: check failed: {reason}")
            action = self.health.checked(ok, reason, time.monotonic())
            while isinstance(action, Reload):
                action = self.reload(action)
            if isinstance(action, GiveUp):
                say(f"{self.model}: giving up: {action.reason}; stopping, so the server restarts whole")
                self.gave_up = True
                self.stop.set()
                return
            self.stop.wait(self.args.interval)

    def reload(self, action: Reload):
        say(f"{self.model} cannot serve ({action.reason}); reloading it")
        started = time.monotonic()
        # The draft in place: the server stays ready and requests go on with
        # the target alone. The target unloaded first: nothing can be served
        # without it, so the server says it is not ready until it is back.
        how = triton_admin.reload_in_place if self.model in self.args.in_place else triton_admin.reload
        try:
            how(self.args.http_url, self.model, self.admin_key, self.args.load_timeout)
        except Exception as error:  # noqa: BLE001 - refused, timed out, a config it could not read: all count
            say(f"{self.model}: reload failed after {time.monotonic() - started:.1f} s: {error}")
            return self.health.reloaded(False, str(error), time.monotonic())
        self.release_dead_regions()
        next_action = self.health.reloaded(True, "", time.monotonic())
        self.pids = set()
        self.watch_stubs()
        self.next_probe = 0.0
        say(f"{self.model} is back: reloaded in {time.monotonic() - started:.1f} s, "
            f"{self.health.last_downtime:.1f} s after it was found down")
        return next_action

    def release_dead_regions(self) -> None:
        """The dead stubs' shared-memory regions, which Triton keeps mapped but
        never removes: gone from /dev/shm, their memory returns when
        tritonserver exits instead of staying until the host (or pod) does."""
        for pid, region in self.regions.items():
            if stubs.alive(pid):
                continue
            try:
                if stubs.release_region(region):
                    say(f"{self.model}: removed the dead stub's shared-memory region {region} "
                        "(tritonserver still maps it until it exits)")
            except (OSError, ValueError) as error:
                say(f"{self.model}: could not remove the dead stub's region {region}: {error}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m selfheal.watchdog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-url", default="http://127.0.0.1:8000", help="Triton's HTTP endpoint")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint (probes)")
    parser.add_argument("--models", default="target,draft", help="engines to watch (comma-separated)")
    parser.add_argument("--detect", default="stubs",
                        help="how to tell an engine is down: stubs (Python-backend stub processes), "
                             "probe (one-token inference), or both, comma-separated")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="tritonserver's pid: only its own stubs are watched (several servers on one host)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between checks")
    parser.add_argument("--probe-interval", type=float, default=5.0, help="seconds between probes")
    parser.add_argument("--probe-timeout", type=float, default=30.0,
                        help="a probe not answered in this many seconds fails (leave room for a loaded server)")
    parser.add_argument("--seed-input", default="random_seed",
                        help="the engines' seed input name (the coordinator's engine_seed_input)")
    parser.add_argument("--in-place", default="draft",
                        help="engines reloaded while their old instance stays loaded, so the server stays ready "
                             "(comma-separated); the others are unloaded first, so it is not ready meanwhile")
    parser.add_argument("--failures-to-act", type=int, default=Settings.failures_to_act)
    parser.add_argument("--max-reloads", type=int, default=Settings.max_reloads)
    parser.add_argument("--window", type=float, default=Settings.window_seconds,
                        help="seconds over which --max-reloads are counted")
    parser.add_argument("--load-timeout", type=float, default=900.0, help="seconds an unload or a load may take")
    parser.add_argument("--down-limit", type=float, default=0.0,
                        help="/livez fails once an engine has been down this many seconds (a reload that hangs); "
                             "0: only when tritonserver is not live or an engine was given up")
    parser.add_argument("--wait-for-server", type=float, default=0.0,
                        help="first wait this many seconds at most for Triton to be ready")
    parser.add_argument("--metrics-address", default="127.0.0.1")
    parser.add_argument("--metrics-port", type=int,
                        default=int(os.environ.get(exposition.PORT_VAR, exposition.DEFAULT_PORT)),
                        help=f"port of the watchdog's /metrics; 0: none [{exposition.PORT_VAR}]")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.detect = [d for d in args.detect.split(",") if d]
    args.in_place = [m for m in args.in_place.split(",") if m]
    unknown = set(args.detect) - set(DETECTORS)
    if unknown or not args.detect:
        parser.error(f"--detect takes {', '.join(DETECTORS)}; got {', '.join(sorted(unknown)) or 'nothing'}")
    if args.down_limit < 0:
        parser.error(f"--down-limit must be >= 0 seconds (0: no limit), got {args.down_limit:g}")
    return args


def liveness(args, watchers: list[Watcher]):
    """/livez: tritonserver live and the engines within their down limit, so
    one probe on the watchdog's port covers a hung server and a hung reload."""

    def live() -> tuple[bool, str]:
        if not readiness.answers(f"{args.http_url}/v2/health/live", timeout=3.0):
            return False, "tritonserver is not live"
        return engines_alive([w.health for w in watchers], time.monotonic(), args.down_limit)

    return live


def main(argv=None) -> int:
    args = parse_args(argv)
    admin_key = os.environ.pop(triton_admin.ADMIN_KEY_VAR, "")
    api_key = api_key_from_env()
    os.environ.pop(API_KEY_VAR, None)
    if not admin_key:
        say(f"{triton_admin.ADMIN_KEY_VAR} is not set: without the admin key no engine can be reloaded")
        return 2
    try:
        settings = Settings(args.failures_to_act, args.max_reloads, args.window)
    except ValueError as error:
        say(str(error))
        return 2
    if args.wait_for_server:
        try:  # engines may load for minutes
            readiness.wait_for(None, f"{args.http_url}/v2/health/ready", "tritonserver", args.wait_for_server)
        except TimeoutError as error:
            say(str(error))
            return 1
    stop = threading.Event()
    watchers = [Watcher(model, args, admin_key, settings, stop, api_key) for model in args.models]
    if args.metrics_port:
        try:
            exposition.serve(args.metrics_address, args.metrics_port, lambda: [w.health for w in watchers],
                             liveness(args, watchers))
        except OSError as error:
            say(f"cannot serve metrics on {args.metrics_address}:{args.metrics_port}: {error} "
                f"(choose another port with {exposition.PORT_VAR}; 0: no metrics)")
            return 2
    threads = [threading.Thread(target=w.run, name=f"watch-{w.model}", daemon=True) for w in watchers]
    for thread in threads:
        thread.start()
    say(f"watching {', '.join(args.models)} ({'+'.join(args.detect)}, every {args.interval:g} s)"
        + (f"; metrics and liveness on {args.metrics_address}:{args.metrics_port} (/metrics, /livez)"
               if args.metrics_port else ""))
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        return 0
    return 1 if any(w.gave_up for w in watchers) else 0


if __name__ == "__main__":
    sys.exit(main())
