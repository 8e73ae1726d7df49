"""``specdec-compare``: this server against what a user already has, in one
run on one machine, greedy, same model pair and threads.

Peers, run in-process first while the server sits idle: plain
``transformers`` ``generate`` of the target, ``transformers`` assisted
generation (``assistant_model`` = the draft), each in float32 and in
bfloat16 with ratios against its faster (a user keeps the dtype that is
fastest on their CPU), and this project's CPU engine
driven in-process (the forward without Triton and the coordinator: the
server's plain tokens/s over it is the serving overhead). Then the running
server: plain (speculation_window 0), speculative with the adaptive window,
and a fixed window, at every concurrency level (streams at once, each
running the same prompts) and at every prompt length (one stream).

Prompts come from the held-out HumanEval problems (100-163, never tuned on):
the ``150``-token set is single problems, longer sets concatenate problems
up to the length, the last one left to complete. Results are ratios against
plain ``transformers`` generation on the same prompts (and, for the server,
against its own plain mode at the same concurrency); absolute tokens/s of a
shared machine are noise. Greedy speculative texts must equal plain texts:
any difference is reported and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.prompts import Prompt, PromptError, copy_prompts, held_out_prompts
from tools.bench import (
    EXIT_ERROR,
    EXIT_MISMATCH,
    EXIT_OK,
    BenchError,
    parse_windows,
    require_matplotlib,
    save_figure,
    write_json,
)

PLAIN_GENERATE, ASSISTED, ENGINE = "transformers generate", "transformers assisted", "cpu engine in-process"
LOOKUP_PEER = "transformers prompt lookup"
# The time to first token a library user meets: one forward of the target over the whole prompt.
ONE_FORWARD = "transformers one forward"
# The same, timed beside the server's one-stream requests (prompt by prompt, the server idle):
# the time to first text is set against it, so the host's drift between the peers' minutes
# and the server's does not enter the ratio.
ONE_FORWARD_BESIDE = "transformers one forward, beside the server"
SERVER_MODES = ("plain", "adaptive", "fixed")
# The server's default drafter runs as "adaptive"; each drafter alone, at one stream:
DRAFTER_MODES = ("draft_model", "prompt_lookup")
HUMANEVAL, COPY = "humaneval", "copy"
# The transformers peers run in each (a library user takes the fastest; ``fastest_peer``).
PEER_DTYPES = ("float32", "bfloat16")
# Each run's prompts carry an id of their own: a second run against the same
# (warm) server then pays its prompts' prefill too, as a new user's requests do.
RUN_ID = secrets.token_hex(3)


@dataclass
class Measurement:
    system: str  # a peer, or "server <mode>"
    prompt_tokens: int  # the prompt set's nominal length
    concurrency: int
    prompt_set: str = HUMANEVAL  # humaneval (held-out problems) or copy (a function shown, then continued again)
    dtype: str | None = None  # the in-process peers' (the server's is its own)
    requests: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # wall clock of the whole run (all streams)
    first_text: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    texts: dict[str, str] = field(default_factory=dict)  # prompt id -> text (the first completion's)
    fallbacks: dict[str, int] = field(default_factory=dict)  # why requests stopped speculating -> how many
    # What the engines report for the same requests (one stream, CPU profile): forward passes
    # and their seconds by model, over ``metered_seconds`` of the requests' wall time.
    forwards: dict[str, int] = field(default_factory=dict)
    forward_seconds: dict[str, float] = field(default_factory=dict)
    metered_seconds: float = 0.0
    rounds: int = 0  # of the metered requests: speculative rounds plus plain steps
    # CPU time the hypervisor gave other guests while this ran, summed over the vCPUs (None: not
    # known here). A decode forward's threads meet at a barrier in every parallel region, so a
    # stolen vCPU stalls the whole forward: the wall clock grows by about the stolen seconds.
    steal_seconds: float | None = None

    def add_steal(self, before: float | None, after: float | None) -> None:
        if before is not None and after is not None:
            self.steal_seconds = (self.steal_seconds or 0.0) + after - before

    @property
    def tokens_per_unstolen_second(self) -> float | None:
        """Tokens/s over the wall clock less the stolen CPU time: comparable between runs that met
        different neighbours on a shared host (an estimate, exact while steals do not overlap)."""
        if self.steal_seconds is None or self.seconds <= self.steal_seconds:
            return None
        return self.completion_tokens / (self.seconds - self.steal_seconds)

    @property
    def overhead_per_round(self) -> float | None:
        """The serving stack's time per round (request wall time not spent in an engine's
        forward, over the rounds) in target forwards: coordinator, Triton, BLS, gRPC and the
        client. Where the draft's background prefill overlaps the target's forwards this is
        a lower bound; plain decoding has no draft."""
        target_forwards, target_seconds = self.forwards.get("target", 0), self.forward_seconds.get("target", 0.0)
        if not self.rounds or not target_forwards or not target_seconds:
            return None
        outside = self.metered_seconds - sum(self.forward_seconds.values())
        return outside / self.rounds / (target_seconds / target_forwards)

    @property
    def tokens_per_second(self) -> float | None:
        return self.completion_tokens / self.seconds if self.seconds > 0 else None

    @property
    def p50_first_text(self) -> float | None:
        return statistics.median(self.first_text) if self.first_text else None


@dataclass(frozen=True)
class Bound:
    """What this machine's forwards allow (tools/ceiling.py: every stream in step, no
    serving cost, the draft model's speculation at the best window for an acceptance)
    for requests of ``prompt_tokens`` and ``max_tokens``; measured in-process while the
    server is idle, like the peers."""

    target: object  # tools.ceiling.Forwards
    draft: object
    prompt_tokens: int
    max_tokens: int
    max_window: int

    def tokens_per_second(self, streams: int, acceptance: float | None) -> float:
        """Plain decoding's ceiling (acceptance None), else the best of plain and every window."""
        from tools.ceiling import best, ceilings

        table = ceilings(streams, acceptance or 0.0, self.max_window, self.target, self.draft, self.prompt_tokens,
                         self.max_tokens)
        return table[0].tokens_per_second if acceptance is None else best(table).tokens_per_second


def measure_bound(target_dir: Path, draft_dir: Path, streams: Sequence[int], prompt_tokens: int, max_tokens: int,
                  max_window: int, capacity: int) -> Bound:
    from tools.ceiling import measure_pair

    target, _, _, draft, _, _ = measure_pair(str(target_dir), str(draft_dir), streams, max_window, prompt_tokens,
                                             max_tokens, capacity)
    return Bound(target, draft, prompt_tokens, max_tokens, max_window)


def host_steal_seconds() -> float | None:
    """The host's cumulative steal time over all vCPUs (``/proc/stat``), or None off Linux or
    outside a VM that reports it."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# -- prompts -------------------------------------------------------------------

# -- peers (in-process) ----------------------------------------------------------

def run_peers(target_dir: Path, draft_dir: Path, prompts: dict[int, list[Prompt]], max_tokens: int,
              threads: int, progress, copy: Sequence[Prompt] = (), lookup_tokens: int = 8,
              dtypes: Sequence[str] = PEER_DTYPES, engine_settings: dict | None = None) -> list[Measurement]:
    """Plain and assisted generation on every prompt set, in each of ``dtypes``; on the copy-heavy set
    also transformers' prompt lookup (``prompt_lookup_num_tokens``, the server's window); then the
    in-process engine in the server target's dtype, with ``engine_settings`` (server_engine_settings)."""
    import torch
    from transformers import AutoTokenizer

    from cpu_engine.engine import resolve_dtype
    from cpu_engine.heap import retain_freed_memory

    torch.set_num_threads(threads)
    retain_freed_memory()  # the engines' allocator setting: neither side pays page faults the other does not
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    results = []
    for dtype in dtypes:
        results += run_library_peers(target_dir, draft_dir, tokenizer, prompts, max_tokens, progress, copy,
                                     lookup_tokens, dtype)
    # The engine in the dtype the server's target picks (its config says auto).
    return results + run_engine_peer(target_dir, tokenizer, prompts, max_tokens, threads, resolve_dtype("auto"),
                                     engine_settings or {})


# The target engine's parameters that shape its forwards: the in-process engine takes the server's.
ENGINE_PEER_PARAMETERS = {"max_num_tokens": int, "max_draft_len": int, "row_invariant": str,
                          "linear_kernel": str, "prompt_block": str}


def server_engine_settings(url: str, model: str = "target") -> dict:
    """The running server's ``model`` parameters of ENGINE_PEER_PARAMETERS ({} where it
    does not answer or is not the CPU engine)."""
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(url) as client:
            config = client.get_model_config(model, as_json=True)["config"]
    except Exception:  # noqa: BLE001 - no server, or another engine: the in-process engine's defaults
        return {}
    parameters = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
    return {name: kind(parameters[name]) for name, kind in ENGINE_PEER_PARAMETERS.items() if name in parameters}


def run_library_peers(target_dir: Path, draft_dir: Path, tokenizer, prompts: dict[int, list[Prompt]],
                      max_tokens: int, progress, copy: Sequence[Prompt], lookup_tokens: int, dtype: str) -> list[Measurement]:
    """The transformers peers in one dtype. A library user picks the dtype that is fastest for them, and
    which one that is depends on the CPU and the request: without native bfloat16 a one-row bfloat16
    decode step may still beat float32 (it reads half the bytes) while its prefill and assisted
    generation's verification are many times slower; so each peer runs in every dtype asked for and its
    ratios are taken against the fastest (``fastest_peer``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from cpu_engine.engine import DTYPES

    progress(f"peers in {dtype}")
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=DTYPES[dtype]).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=DTYPES[dtype]).eval()
    results = []
    groups = [(HUMANEVAL, length, group) for length, group in prompts.items()]
    if copy:
        groups.append((COPY, copy_length(copy), list(copy)))
    for prompt_set, length, group in groups:
        plain = Measurement(PLAIN_GENERATE, length, 1, prompt_set, dtype=dtype)
        assisted = Measurement(ASSISTED, length, 1, prompt_set, dtype=dtype)
        variants = [(plain, {}), (assisted, {"assistant_model": draft})]
        if prompt_set == COPY:
            variants.append((Measurement(LOOKUP_PEER, length, 1, prompt_set, dtype=dtype),
                             {"prompt_lookup_num_tokens": lookup_tokens}))
        for prompt in group:
            ids = tokenizer(prompt.text, return_tensors="pt").input_ids
            for measurement, extra in variants:
                stolen, started = host_steal_seconds(), time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                          do_sample=False, **extra)
                seconds = time.perf_counter() - started
                measurement.add_steal(stolen, host_steal_seconds())
                new = out[0, ids.shape[1]:]
                measurement.requests += 1
                measurement.completion_tokens += int(new.numel())
                measurement.seconds += seconds
                measurement.texts[prompt.prompt_id] = tokenizer.decode(new)
                progress(f"{measurement.system} ({dtype}), {length}-token prompt {prompt.prompt_id}: "
                         f"{new.numel() / seconds:.2f} tok/s")
        results += [m for m, _ in variants]
        if prompt_set == HUMANEVAL:
            results.append(time_one_forward(target, tokenizer, group, length, progress, dtype))
    return results


def run_engine_peer(target_dir: Path, tokenizer, prompts: dict[int, list[Prompt]], max_tokens: int,
                    threads: int, dtype: str, settings: dict | None = None) -> list[Measurement]:
    """This project's CPU engine in-process, set as the server's target (``settings``) and
    sent each prompt's length as the coordinator sends it: the server's plain tokens/s
    over it is the serving overhead."""
    import numpy as np

    from cpu_engine.engine import CausalLMEngine, EngineRequest

    engine = CausalLMEngine(str(target_dir), dtype=dtype, num_threads=threads, max_cached_sequences=0,
                            **(settings or {}))
    results = []
    for length, group in prompts.items():
        measurement = Measurement(ENGINE, length, 1, dtype=dtype)
        for prompt in group:
            ids = np.asarray(tokenizer(prompt.text).input_ids)
            stolen, started = host_steal_seconds(), time.perf_counter()
            result = engine.run(EngineRequest(ids, max_tokens, prompt_length=len(ids)))
            measurement.seconds += time.perf_counter() - started
            measurement.add_steal(stolen, host_steal_seconds())
            measurement.requests += 1
            measurement.completion_tokens += len(result.tokens)
        results.append(measurement)
    return results


def time_one_forward(target, tokenizer, group: Sequence[Prompt], length: int, progress,
                     dtype: str | None = None) -> Measurement:
    """One forward of ``target`` over each whole prompt (after one untimed forward to warm
    the kernels), recorded as that prompt's time to first text."""
    measurement = Measurement(ONE_FORWARD, length, 1, dtype=dtype)
    forward_seconds(target, tokenizer, group[0].text)
    measurement.first_text += [forward_seconds(target, tokenizer, prompt.text) for prompt in group]
    progress(f"{ONE_FORWARD} ({dtype}), {length}-token prompts: p50 {measurement.p50_first_text:.2f} s")
    return measurement


def forward_seconds(target, tokenizer, text: str) -> float:
    """Seconds of one forward of ``target`` over ``text`` (its last row's logits only, as
    ``generate`` computes a prompt's first token)."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        started = time.perf_counter()
        target(ids, logits_to_keep=1)
        return time.perf_counter() - started


# -- the server ------------------------------------------------------------------

def release_peers_memory() -> str:
    """Give the memory the peers' and the ceiling's models freed back to the system
    before the server runs (this process keeps freed memory for its forwards,
    cpu_engine/heap.py, and the float32 peers alone load several GB): the server's
    engines then share the machine with this process's working set only."""
    from cpu_engine.heap import release_free_heap

    before = _resident_mib()
    release_free_heap()
    after = _resident_mib()
    return f"this process gave back {before - after:.0f} MiB of freed memory ({after:.0f} MiB left)"


def _resident_mib() -> float:
    from tools.soak import process_memory

    memory = process_memory(os.getpid())
    return 0.0 if memory is None else memory[1] / 1024


def one_forward_timer(target_dir: Path, dtype: str) -> Callable[[str], float]:
    """Seconds of one forward of the target (in ``dtype``) over a text, after one untimed
    forward to warm the kernels: the library's time to first token, timed beside the server."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cpu_engine.engine import DTYPES
    from cpu_engine.heap import retain_freed_memory

    retain_freed_memory()  # as the server's engines (cpu_engine/heap.py)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=DTYPES[dtype]).eval()
    forward_seconds(target, tokenizer, "def warm_up():\n    return 0\n" * 20)
    return lambda text: forward_seconds(target, tokenizer, text)


def copy_length(prompts: Sequence[Prompt]) -> int:
    """The copy-heavy set's nominal length: its median prompt's tokens."""
    return int(statistics.median(p.tokens for p in prompts))


def server_inputs(mode: str, prompt: str, max_tokens: int, fixed_window: int):
    from tools.client import build_inputs

    options = {"plain": {"speculation_window": 0}, "adaptive": {},
               "fixed": {"speculation_window": fixed_window, "adaptive_window": False},
               **{drafter: {"drafter": drafter} for drafter in DRAFTER_MODES}}[mode]
    return build_inputs(prompt, max_tokens, temperature=0.0, **options)


def run_server(url: str, mode: str, prompts: list[Prompt], concurrency: int, max_tokens: int, fixed_window: int,
               length: int, tag: str = "", seconds: float | None = None, prompt_set: str = HUMANEVAL,
               into: Measurement | None = None) -> Measurement:
    """``concurrency`` streams at once, each running every prompt (stream i starts at prompt i);
    with ``seconds``, each stream goes on through the prompts until that time has passed.
    With ``into``, the burst is added to that measurement (its seconds, requests, texts).

    With ``tag``, each request's prompt starts with a comment line of its own
    (tag, stream, step), so no request reuses the KV cache another run left
    behind: every run pays its prompts' prefill, as a new user's request does."""
    import tritonclient.grpc as grpcclient

    from tools.client import stream_completion

    measurement = into or Measurement(f"server {mode}", length, concurrency, prompt_set)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def stream(index: int) -> None:
        try:
            with grpcclient.InferenceServerClient(url) as client:
                step = 0
                while step < len(prompts) if seconds is None else time.perf_counter() - started < seconds:
                    prompt = prompts[(index + step) % len(prompts)]
                    text = f"# {tag} {index}.{step}\n{prompt.text}" if tag else prompt.text
                    completion = stream_completion(client, server_inputs(mode, text, max_tokens, fixed_window))
                    with lock:
                        _record(measurement, prompt, completion)
                    step += 1
        except BaseException as error:  # reported after the run
            errors.append(error)

    stolen, started = host_steal_seconds(), time.perf_counter()
    workers = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    measurement.seconds += time.perf_counter() - started
    measurement.add_steal(stolen, host_steal_seconds())
    if errors:
        raise BenchError(f"server {mode} at {concurrency} streams: {errors[0]}")
    return measurement


def run_load(burst: Callable[..., Measurement], modes: Sequence[str], bursts: int) -> list[Measurement]:
    """Each mode's ``bursts`` bursts at one load, the modes' order turned by one from burst to
    burst (plain, default, default, plain: ABBA), each mode's bursts summed into one measurement.
    A shared host's speed drifts from minute to minute; run mode after mode, one mode would
    meet the drift alone. ``burst(mode, number, into)`` runs one burst."""
    merged: dict[str, Measurement | None] = dict.fromkeys(modes)
    for number in range(bursts):
        for mode in turned(modes, number):
            merged[mode] = burst(mode, number, merged[mode])
    return [merged[mode] for mode in modes]


def turned(modes: Sequence[str], by: int) -> list[str]:
    """``modes`` turned by ``by`` places: the order of the ``by``-th prompt or burst."""
    return list(modes[by % len(modes):]) + list(modes[:by % len(modes)])


def run_one_stream(url: str, modes: Sequence[str], prompts: list[Prompt], max_tokens: int, fixed_window: int,
                   length: int, prompt_set: str = HUMANEVAL, metrics_url: str | None = None,
                   one_forward: tuple[str, Callable[[str], float]] | None = None) -> list[Measurement]:
    """Every mode on every prompt, one request at a time, the modes' order turned
    by one from prompt to prompt: run mode after mode, the first would always meet
    the server's least-learnt estimates and the last the most. Each mode's seconds
    are its own requests' wall time; each request's prompt starts with a line of
    its own, so none reuses the KV cache of another. With ``metrics_url``, the
    engines' forward counters are read around each request (Measurement.overhead_per_round),
    and a request's time runs until the engines are idle again: work it left
    running (the draft's catch-up on a prompt it did not need in the end) is
    charged to it, not to the next request, which it would slow down."""
    import tritonclient.grpc as grpcclient

    from tools.client import stream_completion

    measurements = {mode: Measurement(f"server {mode}", length, 1, prompt_set) for mode in modes}
    beside = Measurement(ONE_FORWARD_BESIDE, length, 1, prompt_set, dtype=one_forward[0]) if one_forward else None
    try:
        with grpcclient.InferenceServerClient(url) as client:
            for step, prompt in enumerate(prompts):
                time_forward(beside, one_forward, f"# forward {length} 1.{step} {RUN_ID}\n{prompt.text}")
                for mode in turned(modes, step):
                    text = f"# {mode} {length} 1.{step} {RUN_ID}\n{prompt.text}"
                    before = _forward_time(metrics_url)
                    stolen, started = host_steal_seconds(), time.perf_counter()
                    completion = stream_completion(client, server_inputs(mode, text, max_tokens, fixed_window))
                    wait_until_idle(metrics_url)
                    seconds = time.perf_counter() - started
                    measurements[mode].seconds += seconds
                    measurements[mode].add_steal(stolen, host_steal_seconds())
                    _record(measurements[mode], prompt, completion)
                    _meter(measurements[mode], before, _forward_time(metrics_url), seconds, completion)
                time_forward(beside, one_forward, f"# forward after {length} 1.{step} {RUN_ID}\n{prompt.text}")
    except Exception as error:  # noqa: BLE001 - reported as the run's error
        raise BenchError(f"server at one stream: {error}") from error
    return [measurements[mode] for mode in modes] + ([beside] if beside is not None else [])


def time_forward(beside: Measurement | None, one_forward: tuple[str, Callable[[str], float]] | None,
                 text: str) -> None:
    """The library's time to first token on ``text``, timed just before and again just after the
    server's requests on the same prompt: a host whose speed drifts within a prompt's requests then
    weighs on both sides of the ratio alike."""
    if beside is not None and one_forward is not None:
        beside.first_text.append(one_forward[1](text))


def wait_until_idle(metrics_url: str | None, timeout: float = 600.0, poll: float = 0.1,
                    running_calls=None) -> bool:
    """Wait until no engine has a call in flight (False: the engines export no such gauge or
    cannot be read, or ``timeout`` passed)."""
    if not metrics_url:
        return False
    if running_calls is None:
        from tools.scrape import engine_running_calls, fetch_metrics

        def running_calls():
            return engine_running_calls(fetch_metrics(metrics_url))

    deadline = time.monotonic() + timeout
    while True:
        try:
            calls = running_calls()
        except OSError:
            return False
        if not calls:
            return False
        if not any(calls.values()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)


def _metrics_text(metrics_url: str | None) -> str | None:
    """The server's metrics exposition (None without a metrics URL or where it does not answer)."""
    from tools.scrape import fetch_metrics

    if not metrics_url:
        return None
    try:
        return fetch_metrics(metrics_url)
    except OSError:
        return None


def _forward_time(metrics_url: str | None) -> dict[str, tuple[int, float]]:
    """The engines' forward counters now (empty without a metrics port or engine counters)."""
    from tools.scrape import engine_forward_time

    text = _metrics_text(metrics_url)
    return {} if text is None else engine_forward_time(text)


def _meter(measurement: Measurement, before: dict, after: dict, seconds: float, completion) -> None:
    if not before or before.keys() != after.keys():
        return
    for model in after:
        measurement.forwards[model] = measurement.forwards.get(model, 0) + after[model][0] - before[model][0]
        measurement.forward_seconds[model] = (measurement.forward_seconds.get(model, 0.0)
                                              + after[model][1] - before[model][1])
    measurement.metered_seconds += seconds
    measurement.rounds += completion.speculative_rounds + completion.plain_rounds


def _record(measurement: Measurement, prompt: Prompt, completion) -> None:
    measurement.requests += 1
    measurement.completion_tokens += completion.completion_tokens
    measurement.drafted += completion.draft_tokens
    measurement.accepted += completion.accepted_draft_tokens
    if completion.time_to_first_chunk is not None:
        measurement.first_text.append(completion.time_to_first_chunk)
    measurement.texts.setdefault(prompt.prompt_id, completion.text)
    if completion.fallback_reason:
        reason = completion.fallback_reason
        measurement.fallbacks[reason] = measurement.fallbacks.get(reason, 0) + 1


# -- summary -----------------------------------------------------------------------

FORECAST_ERRORS = "specdec_forecast_epoch_error_ratio"
FORECAST_AIM = 0.15  # the batch forecast's aim: a run's median epoch within 15 % of what it measured


def forecast_accuracy(before: str, after: str) -> dict[str, dict]:
    """Per regime, the load governor's epochs between two scrapes of the metrics: how many,
    how many forecast within FORECAST_AIM, and the bucket the median error falls in."""
    from tools.scrape import histogram_counts

    accuracy = {}
    for regime in ("plain", "speculate"):
        earlier = histogram_counts(before, FORECAST_ERRORS, regime=regime)
        counts = {bound: count - earlier.get(bound, 0.0)
                  for bound, count in sorted(histogram_counts(after, FORECAST_ERRORS, regime=regime).items())}
        epochs = counts.get(math.inf, 0.0)
        if not epochs or FORECAST_AIM not in counts or -FORECAST_AIM not in counts:
            continue
        bounds = list(counts)
        median = next(i for i, bound in enumerate(bounds) if counts[bound] >= epochs / 2)
        accuracy[regime] = {"epochs": int(epochs), "within_aim": int(counts[FORECAST_AIM] - counts[-FORECAST_AIM]),
                            "median_between": [bounds[median - 1] if median else -math.inf, bounds[median]]}
    return accuracy


def summarise(measurements: list[Measurement], identity: list[Measurement], bound: Bound | None = None) -> dict:
    """Rows with ratios: vs plain transformers generate (same prompt length; concurrency 1 for the peer), vs the
    server's plain mode at the same concurrency and length, vs the same system's one-stream throughput, and
    (server rows of ``bound``'s prompts) vs what the machine's forwards allow at the row's acceptance.
    ``identity``: one run per server mode on the same prompts (plain first), whose texts must agree."""
    def find(system, length, concurrency, prompt_set=HUMANEVAL):
        return fastest_peer([m for m in measurements if m.system == system and m.prompt_tokens == length
                             and m.concurrency == concurrency and m.prompt_set == prompt_set])

    rows, mismatches = [], []
    for m in measurements:
        reference = find(PLAIN_GENERATE, m.prompt_tokens, 1, m.prompt_set)
        assisted = find(ASSISTED, m.prompt_tokens, 1, m.prompt_set)
        plain = find("server plain", m.prompt_tokens, m.concurrency, m.prompt_set)
        alone = find(m.system, m.prompt_tokens, 1, m.prompt_set)
        forward = (find(ONE_FORWARD_BESIDE, m.prompt_tokens, 1, m.prompt_set)
                   or find(ONE_FORWARD, m.prompt_tokens, 1, m.prompt_set))
        rate = m.tokens_per_second
        ratio = (lambda other: rate / other.tokens_per_second
                 if rate and other is not None and other.tokens_per_second else None)
        row = {
            "system": m.system, "dtype": m.dtype, "prompt_set": m.prompt_set, "prompt_tokens": m.prompt_tokens,
            "concurrency": m.concurrency,
            "requests": m.requests, "completion_tokens": m.completion_tokens, "seconds": m.seconds,
            "tokens_per_second": rate, "vs_transformers_generate": ratio(reference),
            "vs_transformers_assisted": ratio(assisted),
            "vs_server_plain": ratio(plain) if m.system.startswith("server") else None,
            "vs_one_stream": ratio(alone) if m.system.startswith("server") else None,
            "p50_first_text_seconds": m.p50_first_text,
            "first_text_vs_server_plain": (m.p50_first_text / plain.p50_first_text
                                           if plain is not None and m.p50_first_text and plain.p50_first_text
                                           else None),
            "first_text_vs_one_forward": (m.p50_first_text / forward.p50_first_text
                                          if m.system.startswith("server") and m.concurrency == 1
                                          and forward is not None and m.p50_first_text else None),
            "acceptance": m.accepted / m.drafted if m.drafted else None,
            "ceiling_tokens_per_second": None, "vs_ceiling": None,
            "overhead_per_round_in_target_forwards": m.overhead_per_round,
            "steal_seconds": m.steal_seconds,
        }
        if (bound is not None and m.system.startswith("server") and m.prompt_set == HUMANEVAL
                and m.prompt_tokens == bound.prompt_tokens):
            row["ceiling_tokens_per_second"] = bound.tokens_per_second(m.concurrency, row["acceptance"])
            row["vs_ceiling"] = rate / row["ceiling_tokens_per_second"] if rate else None
        rows.append(row)
    for m in identity[1:]:
        for prompt_id, text in m.texts.items():
            if text != identity[0].texts.get(prompt_id):
                mismatches.append({"system": m.system, "prompt": prompt_id, "concurrency": m.concurrency})
    engine = {m.prompt_tokens: m for m in measurements if m.system == ENGINE and m.prompt_set == HUMANEVAL}
    overhead, net = {}, {}
    for length, m in engine.items():
        plain = find("server plain", length, 1)
        if plain is not None and plain.tokens_per_second and m.tokens_per_second:
            overhead[str(length)] = m.tokens_per_second / plain.tokens_per_second - 1
        if plain is not None and plain.tokens_per_unstolen_second and m.tokens_per_unstolen_second:
            net[str(length)] = m.tokens_per_unstolen_second / plain.tokens_per_unstolen_second - 1
    return {"rows": rows, "mismatches": mismatches, "serving_overhead": overhead,
            "serving_overhead_net_of_steal": net}


def fastest_peer(candidates: Sequence[Measurement]) -> Measurement | None:
    """Of one system's measurements in several dtypes, the one a user would keep: the most tokens/s,
    or, for a time-only measurement (one forward over the prompt), the shortest p50 time."""
    if not candidates:
        return None
    if any(m.tokens_per_second for m in candidates):
        return max(candidates, key=lambda m: m.tokens_per_second or 0.0)
    return min(candidates, key=lambda m: m.p50_first_text if m.p50_first_text is not None else float("inf"))


def fastest_forward_dtype(measurements: Sequence[Measurement]) -> str | None:
    """The dtype whose one forward over the prompts took least in all (None: none measured)."""
    totals: dict[str, float] = {}
    for m in measurements:
        if m.system == ONE_FORWARD and m.dtype and m.first_text:
            totals[m.dtype] = totals.get(m.dtype, 0.0) + sum(m.first_text)
    return min(totals, key=totals.get, default=None)


def _progress_line(m: Measurement) -> str:
    if m.tokens_per_second is None:  # a time only (one forward over the prompt)
        return f"{m.system}, {m.prompt_set} {m.prompt_tokens}-token prompts: p50 {m.p50_first_text:.2f} s"
    stopped = "".join(f"; {count}x stopped speculating: {reason}" for reason, count in m.fallbacks.items())
    return (f"{m.system}, {m.prompt_set} {m.prompt_tokens}-token prompts, {m.concurrency} streams: "
            f"{m.tokens_per_second:.2f} tok/s total, {m.accepted}/{m.drafted} drafted tokens accepted{stopped}")


def row_label(row: dict) -> str:
    """A row's system, with its dtype where it has one (the in-process peers)."""
    return f"{row['system']} ({row['dtype']})" if row.get("dtype") else row["system"]


def _fmt(value, spec=".2f", suffix=""):
    return "–" if value is None else f"{value:{spec}}{suffix}"


def format_table(summary: dict) -> str:
    lines = ["| system | prompts (tokens) | streams | tok/s (total) | vs transformers generate | vs assisted "
             "| vs server plain | vs one stream | p50 first text s | first text vs plain "
             "| first text vs one transformers forward | acceptance | vs ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(
            f"| {row_label(r)} | {r['prompt_set']} {r['prompt_tokens']} | {r['concurrency']} | {_fmt(r['tokens_per_second'])} | "
            f"{_fmt(r['vs_transformers_generate'], '.2f', 'x')} | {_fmt(r['vs_transformers_assisted'], '.2f', 'x')} | "
            f"{_fmt(r['vs_server_plain'], '.2f', 'x')} | {_fmt(r['vs_one_stream'], '.2f', 'x')} | "
            f"{_fmt(r['p50_first_text_seconds'])} | {_fmt(r['first_text_vs_server_plain'], '.2f', 'x')} | "
            f"{_fmt(r['first_text_vs_one_forward'], '.2f', 'x')} | {_fmt(r['acceptance'])} | "
            f"{_fmt(r.get('vs_ceiling'), '.0%')} |")
    notes = []
    if summary["serving_overhead"]:  # not measured when the in-process peers were skipped
        notes.append("serving overhead (in-process engine tok/s over server plain tok/s, one stream, minus 1): "
                     + ", ".join(f"{k}-token prompts {v:+.1%}" for k, v in summary["serving_overhead"].items()))
    if summary.get("serving_overhead_net_of_steal"):
        notes.append("the same over the wall clock less the CPU time the hypervisor stole (on a shared host the "
                     "runs meet different neighbours): " + ", ".join(
                         f"{k}-token prompts {v:+.1%}" for k, v in summary["serving_overhead_net_of_steal"].items()))
    stolen = [r for r in summary["rows"] if r.get("steal_seconds") is not None and r["seconds"]]
    if stolen:
        notes.append("hypervisor steal (stolen CPU seconds, summed over the vCPUs, per second of the run): " + ", ".join(
            f"{r['system']} {r['prompt_set']} {r['prompt_tokens']} x{r['concurrency']} "
            f"{r['steal_seconds'] / r['seconds']:.0%}" for r in stolen))
    bounded = [r for r in summary["rows"] if r.get("ceiling_tokens_per_second")]
    if bounded:
        notes.append("vs ceiling: the row's tok/s over what this machine's forwards allow for the same requests at "
                     "the row's acceptance (tools/ceiling.py: streams in step, no serving cost, the draft model at "
                     "its best window; plain decoding's for plain): " + ", ".join(
                         f"{r['system']} x{r['concurrency']} {r['ceiling_tokens_per_second']:.2f} tok/s"
                         for r in bounded))
    metered = [r for r in summary["rows"] if r.get("overhead_per_round_in_target_forwards") is not None]
    if metered:
        notes.append("serving stack's time per round (request wall time outside the engines' forwards, per "
                     "round, over one target forward; a lower bound where the draft's background prefill overlaps "
                     "the target's forwards): " + ", ".join(
                         f"{r['system']} {r['prompt_set']} {r['prompt_tokens']} "
                         f"{r['overhead_per_round_in_target_forwards']:.1%}" for r in metered))
    for regime, found in summary.get("forecast_accuracy", {}).items():
        low, high = found["median_between"]
        notes.append(f"the load governor's batch forecast against its {regime} epochs at more than one stream: "
                     f"{found['within_aim']} of {found['epochs']} within {FORECAST_AIM:.0%}, the median error "
                     f"between {low:+.0%} and {high:+.0%}")
    notes += [f"MISMATCH: {m['system']} at {m['concurrency']} streams differs from server plain on {m['prompt']}"
              for m in summary["mismatches"]]
    if not summary["mismatches"]:
        notes.append("every speculative text equals the server's plain text (greedy, same prompts, all modes "
                     "in a crowd); the timed runs give each request a first line of its own, so none reuses "
                     "another run's KV cache")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def write_png(path: str, summary: dict, title: str) -> None:
    """Left: each server mode's total tokens/s by concurrency (shortest prompts); right: every
    system at one stream by prompt length; both over plain transformers generate."""
    plt = require_matplotlib()
    rows = [r for r in summary["rows"] if r["prompt_set"] == HUMANEVAL]
    shortest = min(r["prompt_tokens"] for r in rows)
    figure, (by_streams, by_length) = plt.subplots(1, 2, figsize=(13, 5))
    try:
        servers = [s for s in dict.fromkeys(r["system"] for r in rows) if s.startswith("server")]
        levels = sorted({r["concurrency"] for r in rows})
        _grouped_bars(by_streams, rows, servers, [(shortest, c) for c in levels],
                      [f"{c} stream{'s' if c > 1 else ''}" for c in levels])
        by_streams.set_ylabel("total tok/s over plain transformers generate (1 stream)")
        by_streams.set_title(f"{shortest}-token prompts, by concurrency")
        lengths = sorted({r["prompt_tokens"] for r in rows})
        _grouped_bars(by_length, rows, list(dict.fromkeys(row_label(r) for r in rows if r["concurrency"] == 1
                                                          and r["tokens_per_second"] is not None)),
                      [(n, 1) for n in lengths], [f"{n} tokens" for n in lengths])
        by_length.set_title("one stream, by prompt length")
        save_figure(figure, path, title)
    finally:
        plt.close(figure)


def _grouped_bars(axis, rows, systems, groups, labels) -> None:
    """One bar per system in each (prompt tokens, concurrency) group: its ratio to plain transformers generate."""
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        values = [next((r["vs_transformers_generate"] or 0 for r in rows if row_label(r) == system
                        and (r["prompt_tokens"], r["concurrency"]) == group), 0) for group in groups]
        bars = axis.bar([x + i * width for x in range(len(groups))], values, width, label=system)
        axis.bar_label(bars, fmt="%.2f", fontsize=7)
    axis.axhline(1.0, color="0.3", linewidth=1, linestyle="--")
    axis.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(groups))], labels)
    axis.legend(fontsize=8)


def machine() -> str:
    """The CPU this ran on (README numbers say which machine they came from)."""
    model = platform.processor() or "unknown CPU"
    flags = set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name") and model in ("", "unknown CPU", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} vCPU, {' '.join(features) or 'no AVX2'}"


# -- command line --------------------------------------------------------------------

def parse_modes(text: str) -> tuple[str, ...]:
    """The server modes named, plain first (it is every ratio's and the identity check's reference)."""
    known = SERVER_MODES + DRAFTER_MODES
    named = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in named if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode {unknown[0]!r}; modes: {', '.join(known)}")
    return ("plain", *dict.fromkeys(name for name in named if name != "plain"))


def parse_dtypes(text: str) -> tuple[str, ...]:
    named = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in named if name not in PEER_DTYPES]
    if unknown or not named:
        raise argparse.ArgumentTypeError(f"unknown dtype {(unknown or [text])[0]!r}; dtypes: {', '.join(PEER_DTYPES)}")
    return named


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-compare", description=__doc__.split("\n\n")[0].replace("``", ""),
                                     epilog="Start the server first (`make serve`). Exit status: 0 ok, 1 a "
                                     "speculative text differed from plain decoding, 2 usage or server error.")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default localhost:8001)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    parser.add_argument("--concurrency", type=parse_windows, default=[1, 2, 4, 8], metavar="N,N,...",
                        help="streams at once for the server runs (default 1,2,4,8; at the shortest prompt "
                             "length; one stream always runs, its modes interleaved prompt by prompt)")
    parser.add_argument("--prompt-tokens", type=parse_windows, default=[150, 300, 750, 2000], metavar="N,N,...",
                        help="prompt lengths (default 150,300,750,2000; longer ones run at one stream)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per length (default 2)")
    parser.add_argument("--fixed-window", type=int, default=4, help="window of the fixed mode (default 4)")
    parser.add_argument("--no-copy", dest="copy", action="store_false",
                        help="skip the copy-heavy prompt set (held-out functions shown, then continued again)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the in-process peers (default 2, the engines' num_threads)")
    parser.add_argument("--warmup-seconds", type=float, default=45.0,
                        help="before each server run at more than one stream, the same load for this long, "
                        "unmeasured: a server in service has measured its load (default 45: the load governor "
                        "measures each regime for two 10 s epochs)")
    parser.add_argument("--bursts", type=int, default=2,
                        help="bursts of each mode at each load of more than one stream, the modes' order turned "
                        "from burst to burst (default 2: plain, default, default, plain), so the host's drift "
                        "falls on every mode alike")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics",
                        help="the server's metrics; one-stream runs read the engines' forward counters around each "
                        "request to report the serving stack's time per round ('' to skip; default %(default)s)")
    parser.add_argument("--skip-peers", action="store_true", help="only the server runs")
    parser.add_argument("--peer-dtypes", type=parse_dtypes, default=PEER_DTYPES, metavar="D,D",
                        help="dtypes the transformers peers run in; every ratio is taken against each peer's "
                        f"fastest (default {','.join(PEER_DTYPES)})")
    parser.add_argument("--modes", type=parse_modes, default=SERVER_MODES + DRAFTER_MODES, metavar="M,M,...",
                        help=f"server modes to run (default {','.join(SERVER_MODES + DRAFTER_MODES)}; adaptive is "
                        "the server's defaults; plain always runs: every ratio and the identity check need it)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--png", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH", help="write the table (for the README's Measured section)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.bursts < 1:
            raise BenchError(f"--bursts must be at least 1, got {args.bursts}")
        if args.max_tokens < 1 or args.prompts < 1 or not args.concurrency or not args.prompt_tokens:
            raise BenchError("--max-tokens and --prompts must be at least 1; --concurrency and --prompt-tokens "
                             "need a value")
        if args.png:
            require_matplotlib()
        from tokenizers import Tokenizer

        from coordinator.settings import CoordinatorSettings
        from launcher.assets import DEFAULT_DRAFT, DEFAULT_TARGET, default_cache_dir, prepare_model

        target_dir = prepare_model(DEFAULT_TARGET, default_cache_dir(), "target")
        draft_dir = prepare_model(DEFAULT_DRAFT, default_cache_dir(), "draft")
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        count = lambda text: len(tokenizer.encode(text).ids)  # noqa: E731
        prompts = held_out_prompts(sorted(args.prompt_tokens), args.prompts, count)
        copy = copy_prompts(args.prompts, count) if args.copy else []
        started = datetime.datetime.now(datetime.timezone.utc)
        measurements: list[Measurement] = []
        bound = one_forward = None  # one_forward: (dtype, seconds of a forward over a text)
        if not args.skip_peers:
            progress("peers, in-process (the server is idle meanwhile)")
            settings = server_engine_settings(args.url)
            measurements += run_peers(target_dir, draft_dir, prompts, args.max_tokens, args.threads, progress,
                                      copy, CoordinatorSettings().speculation_window, args.peer_dtypes, settings)
            progress("the ceiling: the target's and the draft's forwards, timed in-process")
            bound = measure_bound(target_dir, draft_dir, args.concurrency, min(prompts), args.max_tokens,
                                  CoordinatorSettings().speculation_window, settings.get("max_num_tokens", 512))
            progress(release_peers_memory())
            forward_dtype = fastest_forward_dtype(measurements)
            if forward_dtype:
                progress(f"{ONE_FORWARD} in {forward_dtype}, loaded to run beside the server's one-stream requests")
                one_forward = (forward_dtype, one_forward_timer(target_dir, forward_dtype))
        shortest = min(prompts)
        # One stream: the modes interleaved prompt by prompt (run_one_stream).
        modes = args.modes
        server_modes = tuple(mode for mode in modes if mode in SERVER_MODES)  # the drafters alone: one stream
        one_stream = [(HUMANEVAL, shortest, prompts[shortest], modes)]
        one_stream += [(HUMANEVAL, length, prompts[length], server_modes) for length in sorted(prompts)
                       if length != shortest]
        if copy:
            one_stream.append((COPY, copy_length(copy), copy, modes))
        for prompt_set, length, group, group_modes in one_stream:
            for m in run_one_stream(args.url, group_modes, group, args.max_tokens, args.fixed_window, length,
                                    prompt_set, metrics_url=args.metrics_url or None,
                                    one_forward=one_forward if prompt_set == HUMANEVAL else None):
                measurements.append(m)
                progress(_progress_line(m))
        one_forward = None  # the model's memory back before the loads
        before_loads = _metrics_text(args.metrics_url)
        for concurrency in sorted(set(args.concurrency) - {1}):
            for mode in server_modes:
                if args.warmup_seconds > 0:  # the same load, unmeasured
                    run_server(args.url, mode, prompts[shortest], concurrency, args.max_tokens, args.fixed_window,
                               shortest, tag=f"warm-up {mode} {shortest} {concurrency} {RUN_ID}",
                               seconds=args.warmup_seconds)

            def burst(mode, number, into, concurrency=concurrency):
                return run_server(args.url, mode, prompts[shortest], concurrency, args.max_tokens,
                                  args.fixed_window, shortest, tag=f"{mode} {shortest} {concurrency} {RUN_ID}.{number}",
                                  into=into)

            for m in run_load(burst, server_modes, args.bursts):
                measurements.append(m)
                progress(_progress_line(m))
        after_loads = _metrics_text(args.metrics_url)
        # Identity: the same prompts in every mode, in a crowd of the largest concurrency,
        # and the first prompt of every longer length at one stream.
        crowd = max(args.concurrency)
        identity = []
        for mode in modes:
            run = run_server(args.url, mode, prompts[shortest] + copy, crowd, args.max_tokens, args.fixed_window,
                             shortest)
            for length in sorted(prompts):
                if length != shortest and mode in server_modes:
                    longer = run_server(args.url, mode, prompts[length][:1], 1, args.max_tokens, args.fixed_window,
                                        length)
                    run.texts.update(longer.texts)
            identity.append(run)
        progress(f"identity pass: {len(modes)} modes, {crowd} streams; one prompt of each longer length alone")
    except (BenchError, PromptError) as error:
        print(f"specdec-compare: {error}", file=sys.stderr)
        return EXIT_ERROR
    summary = summarise(measurements, identity, bound)
    if before_loads is not None and after_loads is not None:
        summary["forecast_accuracy"] = forecast_accuracy(before_loads, after_loads)
    table = format_table(summary)
    where = machine()
    print(f"\n{where}; greedy, max_tokens {args.max_tokens}, prompts per length {args.prompts}\n\n{table}")
    code = EXIT_MISMATCH if summary["mismatches"] else EXIT_OK
    if args.json:
        write_json(args.json, {"command": " ".join(["specdec-compare", *argv]), "machine": where,
                               "timestamp": started.isoformat(timespec="seconds"), "summary": summary,
                               "prompts": {str(k): [asdict(p) | {"text": None} for p in v] for k, v in prompts.items()},
                               "measurements": [asdict(m) | {"texts": None} for m in measurements],
                               "exit_code": code})
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(f"Measured on {where} with `specdec-compare {' '.join(argv)}`.\n\n{table}\n")
    if args.png:
        write_png(args.png, summary, f"{where}, greedy, {args.max_tokens} tokens")
    return code


if __name__ == "__main__":
    sys.exit(main())
