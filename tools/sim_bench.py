"""``specdec-sim-bench``: the coordinator at GPU step times. Starts a
tritonserver with the sim profile (simulated engines that sleep a preset's
forward times, sim_engine/), then for each stream count runs greedy requests
plain (speculation_window 0) and speculative (server defaults), and reports
tokens/s, the speed-up beside the ideal computed from the preset's step times
and acceptance (sim_engine/presets.py, ``ideal``), and the serving stack's CPU
time: tritonserver's and the coordinator stub's utime+stime (/proc/<pid>/stat)
over the run, per round and per token. The sim engines' own stubs are not
counted in it (on a GPU host the engines are TensorRT-LLM's C++ backend, not
Python processes); their CPU and how busy the host's cores were are reported
beside it, since on a small host the simulation's own Python takes cores the
stack then lacks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tools.soak import process_tree

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its threads included), in seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def stack_pids(server_pid: int) -> dict[str, int]:
    """tritonserver and its coordinator stub (by the model path the stub is given)."""
    return {"tritonserver": server_pid, **stubs_by_model_path(server_pid, {"coordinator": b"/coordinator/"})}


def engine_pids(server_pid: int) -> dict[str, int]:
    """The sim engines' stubs (models target and draft)."""
    return stubs_by_model_path(server_pid, {"target": b"/target/", "draft": b"/draft/"})


def stubs_by_model_path(server_pid: int, paths: dict[str, bytes]) -> dict[str, int]:
    """The Python-backend stubs under ``server_pid`` by name, each found by a part of its model's path."""
    pids = {}
    for pid in process_tree(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for name, path in paths.items():
            if len(cmdline) > 1 and path in cmdline[1]:
                pids[name] = pid
    return pids


def host_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole host since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class Run:
    streams: int
    mode: str
    tokens: int
    seconds: float
    rounds: int
    drafted: int
    accepted: int
    cpu: dict[str, float]
    plain_rounds: int = 0  # rounds of a speculative run that decoded plainly
    reasons: dict[str, int] | None = None  # why requests decoded plainly (fallback_reason), by count
    engine_cpu: float = 0.0  # the sim engines' stubs, seconds
    host_busy: float = 0.0  # share of the host's CPU time that was busy

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def cpu_ms_per(self, unit: int) -> float:
        return 1000.0 * sum(self.cpu.values()) / max(unit, 1)


def generate(url: str, prompt: str, max_tokens: int, window: int | None) -> dict:
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if window is not None:
        body["speculation_window"] = window
    request = urllib.request.Request(f"{url}/v2/models/coordinator/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def run_level(url: str, pids: dict[str, int], engines: dict[str, int], streams: int, mode: str, max_tokens: int,
              requests: int, tag: str) -> Run:
    window = 0 if mode == "plain" else None
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int):
        for r in range(requests):
            try:
                out = generate(url, f"def sim_{tag}_{mode}_{i}_{r}(x):", max_tokens, window)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
                return
            with lock:
                results.append(out)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    engines_before, ticks_before = sum(cpu_seconds(pid) for pid in engines.values()), host_ticks()
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    engine_cpu = sum(cpu_seconds(pid) for pid in engines.values()) - engines_before
    busy_ticks, all_ticks = (now - then for now, then in zip(host_ticks(), ticks_before))
    if errors:
        raise RuntimeError(f"{mode} at {streams} streams: {errors[0]}")

    def total(key):
        return sum(int(out.get(key, 0)) for out in results)

    reasons = dict(Counter(out["fallback_reason"] for out in results if out.get("fallback_reason")))
    return Run(streams, mode, total("completion_tokens"), seconds, total("speculative_rounds") + total("plain_rounds"),
               total("total_draft_tokens"), total("total_accepted_draft_tokens"), cpu, total("plain_rounds"),
               reasons, engine_cpu, busy_ticks / all_ticks if all_ticks > 0 else 0.0)


def measure(url: str, pids: dict[str, int], engines: dict[str, int], levels: list[int], max_tokens: int,
            repeats: int) -> list[dict]:
    rows = []
    for streams in levels:
        requests = max(1, repeats // streams) if streams > 1 else repeats
        run_level(url, pids, engines, streams, "speculative", 16, 1, f"warm{streams}")  # warm-up (not counted)
        plain = run_level(url, pids, engines, streams, "plain", max_tokens, requests, "m")
        spec = run_level(url, pids, engines, streams, "speculative", max_tokens, requests, "m")
        rows.append({"streams": streams, "plain": plain, "speculative": spec})
    return rows


def report(rows: list[dict], preset_name: str, max_tokens: int) -> tuple[str, list[dict]]:
    from sim_engine.presets import ideal, preset as find_preset  # not in the GPU image: imported where used

    p = find_preset(preset_name)
    lines = [
        f"sim preset {preset_name}: target {p.target.base_ms} ms + {p.target.per_row_ms} ms/row, draft "
        f"{p.draft.base_ms} ms + {p.draft.per_row_ms} ms/row, agreement {p.agreement}; greedy, {max_tokens} tokens",
        "| streams | plain tok/s | spec tok/s | speed-up | ideal (window) | of ideal | accepted/drafted "
        "| stack CPU ms/spec round | stack CPU ms/plain token | CPU ms/round: tritonserver + coordinator "
        "| sim engines' CPU ms/spec round | host busy, plain / spec |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out = []
    for row in rows:
        plain, spec = row["plain"], row["speculative"]
        best, window = ideal(p, row["streams"])
        speedup = spec.tokens_per_second / plain.tokens_per_second
        record = {
            "streams": row["streams"], "plain_tokens_per_second": plain.tokens_per_second,
            "speculative_tokens_per_second": spec.tokens_per_second, "speedup": speedup, "ideal": best,
            "ideal_window": window, "of_ideal": speedup / best,
            "acceptance": spec.accepted / spec.drafted if spec.drafted else None,
            "cpu_ms_per_speculative_round": spec.cpu_ms_per(spec.rounds),
            "cpu_ms_per_plain_token": plain.cpu_ms_per(plain.tokens),
            "cpu_split_per_round_ms": {k: 1000 * v / max(spec.rounds, 1) for k, v in spec.cpu.items()},
            "rounds": spec.rounds, "tokens_per_round": spec.tokens / max(spec.rounds, 1),
            "sim_engines_cpu_ms_per_speculative_round": 1000 * spec.engine_cpu / max(spec.rounds, 1),
            "host_busy": {"plain": plain.host_busy, "speculative": spec.host_busy},
            "plain_rounds_share": spec.plain_rounds / max(spec.rounds, 1), "fallback_reasons": spec.reasons,
        }
        out.append(record)
        split = " + ".join(f"{v:.2f}" for v in record["cpu_split_per_round_ms"].values())
        lines.append(
            f"| {row['streams']} | {plain.tokens_per_second:.0f} | {spec.tokens_per_second:.0f} | {speedup:.2f}x | "
            f"{best:.2f}x ({window}) | {100 * speedup / best:.0f} % | "
            f"{record['acceptance'] if record['acceptance'] is None else round(record['acceptance'], 2)} | "
            f"{record['cpu_ms_per_speculative_round']:.2f} | {record['cpu_ms_per_plain_token']:.2f} | {split} | "
            f"{record['sim_engines_cpu_ms_per_speculative_round']:.2f} | "
            f"{100 * plain.host_busy:.0f} % / {100 * spec.host_busy:.0f} % |")
    return "\n".join(lines), out


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} vCPU {model}, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    from sim_engine.presets import DEFAULT_PRESET, PRESETS, UnknownPreset, preset

    def known_preset(value: str) -> str:
        try:
            preset(value)
        except UnknownPreset as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value

    parser = argparse.ArgumentParser(prog="specdec-sim-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=DEFAULT_PRESET, type=known_preset,
                        help=f"{', '.join(PRESETS)}, or a timing table of tools/gpu_timing.py: TABLE.json "
                             "(its first pair) or TABLE.json#PAIR")
    parser.add_argument("--streams", default="1,4,16,32", help="stream counts, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8, help="requests per level (at least one per stream)")
    parser.add_argument("--url", default="", help="an already running sim server's HTTP URL (its pid: --pid)")
    parser.add_argument("--pid", type=int, default=0, help="tritonserver's pid for the CPU times (with --url)")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    levels = [int(s) for s in args.streams.split(",")]
    if args.url:
        rows = measure(args.url, stack_pids(args.pid) if args.pid else {}, engine_pids(args.pid) if args.pid else {},
                       levels, args.max_tokens, args.repeats)
    else:
        from launcher.launch import ServerOptions, prepare, start, wait_until_ready

        options = ServerOptions(profile="sim", sim_preset=args.preset, http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), openai_port=0, watchdog_port=0)
        pair = prepare(options)
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specdec-sim-bench-{os.getpid()}.log"
        with open(log_path, "wb") as log:
            process = start(options, pair, stdout=log, stderr=log)
        try:
            wait_until_ready(process, options, timeout=300)
            rows = measure(f"http://127.0.0.1:{options.http_port}", stack_pids(process.pid),
                           engine_pids(process.pid), levels, args.max_tokens, args.repeats)
        finally:
            process.terminate()
            process.wait(timeout=60)
    text, records = report(rows, args.preset, args.max_tokens)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d')}")
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                                               "preset": args.preset, "results": records}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
