"""Locust load test of the ``coordinator`` model over Triton's gRPC streaming API.

Each simulated user holds one ``tritonclient.grpc`` client and sends one
request at a time (a closed loop; ``--think-time`` adds a pause). Per request
it fires locust request events:

* ``ttft``        time to the first chunk of text (streaming requests only);
* ``itl``         mean inter-token latency of the request, in ms per token;
* ``completion``  time to the final response; failures are reported here.

``response_length`` is the request's completion tokens, so locust's "average
size" column reads as tokens per request. The event name is the mode: ``spec``
(the server's ``speculation_window``, or ``--spec-window``) or ``plain``
(``speculation_window`` 0), with ``, stream=false`` for non-streaming requests.
Failures are honest: an error response, a gRPC error, a stream that closes
without a final response, no final response within ``--request-timeout``, a
final response without statistics, or statistics that break the contract
(more tokens than ``max_tokens``, more accepted than drafted tokens, drafted
tokens when speculation was off).

The load shape is a step ramp: for each user count of ``--steps`` (1,2,4) one
phase per entry of ``--modes`` (on,off): ``on`` runs SpeculativeUser only,
``off`` PlainUser only, ``mix`` both at once (half each). Each phase lasts
``--step-seconds``; then the test stops by itself. Users of the previous phase
are stopped at once and their requests in flight cancelled (not counted).

At the end (master or single process) it prints a table per (users,
speculation) and, with ``--csv PREFIX``, writes ``PREFIX_specdec_*`` files and
a PNG plot next to locust's CSVs (see ``loadtests/report.py``).

gevent: locust monkey-patches the standard library; grpcio's C core then
blocks the gevent hub (the first streaming request hangs) unless
``grpc.experimental.gevent.init_gevent()`` runs before any gRPC object is
created, which this module does on import.

Run: ``locust -f loadtests/locustfile.py --headless --host 127.0.0.1:8001``
(``make loadtest`` does it with bounded defaults).
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC object exists: see the module docstring

import gevent  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from locust import LoadTestShape, User, events, task  # noqa: E402
from locust.runners import MasterRunner, WorkerRunner  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # locust imports this file by path; make the project importable

from tools.client import build_inputs  # noqa: E402
from loadtests import grpc_stream  # noqa: E402
from loadtests.grpc_stream import RequestFailed, timed_completion  # noqa: E402
from loadtests.report import Phase, RequestRecord, render_text, summarize, write_reports  # noqa: E402
from loadtests.workload import (  # noqa: E402
    OPTIONS,
    build_phases,
    check_statistics,
    env_name,
    grpc_url,
    load_prompts,
    numbers,
    request_name,
)

log = logging.getLogger("specdec.loadtest")


@events.init_command_line_parser.add_listener
def _options(parser):
    for flag, settings in OPTIONS:
        parser.add_argument(flag, env_var=env_name(flag), **settings)


# --------------------------------------------- records, shared with master ----

RECORDS: list[RequestRecord] = []  # master / single process: every request of the run
_PENDING: list[dict] = []  # worker: records not yet sent to the master
PHASES: list[Phase] = []
_STATE = {"role": "local", "end": None, "written": False}
_LOCK = threading.Lock()


def _record(record: RequestRecord) -> None:
    with _LOCK:
        if _STATE["role"] == "worker":
            _PENDING.append(record.__dict__.copy())
        else:
            RECORDS.append(record)


@events.init.add_listener
def _on_init(environment, **_):
    runner = environment.runner
    _STATE["role"] = "worker" if isinstance(runner, WorkerRunner) else (
        "master" if isinstance(runner, MasterRunner) else "local")
    if environment.web_ui:
        _add_web_page(environment)
    options = environment.parsed_options
    if options is None or _STATE["role"] == "worker":
        return
    _validate(options)
    if (options.headless or options.autostart) and not options.skip_ready_check:
        _require_ready(environment.host)


def _validate(options) -> None:
    """Refuse bad options before anything starts (exit code 2), not in the middle of a run."""
    try:
        build_phases(options.steps, options.modes)
        numbers(options.max_tokens, int)
        numbers(options.temperature, float)
        if str(options.spec_window).strip():
            int(options.spec_window)
        if options.step_seconds <= 0 or options.request_timeout <= 0 or not 0 <= options.stream_ratio <= 1:
            raise ValueError("--step-seconds and --request-timeout must be positive, --stream-ratio within 0..1")
        _prompts(options)
    except (ValueError, OSError) as error:
        log.error("%s", error)
        _exit_now(2)


def _require_ready(host: str | None) -> None:
    """A run that starts by itself (headless, --autostart) against a server
    that is not up would only count failures: say so and stop (exit code 2)."""
    url = grpc_url(host)
    try:
        with grpcclient.InferenceServerClient(url) as client:
            ready = client.is_model_ready(grpc_stream.MODEL, client_timeout=10)
    except Exception as error:  # InferenceServerException, or a gRPC error from the channel
        log.error("no Triton server answers at %s (%s); start one (make serve) or pass --host", url, error)
        _exit_now(2)
    if not ready:
        log.error("the server at %s does not report model %r ready", url, grpc_stream.MODEL)
        _exit_now(2)


# grpcio in gevent mode can deadlock in its finalizers when the interpreter
# shuts down: Py_FinalizeEx garbage-collects channels whose __del__ takes a
# lock of grpc's C core that nothing will release any more (seen with grpcio
# 1.85.3 / gevent 26.9.0 in about one run in eight, the process then ignoring
# SIGTERM). So once locust is done (reports and CSVs written and closed), the
# process leaves without finalizing: stdio and logging flushed, then os._exit.
_EXIT = {"code": None}


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to say
            pass
    logging.shutdown()
    os._exit(code)


@events.quit.add_listener
def _on_quit(exit_code, **_):
    gc.collect()  # free what can be freed while gevent and grpc still run
    _EXIT["code"] = exit_code
    # atexit handlers run after locust's last step (closing the CSV files,
    # sys.exit) and before the interpreter finalizes anything; the last one
    # registered runs first.
    atexit.register(lambda: _exit_now(_EXIT["code"] or 0))


@events.report_to_master.add_listener
def _send_records(client_id, data, **_):
    with _LOCK:
        data["specdec_records"] = list(_PENDING)
        _PENDING.clear()


@events.worker_report.add_listener
def _receive_records(client_id, data, **_):
    records = [RequestRecord(**item) for item in data.get("specdec_records", ())]
    with _LOCK:
        RECORDS.extend(records)


def _reset_run() -> None:
    """A new run (the shape restarts): forget the last one's records and phases."""
    with _LOCK:
        RECORDS.clear()
        PHASES.clear()
        _STATE.update(end=None, written=False)


@events.test_start.add_listener
def _on_test_start(environment, **_):
    SpeculativeUser.reset_prompts()
    PlainUser.reset_prompts()


@events.test_stop.add_listener
def _on_test_stop(environment, **_):
    if _STATE["role"] == "worker":
        return
    _STATE["end"] = time.time()
    if not (environment.parsed_options and environment.parsed_options.headless):
        # UI runs: workers report every 3 s; write once their last records are in.
        gevent.spawn_later(4, _write_reports, environment)


@events.quitting.add_listener
def _on_quitting(environment, **_):
    if _STATE["role"] != "worker" and not _STATE["written"]:
        _write_reports(environment)


def _closed_phases() -> list[Phase]:
    """The phases so far; the open one ends now (or when the test stopped)."""
    end = _STATE["end"] or time.time()
    with _LOCK:
        phases = [Phase(**p.__dict__) for p in PHASES]
    for phase in phases:
        phase.end = phase.end or end
    return phases


def _summary_text() -> str:
    with _LOCK:
        records = list(RECORDS)
    return render_text(summarize(records, _closed_phases()))


def _write_reports(environment) -> None:
    options = environment.parsed_options
    with _LOCK:
        records = list(RECORDS)
    phases = _closed_phases()
    prefix = (options.report_prefix or options.csv_prefix) if options else ""
    failures = sum(not r.ok for r in records)
    header = (f"\nspecdec load test: {len(records)} requests recorded, {failures} failed, "
              f"{len(phases)} phases, host {environment.host}\n")
    if not records and options and options.headless:
        # Zero failures and zero requests is no result: no request finished in time.
        log.error("no request finished: each phase (--step-seconds) must be longer than a request takes "
                  "(or pass --stop-timeout to let requests in flight finish at the end)")
        environment.process_exit_code = 1
    if prefix:
        title = (f"coordinator at {environment.host}: max_tokens {options.max_tokens}, temperature "
                 f"{options.temperature}, {options.step_seconds:g} s per phase")
        text, written = write_reports(prefix, records, phases, title=title)
        print(header + "\n" + text + "wrote " + ", ".join(str(p) for p in written), flush=True)
    else:
        print(header + "\n" + render_text(summarize(records, phases)), flush=True)
    _STATE["written"] = True


def _add_web_page(environment) -> None:
    """/specdec in locust's web UI: the per-step table so far (for master-mode runs in a cluster)."""
    app = environment.web_ui.app

    @app.route("/specdec")
    def specdec_summary():  # pragma: no cover - exercised manually through the web UI
        return _summary_text(), 200, {"Content-Type": "text/markdown; charset=utf-8"}


# --------------------------------------------------------------- users ----


class _CoordinatorUser(User):
    abstract = True
    mode = "on"
    label = "spec"
    _prompt_counter = itertools.count()
    _live = 0

    @classmethod
    def reset_prompts(cls) -> None:
        cls._prompt_counter = itertools.count()

    def wait_time(self):
        think = self.environment.parsed_options.think_time if self.environment.parsed_options else 0.0
        return think

    def on_start(self):
        options = self.environment.parsed_options
        cls = type(self)
        if cls._live == 0 and options.prompt_order == "sequential":
            cls.reset_prompts()  # a new phase of this mode starts from the same prompts as the last
        self.options = options
        self.prompts = _prompts(options)
        runner = self.environment.runner
        self.worker = str(getattr(runner, "worker_index", "")) if isinstance(runner, WorkerRunner) else ""
        offset_seed = int(self.worker or 0)
        self.rng = random.Random(f"{options.seed}-{self.worker}-{cls.__name__}-{id(self)}")
        self.offset = offset_seed * len(self.prompts) // max(getattr(options, "expect_workers", 1) or 1, 1)
        self.max_tokens = numbers(options.max_tokens, int)
        self.temperatures = numbers(options.temperature, float)
        self.url = grpc_url(self.host or self.environment.host)
        self.client = grpcclient.InferenceServerClient(self.url)
        self.sent = 0
        cls._live += 1
        self._stopped = False

    def on_stop(self):
        if getattr(self, "_stopped", True):
            return
        self._stopped = True
        type(self)._live -= 1
        client, self.client = self.client, None
        try:
            client.close()
        except Exception:  # closing a client whose stream was cancelled must not fail the stop
            log.debug("closing the gRPC client failed", exc_info=True)
        del client  # its __del__ closes again: now, while grpc runs, not at interpreter exit

    def window(self) -> int | None:
        return int(self.options.spec_window) if str(self.options.spec_window).strip() else None

    def next_prompt(self) -> tuple[str, str]:
        if self.options.prompt_order == "random":
            return self.rng.choice(self.prompts)
        return self.prompts[(next(type(self)._prompt_counter) + self.offset) % len(self.prompts)]

    @task
    def complete(self):
        prompt_id, prompt = self.next_prompt()
        max_tokens = self.rng.choice(self.max_tokens)
        temperature = self.rng.choice(self.temperatures)
        stream = self.rng.random() < self.options.stream_ratio
        window = self.window()
        adaptive = {"true": True, "false": False}.get(self.options.adaptive_window) if self.mode == "on" else None
        inputs = build_inputs(prompt, max_tokens, speculation_window=window, temperature=temperature, stream=stream,
                              adaptive_window=adaptive)
        name = request_name(self.label, stream)
        self.sent += 1
        request_id = f"locust-{self.worker or 0}-{id(self) % 100000}-{self.sent}"
        record = RequestRecord(started=time.time(), ended=0.0, mode=self.mode, stream=stream, prompt=prompt_id,
                               max_tokens=max_tokens, temperature=temperature, ok=False, worker=self.worker)
        begin = time.perf_counter()
        try:
            timing = timed_completion(self.client, inputs, timeout=self.options.request_timeout,
                                      request_id=request_id)
            check_statistics(timing, max_tokens, speculation=self.mode == "on")
        except RequestFailed as failure:
            elapsed = time.perf_counter() - begin
            record.ended, record.latency, record.error = record.started + elapsed, elapsed, failure.kind
            _record(record)
            self._fire("completion", name, elapsed, 0, failure)
            return
        record.ok = True
        record.ended = timing.started + timing.latency
        record.latency = timing.latency
        record.tokens = timing.completion_tokens
        record.draft_tokens = timing.draft_tokens
        record.accepted_draft_tokens = timing.accepted_draft_tokens
        if stream:
            record.ttft, record.itl = timing.ttft, timing.itl
        _record(record)
        if stream and timing.ttft is not None:
            self._fire("ttft", name, timing.ttft, timing.completion_tokens)
        if stream and timing.itl is not None:
            self._fire("itl", name, timing.itl, timing.completion_tokens)
        self._fire("completion", name, timing.latency, timing.completion_tokens)

    def _fire(self, kind: str, name: str, seconds: float, tokens: int, exception: Exception | None = None):
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=seconds * 1000.0, response_length=tokens,
            exception=exception, context={"mode": self.mode},
        )


class SpeculativeUser(_CoordinatorUser):
    """Requests with speculation: the server's window, or --spec-window."""

    mode = "on"
    label = "spec"
    _prompt_counter = itertools.count()
    _live = 0


class PlainUser(_CoordinatorUser):
    """Requests with speculation_window 0: plain target decoding."""

    mode = "off"
    label = "plain"
    _prompt_counter = itertools.count()
    _live = 0

    def window(self) -> int | None:
        return 0


USER_CLASSES = {"on": [SpeculativeUser], "off": [PlainUser], "mix": [SpeculativeUser, PlainUser]}

_PROMPTS_CACHE: dict[tuple, list] = {}


def _prompts(options) -> list[tuple[str, str]]:
    key = (options.prompts_file, options.humaneval)
    if key not in _PROMPTS_CACHE:
        _PROMPTS_CACHE[key] = load_prompts(options.prompts_file, options.humaneval)
    return _PROMPTS_CACHE[key]


# --------------------------------------------------------------- shape ----


class StepRamp(LoadTestShape):
    """--steps x --modes phases of --step-seconds each, then stop.

    Locust's dispatcher applies a tick's user classes only to users it spawns,
    so a phase that changes the classes first stops every user (ticks at 0
    users) and starts the new ones once none is left: with --stop-timeout the
    old users finish their requests first, without it they are cancelled at
    once. Either way the phases never overlap, and each lasts --step-seconds
    from its own start."""

    DRAIN_MARGIN = 30.0  # seconds beyond --stop-timeout to wait for the users of a phase to stop

    def __init__(self):
        super().__init__()
        self._reset_state()

    def _reset_state(self) -> None:
        self._index = -1  # the phase running (or about to start)
        self._started = 0.0  # its start, perf_counter
        self._draining_since: float | None = None

    def reset_time(self):  # locust calls it when the shape starts a run
        super().reset_time()
        self._reset_state()
        _reset_run()

    def tick(self):
        options = self.runner.environment.parsed_options
        phases = build_phases(options.steps, options.modes)
        now = time.perf_counter()
        if self._draining_since is not None:
            waited = now - self._draining_since
            limit = (self.runner.environment.stop_timeout or 0) + self.DRAIN_MARGIN
            if self.get_current_user_count() > 0 and waited < limit:
                return 0, 100.0
            if waited >= limit:
                log.warning("users of the last phase still running after %.0f s; starting the next phase", waited)
            self._draining_since = None
            return self._start(self._index, phases, now)
        if self._index < 0:
            return self._start(0, phases, now)
        if now - self._started < options.step_seconds:
            users, mode = phases[self._index]
            return users, 100.0, USER_CLASSES[mode]
        following = self._index + 1
        if following >= len(phases):
            # The last phase lasts until its users have stopped (with
            # --stop-timeout they finish their requests): test_stop ends it.
            return None
        _close_phase(time.time())
        if USER_CLASSES[phases[following][1]] != USER_CLASSES[phases[self._index][1]]:
            self._index, self._draining_since = following, now
            return 0, 100.0
        return self._start(following, phases, now)

    def _start(self, index: int, phases, now: float):
        users, mode = phases[index]
        self._index, self._started = index, now
        with _LOCK:
            PHASES.append(Phase(index=index, users=users, mode=mode, start=time.time(), end=0.0))
        log.info("phase %d/%d: %d user(s), speculation %s, for %g s", index + 1, len(phases), users, mode,
                 self.runner.environment.parsed_options.step_seconds)
        # Spawn at once: a step is a step, not a ramp within the phase.
        return users, 100.0, USER_CLASSES[mode]


def _close_phase(now: float) -> None:
    with _LOCK:
        if PHASES and not PHASES[-1].end:
            PHASES[-1].end = now


__all__ = ["SpeculativeUser", "PlainUser", "StepRamp"]
