"""The checks of the GPU smoke test that need Python (docker/gpu-smoke.sh).

docker/gpu-smoke.sh runs this file with the serving image's own interpreter,
in a client container next to the server (``docker run --network host`` of
the same image, as user 10001 on a read-only root filesystem). The file is
mounted at /opt/specdec/smoke/gpu_smoke.py, so an image built before it
existed runs it too; it imports only what the image has (tritonclient,
numpy, tokenizers and the repository's ``coordinator`` and ``tools``), and
``openai`` in the one check that installs it first.

    python3 gpu_smoke.py <check> [options]        (``--help`` lists the checks)

Each check prints progress on stderr and what it found on stdout, ending in
a markdown table that the shell script copies into its report, and exits
PASS (0), FAIL (1) or SKIP (77, with the reason). The arithmetic (agreement
and first differences, the two-sample distribution test, percentiles,
picking the draft's executor worker, the recovery timeline, the tables) is
pure Python and tested offline (tests/unit/test_gpu_smoke.py); everything
that talks to a server is imported inside the check that needs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PASS, FAIL, SKIP = 0, 1, 77

# Significance level of the distribution check: the chance that it fails when
# speculative and plain sampling do have the same distribution (a false alarm
# once in a thousand runs).
DEFAULT_ALPHA = 0.001
# Categories expected fewer than this many times in either sample are pooled
# into one, so the chi-square approximation holds.
MIN_EXPECTED = 5.0

# The executor worker that TensorRT-LLM's orchestrator mode spawns per model
# (executor_worker_path in model_repository/{target,draft}/configs/trtllm.pbtxt).
EXECUTOR_WORKER = "trtllmExecutorWorker"

# NVIDIA's end-to-end client (tensorrtllm_backend, inflight_batcher_llm/client/).
NVIDIA_CLIENT = "end_to_end_grpc_client.py"
NVIDIA_CLIENT_CANDIDATES = (
    "/opt/tritonserver/tensorrtllm_backend/inflight_batcher_llm/client",
    "/opt/tritonserver/inflight_batcher_llm/client",
    "/tensorrtllm_backend/inflight_batcher_llm/client",
    "/app/tensorrtllm_backend/inflight_batcher_llm/client",
    "/app/inflight_batcher_llm/client",
    "/workspace/tensorrtllm_backend/inflight_batcher_llm/client",
)
# Searched (bounded in time) when none of the candidates holds the client.
NVIDIA_CLIENT_SEARCH_ROOTS = ("/opt", "/app", "/workspace", "/usr/local", "/tensorrtllm_backend")

# Sixteen short code prompts for the greedy agreement check.
PROMPTS = (
    "def fibonacci(n):",
    "def is_prime(n):",
    "def quicksort(xs):",
    "def binary_search(items, target):",
    "def merge_sorted(a, b):",
    "def reverse_words(sentence):",
    "def gcd(a, b):",
    "def flatten(nested):",
    "class Stack:\n    def __init__(self):",
    "def word_count(text):",
    "def transpose(matrix):",
    "def is_palindrome(s):",
    "import json\n\ndef load_config(path):",
    "def moving_average(values, window):",
    "def parse_csv_line(line):",
    "def factorial(n):",
)
# The sampled check's prompt: its first tokens are open (a colour, a fruit, ...).
DISTRIBUTION_PROMPT = "import random\n\n# Pick one at random and print it\nchoice = random.choice(["


# ------------------------------------------------------------ pure helpers ----

def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first position where ``a`` and ``b`` differ; None when they are equal.
    When one is a prefix of the other, the length of the shorter."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Agreement:
    """How many pairs are identical, and where each pair first differs (None: identical)."""

    first_differences: list[int | None]

    @property
    def total(self) -> int:
        return len(self.first_differences)

    @property
    def identical(self) -> int:
        return sum(1 for d in self.first_differences if d is None)

    @property
    def share(self) -> float:
        return self.identical / self.total if self.total else 0.0


def agreement(pairs: Iterable[tuple[Sequence, Sequence]]) -> Agreement:
    return Agreement([first_difference(a, b) for a, b in pairs])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square distributed with ``dof`` (a positive
    integer) degrees of freedom, by its exact closed forms. The losslessness
    tests' statistics (tests/stats.py) use this one too."""
    if dof <= 0 or int(dof) != dof:
        raise ValueError(f"a chi-square distribution needs a positive whole number of degrees of freedom, got {dof}")
    if statistic <= 0.0:
        return 1.0
    half = statistic / 2
    if dof % 2 == 0:  # exp(-x/2) sum_{i < dof/2} (x/2)^i / i!
        term = total = 1.0
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return math.exp(-half) * total
    # 2 Q(sqrt x) + 2 phi(sqrt x) sum_{r=1}^{(dof-1)/2} x^{(2r-1)/2} / (1*3*...*(2r-1))
    root = math.sqrt(statistic)
    total = math.erfc(root / math.sqrt(2))
    term = math.sqrt(2 / math.pi) * math.exp(-half) * root
    for r in range(1, (dof - 1) // 2 + 1):
        total += term
        term *= statistic / (2 * r + 1)
    return total


@dataclass
class DistributionCheck:
    """Two samples of categories tested for one distribution (chi-square test
    of homogeneity), with their total variation distance for scale."""

    statistic: float
    dof: int
    p_value: float
    total_variation: float
    alpha: float
    categories: int  # after pooling the rare ones
    sizes: tuple[int, int]

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    def describe(self) -> str:
        verdict = "same distribution not rejected" if self.passed else "DIFFERENT distributions"
        return (f"chi-square {self.statistic:.2f} with {self.dof} degrees of freedom, p = {self.p_value:.4g} "
                f"(threshold {self.alpha:g}: {verdict}); total variation distance {self.total_variation:.3f}; "
                f"{self.categories} categories after pooling those expected < {MIN_EXPECTED:g} times; "
                f"samples {self.sizes[0]} and {self.sizes[1]}")


def total_variation(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """Half the L1 distance between the two samples' empirical distributions."""
    if not a or not b:
        raise ValueError("both samples must be non-empty")
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in set(ca) | set(cb))


def distribution_check(a: Sequence[Hashable], b: Sequence[Hashable], alpha: float = DEFAULT_ALPHA,
                       min_expected: float = MIN_EXPECTED) -> DistributionCheck:
    """Chi-square test that samples ``a`` and ``b`` come from one distribution
    over categories. Categories whose expected count falls below
    ``min_expected`` in either sample are pooled into one; when fewer than two
    categories remain, nothing can tell the samples apart (p = 1)."""
    if not a or not b:
        raise ValueError("both samples must be non-empty")
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    kept, pooled = [], [0, 0]
    for key in sorted(set(ca) | set(cb), key=repr):
        together = ca[key] + cb[key]
        if min(na, nb) * together / n >= min_expected:
            kept.append((ca[key], cb[key]))
        else:
            pooled[0] += ca[key]
            pooled[1] += cb[key]
    if sum(pooled):
        kept.append(tuple(pooled))
    tv = total_variation(a, b)
    if len(kept) < 2:
        return DistributionCheck(0.0, 0, 1.0, tv, alpha, len(kept), (na, nb))
    statistic = 0.0
    for count_a, count_b in kept:
        together = count_a + count_b
        for count, size in ((count_a, na), (count_b, nb)):
            expected = size * together / n
            statistic += (count - expected) ** 2 / expected
    dof = len(kept) - 1
    return DistributionCheck(statistic, dof, chi2_sf(statistic, dof), tv, alpha, len(kept), (na, nb))


@dataclass
class Process:
    pid: int
    args: str

    @property
    def program(self) -> str:
        return os.path.basename(self.args.split(" ", 1)[0]) if self.args else ""


def parse_process_table(text: str) -> list[Process]:
    """``docker top <container> -eo pid,args`` (a header line, then ``PID ARGS``)."""
    processes = []
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].isdigit():
            processes.append(Process(int(parts[0]), parts[1]))
    return processes


def parse_compute_apps(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``:
    pid -> MiB of GPU memory (processes whose memory nvidia-smi cannot read are left out)."""
    memory = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            memory[int(parts[0])] = memory.get(int(parts[0]), 0) + int(parts[1])
    return memory


def pick_draft_worker(processes: Sequence[Process], gpu_mib: dict[int, int]) -> tuple[Process | None, str]:
    """The draft's TensorRT-LLM executor worker among a container's processes.

    In orchestrator mode every tensorrtllm model spawns one worker whose command
    line is the executor_worker_path alone: it does not say which engine it
    serves. Both engines share one GPU, and the target's KV-cache share (0.60
    of the free memory against the draft's 0.25) and its weights (never
    smaller than the draft's) make it the larger holder of GPU memory, so the
    draft's worker is the one holding less. Returns (None, why) when that
    cannot be decided."""
    workers = [p for p in processes if p.program == EXECUTOR_WORKER]
    if not workers:
        programs = ", ".join(sorted({p.program for p in processes})) or "none"
        return None, f"no {EXECUTOR_WORKER} process in the container (its programs: {programs})"
    if len(workers) != 2:
        return None, (f"{len(workers)} {EXECUTOR_WORKER} processes (pids "
                      f"{', '.join(str(w.pid) for w in workers)}); expected two, the target's and the draft's")
    unknown = [w.pid for w in workers if w.pid not in gpu_mib]
    if unknown:
        return None, (f"nvidia-smi reports no GPU memory for worker pid(s) {unknown}, so the draft's "
                      "cannot be told from the target's")
    small, large = sorted(workers, key=lambda w: gpu_mib[w.pid])
    if gpu_mib[small.pid] == gpu_mib[large.pid]:
        return None, f"both workers hold {gpu_mib[small.pid]} MiB of GPU memory; cannot tell which is the draft's"
    return small, (f"pid {small.pid} holds {gpu_mib[small.pid]} MiB of GPU memory, the other worker "
                   f"(pid {large.pid}) {gpu_mib[large.pid]} MiB; the draft's is the smaller")


DRAFTING, PLAIN, ERROR = "drafting", "plain", "error"


@dataclass
class Recovery:
    """When drafting stopped after the kill and when it came back (seconds after the kill)."""

    interrupted_at: float | None
    recovered_at: float | None
    verdict: str

    @property
    def passed(self) -> bool:
        return self.interrupted_at is not None and self.recovered_at is not None


def recovery_timeline(events: Sequence[tuple[float, str]], interrupt_within: float) -> Recovery:
    """``events``: (seconds after the kill, state) of the requests sent after it,
    in order; state DRAFTING (the draft model drafted), PLAIN (it did not) or
    ERROR (the request failed). Recovered: the first drafting request after
    one that was not. Drafting that never stopped within ``interrupt_within``
    seconds means the kill missed the draft."""
    stopped = next((i for i, (_, state) in enumerate(events) if state != DRAFTING), None)
    interrupted = None if stopped is None else events[stopped][0]
    if interrupted is None or interrupted > interrupt_within:
        if events:  # every request up to interrupt_within drafted
            return Recovery(None, None, f"drafting never stopped in the {interrupt_within:g} s after the kill: "
                                        "the killed process was not the draft's executor")
        return Recovery(None, None, "no request completed after the kill")
    recovered = next((t for t, state in events[stopped + 1:] if state == DRAFTING), None)
    if recovered is None:
        return Recovery(interrupted, None, f"drafting stopped {interrupted:.1f} s after the kill and did not come back")
    return Recovery(interrupted, recovered, f"drafting stopped {interrupted:.1f} s after the kill "
                                           f"and came back {recovered:.1f} s after it")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    def cell(value) -> str:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict_table(checks: Sequence[tuple[str, bool, str]]) -> str:
    return markdown_table(("check", "result", "detail"), [(name, "ok" if ok else "FAILED", detail)
                                                          for name, ok, detail in checks])


# ------------------------------------------------------ talking to the server ----

def say(message: str) -> None:
    print(f"gpu_smoke: {message}", file=sys.stderr, flush=True)


@dataclass
class Special:
    eos: list[int]
    pad: int


class Tokens:
    """The pair's tokenizer (tokenizer.json and special_tokens.json written by build_engines.sh)."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        path = Path(directory)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        special = json.loads((path / "special_tokens.json").read_text())
        self.special = Special([int(i) for i in special["eos_token_ids"]], int(special["pad_token_id"]))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def _grpc_client(url: str):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url)


def engine_arrays(input_ids: Sequence[int], output_len: int, end_id: int, pad_id: int, *, streaming: bool = False,
                  draft: Sequence[int] = (), return_logits: bool = False) -> dict:
    """A greedy request to a tensorrtllm model in the shapes NVIDIA's
    inflight_batcher_llm client sends (a leading batch dimension of 1), with
    only inputs that model_repository/target/configs/trtllm.pbtxt declares."""
    import numpy as np

    def scalar(value, dtype):
        return np.array([[value]], dtype=dtype)

    arrays = {
        "input_ids": np.asarray(input_ids, dtype=np.int32).reshape(1, -1),
        "input_lengths": scalar(len(input_ids), np.int32),
        "request_output_len": scalar(output_len, np.int32),
        "end_id": scalar(end_id, np.int32),
        "pad_id": scalar(pad_id, np.int32),
        "runtime_top_k": scalar(1, np.int32),
        "temperature": scalar(1.0, np.float32),
        "streaming": scalar(streaming, bool),
    }
    if draft:
        arrays["draft_input_ids"] = np.asarray(draft, dtype=np.int32).reshape(1, -1)
    if return_logits:
        arrays["return_generation_logits"] = scalar(True, bool)
    return arrays


def _infer_inputs(arrays: dict) -> list:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class EngineReply:
    """One response of a tensorrtllm model that carried tokens."""

    output_ids_shape: tuple
    sequence_length_shape: tuple
    tokens: list[int]
    logits_shape: tuple | None = None
    logits_argmax: list[int] = field(default_factory=list)


def call_engine(url: str, model: str, arrays: dict, timeout: float = 60.0) -> list[EngineReply]:
    """Send one request to a (decoupled) tensorrtllm model on a gRPC stream,
    asking for the outputs the coordinator asks for, and read every response
    until the final one, parsing output_ids with sequence_length as the
    coordinator does (coordinator/engines/tensors.py)."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    from coordinator.engines.tensors import REQUESTED_OUTPUTS, generated_tokens
    from coordinator.request.access import api_key_from_env, grpc_headers

    names = list(REQUESTED_OUTPUTS) + (["generation_logits"] if "return_generation_logits" in arrays else [])
    answers: queue.Queue = queue.Queue()
    replies = []
    finished = False
    deadline = time.monotonic() + timeout
    with _grpc_client(url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=timeout + 5,
                            headers=grpc_headers(api_key_from_env()))
        try:
            client.async_stream_infer(model, _infer_inputs(arrays), enable_empty_final_response=True,
                                      outputs=[grpcclient.InferRequestedOutput(name) for name in names])
            while True:
                try:
                    result, error = answers.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"{model}: no final response within {timeout:g} s") from None
                if error is not None:
                    raise RuntimeError(f"{model}: {error.message() if hasattr(error, 'message') else error}")
                output_ids = result.as_numpy("output_ids")
                if output_ids is not None:
                    lengths = result.as_numpy("sequence_length")
                    reply = EngineReply(tuple(output_ids.shape), tuple(np.asarray(lengths).shape),
                                        generated_tokens(output_ids, lengths))
                    logits = result.as_numpy("generation_logits")
                    if logits is not None and logits.size:
                        reply.logits_shape = tuple(logits.shape)
                        reply.logits_argmax = [int(i) for i in logits.reshape(-1, logits.shape[-1]).argmax(-1)]
                    replies.append(reply)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    finished = True
                    return replies
        finally:
            client.stop_stream(cancel_requests=not finished)


def _tokens_of(replies: Sequence[EngineReply]) -> list[int]:
    return [t for reply in replies for t in reply.tokens]


def check_engine_calls(args) -> int:
    """Step 4: direct calls to the target (and the draft) as NVIDIA's client makes them."""
    tokens = Tokens(args.tokenizer_dir)
    prompt = tokens.encode("def fibonacci(n):\n")
    eos, pad = tokens.special.eos[0], tokens.special.pad
    checks: list[tuple[str, bool, str]] = []
    n = args.output_len

    def check(name: str, ok: bool, detail: str) -> bool:
        checks.append((name, bool(ok), detail))
        say(f"{name}: {'ok' if ok else 'FAILED'}: {detail}")
        return bool(ok)

    def attempt(name: str, call: Callable[[], list[EngineReply]]) -> list[EngineReply] | None:
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - every failure is a finding
            check(name, False, f"request failed: {error}")
            return None

    # A. One non-streamed greedy request.
    replies = attempt("target, not streamed", lambda: call_engine(args.grpc, "target", engine_arrays(prompt, n, eos, pad)))
    if replies is None:
        print(verdict_table(checks))
        return FAIL
    reference = _tokens_of(replies)
    shapes = [(r.output_ids_shape, r.sequence_length_shape) for r in replies]
    check("target, not streamed: one response", len(replies) == 1, f"{len(replies)} responses with tokens")
    check("target, not streamed: shapes", all(len(o) == 3 and o[:2] == (1, 1) and s == (1, 1) for o, s in shapes),
          f"output_ids / sequence_length shapes {shapes} (expected [1, 1, L] / [1, 1])")
    check("target, not streamed: sequence_length", len(reference) == n or (len(reference) < n and eos not in reference),
          f"sequence_length {len(reference)} for request_output_len {n}: {tokens.decode(reference)!r}")
    # B. The same request streamed: a response per step, the same tokens.
    streamed = attempt("target, streamed", lambda: call_engine(args.grpc, "target",
                                                                 engine_arrays(prompt, n, eos, pad, streaming=True)))
    if streamed is not None:
        check("target, streamed: responses", len(streamed) > 1,
              f"{len(streamed)} responses, sequence_length per response {[len(r.tokens) for r in streamed]}")
        difference = first_difference(_tokens_of(streamed), reference)
        check("target, streamed: same tokens", difference is None,
              "the same tokens as the non-streamed request" if difference is None else
              f"{len(_tokens_of(streamed))} tokens, the first difference at token {difference}")
    # C. The end token stops generation (and is neither returned nor counted).
    stop_at = next((k for k in range(1, len(reference)) if reference[k] not in reference[:k]), None)
    if stop_at is None:
        check("end_id stops generation", False, "no token of the reference output could serve as an end token")
    else:
        ended = attempt("end_id stops generation", lambda: call_engine(
            args.grpc, "target", engine_arrays(prompt, n, reference[stop_at], pad)))
        if ended is not None:
            got = _tokens_of(ended)
            check("end_id stops generation", got == reference[:stop_at],
                  f"end_id {reference[stop_at]} (token {stop_at} of the reference): {len(got)} tokens returned, "
                  f"expected the {stop_at} before it")
    # D. Generation logits: [1, 1, tokens, vocab], their argmax the greedy tokens.
    logits = attempt("generation_logits", lambda: call_engine(
        args.grpc, "target", engine_arrays(prompt, 2, eos, pad, return_logits=True)))
    if logits is not None:
        shapes = [r.logits_shape for r in logits]
        argmax = [t for r in logits for t in r.logits_argmax]
        ok = bool(shapes) and all(s is not None and len(s) == 4 and s[:2] == (1, 1) and s[3] >= tokens.vocab_size
                                  for s in shapes)
        check("generation_logits: shape", ok, f"shapes {shapes} (expected [1, 1, tokens, >= {tokens.vocab_size}])")
        check("generation_logits: argmax is the greedy token", argmax == reference[:len(argmax)] and argmax,
              f"argmax {argmax}, greedy tokens {reference[:2]}")
    # E. Verification of draft tokens, streamed as the coordinator sends it.
    k = min(4, len(reference) - 1)
    if k >= 1:
        verified = attempt("draft verification", lambda: call_engine(
            args.grpc, "target", engine_arrays(prompt, k + 1, eos, pad, streaming=True, draft=reference[:k])))
        if verified is not None:
            got = _tokens_of(verified)
            accepted = first_difference(got, reference[:k + 1])
            check("draft verification: correct draft", 1 <= len(got) <= k + 1 and got[:1] == reference[:1],
                  f"{k} correct draft tokens: {len(got)} tokens back, "
                  + ("all accepted plus one" if accepted is None else
                     f"first departure from the greedy tokens at {accepted} (only a near-tie of two tokens explains it)"))
        wrong = (reference[1] + 1) % tokens.vocab_size
        rejected = attempt("draft verification: wrong draft", lambda: call_engine(
            args.grpc, "target", engine_arrays(prompt, k + 1, eos, pad, streaming=True,
                                               draft=[reference[0]] + [wrong] * (k - 1))))
        if rejected is not None:
            got = _tokens_of(rejected)
            check("draft verification: wrong draft", got == reference[:2] if k > 1 else len(got) >= 1,
                  f"draft [{reference[0]}, {wrong}, ...]: got {got}, expected {reference[:2]} "
                  "(the first accepted, then the target's own token)")
    # F. The draft answers too, with the logits lossless sampling needs.
    draft = attempt("draft engine", lambda: call_engine(
        args.grpc, "draft", engine_arrays(prompt, 4, eos, pad, streaming=True, return_logits=True)))
    if draft is not None:
        shapes = [r.logits_shape for r in draft]
        check("draft engine: tokens and logits", len(_tokens_of(draft)) == 4 and all(s and len(s) == 4 for s in shapes),
              f"{len(_tokens_of(draft))} tokens, generation_logits shapes {shapes}")
    print(verdict_table(checks))
    return PASS if all(ok for _, ok, _ in checks) else FAIL


def coordinator_request(url: str, prompt: str, max_tokens: int, timeout: float = 120.0, **options):
    """One request to the coordinator (tools.client); returns its Completion."""
    from tools.client import build_inputs, stream_completion

    with _grpc_client(url) as client:
        return stream_completion(client, build_inputs(prompt, max_tokens, **options), timeout=timeout)


# The speculative arm of the correctness checks: the draft model drafts every
# round (adaptive_window off, so the cost model cannot choose plain decoding
# when the draft is as slow as the target, as with the default pair).
SPECULATIVE = {"adaptive_window": False, "drafter": "draft_model"}


def model_drafted(completion) -> int:
    """Draft tokens proposed by the draft model (prompt lookup's excluded)."""
    return completion.draft_tokens - completion.lookup_draft_tokens


def check_agreement(args) -> int:
    """Step 5: greedy speculative vs plain decoding over PROMPTS."""
    tokens = Tokens(args.tokenizer_dir)
    rows, pairs, failures, drafted = [], [], [], 0
    for number, prompt in enumerate(PROMPTS[:args.prompts]):
        try:
            plain = coordinator_request(args.grpc, prompt, args.max_tokens, speculation_window=0, stream=False)
            spec = coordinator_request(args.grpc, prompt, args.max_tokens, stream=False, **SPECULATIVE)
        except Exception as error:  # noqa: BLE001
            failures.append(f"prompt {number}: {error}")
            say(f"prompt {number}: request failed: {error}")
            continue
        pair = (tokens.encode(plain.text), tokens.encode(spec.text))
        pairs.append(pair)
        drafted += model_drafted(spec)
        position = first_difference(*pair)
        char = first_difference(plain.text, spec.text)
        rows.append((number, prompt.splitlines()[0][:40], "yes" if position is None else "no",
                     "" if position is None else position, "" if char is None else char,
                     plain.completion_tokens, spec.completion_tokens, model_drafted(spec),
                     spec.accepted_draft_tokens, f"{spec.acceptance_rate:.2f}"))
        say(f"prompt {number}: {'identical' if position is None else f'differs from token {position}'}")
    result = agreement(pairs)
    print(markdown_table(("#", "prompt", "identical", "first differing token", "first differing character",
                          "plain tokens", "spec tokens", "drafted", "accepted", "acceptance"), rows))
    print()
    print(f"identical: {result.identical} of {result.total} ({result.share:.0%}; pass threshold "
          f"{args.min_identical:.0%}); token positions count the completions re-encoded with the pair's tokenizer")
    if failures:
        print("failed requests: " + "; ".join(failures))
    if not drafted:
        print("the speculative requests drafted no tokens with the draft model: speculation was not exercised")
    return PASS if not failures and drafted and result.share >= args.min_identical else FAIL


def _sample_many(url: str, count: int, first_seed: int, workers: int, max_tokens: int, **options) -> list:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        return coordinator_request(url, DISTRIBUTION_PROMPT, max_tokens, temperature=1.0, seed=first_seed + i,
                                   stream=False, **options)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(count)))


def check_distribution(args) -> int:
    """Step 6: sampled speculative vs plain: the distribution of the first tokens."""
    tokens = Tokens(args.tokenizer_dir)
    try:
        plain = _sample_many(args.grpc, args.samples, 1_000_000, args.workers, args.max_tokens, speculation_window=0)
        spec = _sample_many(args.grpc, args.samples, 2_000_000, args.workers, args.max_tokens, **SPECULATIVE)
    except Exception as error:  # noqa: BLE001
        print(f"a sampled request failed: {error}")
        return FAIL
    encoded = {arm: [tokens.encode(c.text) for c in completions] for arm, completions in
               (("plain", plain), ("spec", spec))}
    results = []
    for width, label in ((1, "first token"), (2, "first two tokens")):
        a = [tuple(ids[:width]) for ids in encoded["plain"]]
        b = [tuple(ids[:width]) for ids in encoded["spec"]]
        results.append((label, distribution_check(a, b, args.alpha)))
        top = Counter(a + b).most_common(5)
        print(f"{label}: most frequent (both arms): "
              + ", ".join(f"{tokens.decode(list(k))!r} x{c}" for k, c in top))
    speculative = sum(1 for c in spec if c.speculative_rounds > 0 and model_drafted(c) > 0)
    print()
    print(markdown_table(("categories", "result", "chi-square", "dof", "p", "TV distance"),
                         [(label, "ok" if r.passed else "FAILED", f"{r.statistic:.2f}", r.dof, f"{r.p_value:.4g}",
                           f"{r.total_variation:.3f}") for label, r in results]))
    print()
    for label, r in results:
        print(f"{label}: {r.describe()}")
    print(f"{args.samples} samples per arm at temperature 1 (seeds differ between the arms); "
          f"{speculative} of the speculative arm's requests had a speculative round with draft-model tokens. "
          "The coordinator decodes the first token plainly and speculates from the second, so the second "
          "token's test is the one that exercises rejection sampling.")
    if not speculative:
        print("no speculative request drafted: the check compared plain decoding with itself")
        return FAIL
    return PASS if all(r.passed for _, r in results) else FAIL


def _wait_http(url: str, deadline: float) -> tuple[bool, str]:
    import urllib.request

    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return True, ""
                last = f"HTTP {answer.status}"
        except Exception as error:  # noqa: BLE001
            last = str(error)
        time.sleep(2)
    return False, last


def check_openai(args) -> int:
    """Step 7a: the openai package against the OpenAI-compatible API."""
    try:
        import openai
    except ImportError:
        print("the openai package is not installed")
        return SKIP
    base = args.url.rstrip("/")
    ready, why = _wait_http(base.removesuffix("/v1") + "/health", time.monotonic() + args.wait)
    if not ready:
        print(f"{base}: /health not 200 within {args.wait:g} s: {why}")
        return FAIL
    client = openai.OpenAI(base_url=base, api_key=os.environ.get("SPECDEC_API_KEY") or "none", timeout=120,
                           max_retries=0)
    checks: list[tuple[str, bool, str]] = []
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
    try:
        models = [m.id for m in client.models.list().data]
        checks.append(("models.list", "coordinator" in models, f"models {models}"))
        chat = client.chat.completions.create(model="coordinator", messages=messages, max_tokens=48, temperature=0)
        text = chat.choices[0].message.content or ""
        speculation = (chat.model_extra or {}).get("speculation") or {}
        checks.append(("chat completion", bool(text) and chat.usage.completion_tokens > 0,
                       f"{chat.usage.completion_tokens} tokens, finish_reason {chat.choices[0].finish_reason}: "
                       f"{text[:80]!r}"))
        checks.append(("speculation statistics", "total_draft_tokens" in speculation,
                       json.dumps({k: speculation.get(k) for k in ("total_draft_tokens", "total_accepted_draft_tokens",
                                                                    "acceptance_rate")})))
        chunks = list(client.chat.completions.create(model="coordinator", messages=messages, max_tokens=48,
                                                     temperature=0, stream=True))
        streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
        checks.append(("chat completion, streamed", bool(streamed) and len(chunks) > 1,
                       f"{len(chunks)} chunks; {'same text as' if streamed == text else 'text differs from'} "
                       "the non-streamed answer (greedy: may differ only at a near-tie)"))
        completion = client.completions.create(model="coordinator", prompt="def add(a, b):", max_tokens=16)
        checks.append(("completion", bool(completion.choices[0].text), repr(completion.choices[0].text[:80])))
    except Exception as error:  # noqa: BLE001
        checks.append(("request", False, f"{type(error).__name__}: {error}"))
    print(f"openai {openai.__version__} against {base}")
    print(verdict_table(checks))
    return PASS if all(ok for _, ok, _ in checks) else FAIL


def find_nvidia_client(given: str | None, search_seconds: float = 60.0) -> tuple[str | None, list[str]]:
    """NVIDIA's end-to-end client: ``given``, else the known places, else a
    search (bounded in time) under NVIDIA_CLIENT_SEARCH_ROOTS. Returns (path,
    the places looked at)."""
    looked = []
    if given:
        return (given if os.path.isfile(given) else None), [given]
    for directory in NVIDIA_CLIENT_CANDIDATES:
        path = os.path.join(directory, NVIDIA_CLIENT)
        looked.append(path)
        if os.path.isfile(path):
            return path, looked
    deadline = time.monotonic() + search_seconds
    for root in NVIDIA_CLIENT_SEARCH_ROOTS:
        looked.append(f"{root}/**/{NVIDIA_CLIENT}")
        for directory, subdirectories, files in os.walk(root):
            if time.monotonic() > deadline:
                looked.append(f"(search stopped after {search_seconds:g} s)")
                return None, looked
            subdirectories[:] = [d for d in subdirectories if d not in ("proc", "sys", "dev", "engines")]
            if NVIDIA_CLIENT in files and directory.endswith(os.path.join("inflight_batcher_llm", "client")):
                return os.path.join(directory, NVIDIA_CLIENT), looked
    return None, looked


def check_nvidia_client(args) -> int:
    """Step 7b: NVIDIA's end-to-end client, unchanged, against the ensemble model.
    It has no option for a header, so its gRPC streams get the API key by a
    patch of tritonclient's start_stream (a default for ``headers``) made
    before the client runs; its code is not touched."""
    import contextlib
    import io
    import runpy

    path, looked = find_nvidia_client(args.client)
    if path is None:
        print(f"NVIDIA's {NVIDIA_CLIENT} is not in the image (looked at: {', '.join(looked)}); "
              "pass --nvidia-client FILE to docker/gpu-smoke.sh with the file from a tensorrtllm_backend "
              "checkout of the image's release (inflight_batcher_llm/client/)")
        return SKIP
    import tritonclient.grpc as grpcclient

    from coordinator.request.access import api_key_from_env, grpc_headers

    headers = grpc_headers(api_key_from_env())
    original = grpcclient.InferenceServerClient.start_stream

    def start_stream(self, callback, stream_timeout=None, headers=headers, *rest, **options):
        return original(self, callback, stream_timeout, headers, *rest, **options)

    grpcclient.InferenceServerClient.start_stream = start_stream
    checks = []
    for streaming in (False, True):
        argv = [path, "-u", args.grpc, "--model-name", "ensemble", "-p", "def fibonacci(n):", "-o", "24"]
        argv += ["-S"] if streaming else []
        output = io.StringIO()
        saved = sys.argv
        sys.argv = argv
        error = ""
        try:
            with contextlib.redirect_stdout(output):
                runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            error = "" if stop.code in (None, 0) else f"exited with {stop.code}"
        except Exception as failure:  # noqa: BLE001
            error = f"{type(failure).__name__}: {failure}"
        finally:
            sys.argv = saved
        text = output.getvalue()
        if "Received an error from server" in text:
            error = error or "the server answered with an error"
        name = f"{'streamed' if streaming else 'not streamed'}"
        checks.append((name, not error and "fibonacci" in text or (not error and len(text.strip()) > 0),
                       (error + ": " if error else "") + repr(text.strip()[-160:])))
        say(f"NVIDIA client {name}: {'ok' if not error else error}")
    print(f"NVIDIA's client: {path}")
    print(verdict_table(checks))
    return PASS if all(ok for _, ok, _ in checks) else FAIL


def check_concurrency(args) -> int:
    """Step 8: concurrent sampled requests (server defaults) all succeed."""
    import threading

    results: list = [None] * args.requests
    start_line = threading.Barrier(args.requests)

    def one(i: int) -> None:
        try:
            from tools.client import build_inputs, stream_completion

            with _grpc_client(args.grpc) as client:
                inputs = build_inputs(PROMPTS[i % len(PROMPTS)], args.max_tokens, temperature=0.8, top_p=0.95,
                                      seed=1000 + i)
                start_line.wait(timeout=60)
                results[i] = stream_completion(client, inputs, timeout=args.request_timeout)
        except Exception as error:  # noqa: BLE001
            results[i] = error

    begun = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.request_timeout + 90)
    wall = time.perf_counter() - begun
    done = [r for r in results if r is not None and not isinstance(r, Exception)]
    failed = [(i, r) for i, r in enumerate(results) if r is None or isinstance(r, Exception)]
    if done:
        latency = [c.seconds for c in done]
        first = [c.time_to_first_chunk for c in done if c.time_to_first_chunk is not None]
        total_tokens = sum(c.completion_tokens for c in done)
        drafted = sum(c.draft_tokens for c in done)
        accepted = sum(c.accepted_draft_tokens for c in done)
        print(markdown_table(
            ("requests", "succeeded", "p50 latency s", "p99 latency s", "p50 first text s", "tokens",
             "tokens/s (all)", "tokens/s per request (median)", "drafted", "accepted"),
            [(args.requests, len(done), f"{percentile(latency, 50):.2f}", f"{percentile(latency, 99):.2f}",
              f"{percentile(first, 50):.2f}" if first else "", total_tokens, f"{total_tokens / wall:.1f}",
              f"{percentile([c.tokens_per_second for c in done], 50):.1f}", drafted, accepted)]))
        print(f"\n{args.requests} streamed requests sent at once, temperature 0.8, top_p 0.95, max_tokens "
              f"{args.max_tokens}, the server's speculation settings; wall time {wall:.2f} s")
    for i, error in failed:
        print(f"request {i} failed: {error if error is not None else 'no answer in time'}")
    return PASS if not failed else FAIL


def drafting_state(url: str, timeout: float) -> tuple[str, str]:
    """One short greedy speculative request: (DRAFTING | PLAIN | ERROR, detail)."""
    try:
        completion = coordinator_request(url, "def fibonacci(n):", 24, timeout=timeout, stream=False, **SPECULATIVE)
    except Exception as error:  # noqa: BLE001
        return ERROR, str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    drafted = model_drafted(completion)
    if drafted > 0:
        return DRAFTING, f"{drafted} drafted, {completion.accepted_draft_tokens} accepted"
    return PLAIN, f"no draft-model tokens (fallback_reason {completion.fallback_reason!r})"


def check_drafting(args) -> int:
    """Step 9, before the kill: speculative requests do draft with the draft model."""
    for attempt in range(3):
        state, detail = drafting_state(args.grpc, args.request_timeout)
        print(f"request {attempt}: {state}: {detail}")
        if state == DRAFTING:
            return PASS
    print("no request drafted with the draft model before the kill: nothing to recover")
    return FAIL


def _recoveries(metrics_url: str | None) -> str:
    if not metrics_url:
        return "?"
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as answer:
            text = answer.read().decode()
    except Exception as error:  # noqa: BLE001
        return f"unreadable ({error})"
    values = [line.split()[-1] for line in text.splitlines()
              if line.startswith("specdec_engine_recoveries_total") and 'model="draft"' in line]
    return values[0] if values else "absent"


def check_recovery(args) -> int:
    """Step 9, after the kill: poll until a speculative request drafts again."""
    recoveries_before = _recoveries(args.metrics)
    events: list[tuple[float, str]] = []
    rows = []
    while True:
        sent = time.time() - args.killed_at
        if sent > args.deadline:
            break
        state, detail = drafting_state(args.grpc, min(args.request_timeout, max(5.0, args.deadline - sent)))
        answered = time.time() - args.killed_at
        events.append((answered, state))
        rows.append((f"{sent:.1f}", f"{answered:.1f}", state, detail))
        say(f"{answered:6.1f} s after the kill: {state}: {detail}")
        outcome = recovery_timeline(events, args.interrupt_within)
        if outcome.passed or (outcome.interrupted_at is None and answered > args.interrupt_within):
            break
        time.sleep(args.interval)
    outcome = recovery_timeline(events, args.interrupt_within)
    shown = rows if len(rows) <= 30 else rows[:10] + [("...", "...", "...", f"{len(rows) - 20} more")] + rows[-10:]
    print(markdown_table(("sent s after kill", "answered s after kill", "state", "detail"), shown))
    print()
    print(f"watchdog's specdec_engine_recoveries_total{{model=\"draft\"}}: {recoveries_before} right after the kill, "
          f"{_recoveries(args.metrics)} now")
    print(f"RECOVERY: {outcome.verdict}")
    if outcome.passed:
        print(f"RECOVERY_SECONDS={outcome.recovered_at:.1f}")
    return PASS if outcome.passed else FAIL


def check_pick_worker(args) -> int:
    """Step 9: read `docker top` and nvidia-smi output (stdin, in sections
    headed by '=== docker top' and '=== nvidia-smi') and name the draft's worker."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in sys.stdin.read().splitlines():
        if line.startswith("=== "):
            current = line[4:].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    processes = parse_process_table("\n".join(sections.get("docker top", [])))
    memory = parse_compute_apps("\n".join(sections.get("nvidia-smi", [])))
    worker, reason = pick_draft_worker(processes, memory)
    print(markdown_table(("host pid", "GPU MiB", "command line"),
                         [(p.pid, memory.get(p.pid, ""), p.args[:120]) for p in processes
                          if p.pid in memory or p.program == EXECUTOR_WORKER]))
    print(reason)
    if worker is None:
        return FAIL
    print(f"DRAFT_WORKER_PID={worker.pid}")
    return PASS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_smoke", description=__doc__.split("\n\n")[0])
    checks = parser.add_subparsers(dest="check", required=True)

    def add(name: str, function, help_text: str, grpc: bool = True, tokenizer: bool = False):
        sub = checks.add_parser(name, help=help_text)
        sub.set_defaults(function=function)
        if grpc:
            sub.add_argument("--grpc", default="127.0.0.1:8001", help="Triton's gRPC address")
        if tokenizer:
            sub.add_argument("--tokenizer-dir", default="/opt/specdec/engines/tokenizer")
        return sub

    sub = add("engine-calls", check_engine_calls, "step 4: direct calls to the target and the draft", tokenizer=True)
    sub.add_argument("--output-len", type=int, default=16)
    sub = add("agreement", check_agreement, "step 5: greedy speculative vs plain", tokenizer=True)
    sub.add_argument("--prompts", type=int, default=len(PROMPTS))
    sub.add_argument("--max-tokens", type=int, default=64)
    sub.add_argument("--min-identical", type=float, default=0.75)
    sub = add("distribution", check_distribution, "step 6: sampled first tokens, speculative vs plain", tokenizer=True)
    sub.add_argument("--samples", type=int, default=200)
    sub.add_argument("--max-tokens", type=int, default=3)
    sub.add_argument("--workers", type=int, default=8)
    sub.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    sub = add("openai", check_openai, "step 7a: the openai package against port 9000", grpc=False)
    sub.add_argument("--url", default="http://127.0.0.1:9000/v1")
    sub.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the API's /health")
    sub = add("nvidia-client", check_nvidia_client, "step 7b: NVIDIA's end-to-end client")
    sub.add_argument("--client", default=None, help=f"path of {NVIDIA_CLIENT} (default: look in the image)")
    sub = add("concurrency", check_concurrency, "step 8: concurrent sampled requests")
    sub.add_argument("--requests", type=int, default=32)
    sub.add_argument("--max-tokens", type=int, default=64)
    sub.add_argument("--request-timeout", type=float, default=120.0)
    sub = add("drafting", check_drafting, "step 9: speculative requests draft before the kill")
    sub.add_argument("--request-timeout", type=float, default=30.0)
    sub = add("pick-worker", check_pick_worker, "step 9: name the draft's executor worker (input on stdin)",
              grpc=False)
    sub = add("recovery", check_recovery, "step 9: time until speculative requests draft again")
    sub.add_argument("--killed-at", type=float, required=True, help="the kill's time (seconds since the epoch)")
    sub.add_argument("--deadline", type=float, default=300.0, help="give up this many seconds after the kill")
    sub.add_argument("--interrupt-within", type=float, default=60.0,
                     help="drafting must stop within this many seconds of the kill")
    sub.add_argument("--interval", type=float, default=1.0)
    sub.add_argument("--request-timeout", type=float, default=20.0)
    sub.add_argument("--metrics", default=None, help="the watchdog's /metrics URL")
    args = parser.parse_args(argv)
    return args.function(args)


if __name__ == "__main__":
    sys.exit(main())
