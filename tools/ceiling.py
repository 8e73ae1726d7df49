"""What this machine's forwards allow: the most tokens per second plain and
speculative decoding can reach at 1..N concurrent streams, from measured
forward times, before any serving cost.

    python -m tools.ceiling --target DIR --draft DIR [--streams 1,2,4,8]
        [--acceptance 0.7,0.8,0.9] [--prompt-tokens 150] [--max-tokens 64]

A benchmark says what the server reached; this says what it could reach, so
a gap is either the serving stack's (worth closing) or the machine's (only
other hardware moves it). The model is the best case of the engine's own
mechanics, every stream in step, for requests like the benchmark's:

* each request's prompt is prefilled on the target (whose last row gives
  the first token) and, for speculation, on the draft too, in forwards of the
  engine's row budget (prefill is compute-bound: its rows add up);
* plain decoding at S streams then runs one target forward of S rows per
  S tokens;
* speculation at window k runs k draft forwards of S rows (one drafted token
  per stream each) and one target forward verifying S (k + 1) rows, which
  emits S E(k) tokens (coordinator/policy/costmodel.py: the i.i.d. acceptance
  model, per-token acceptance a).

Forwards run one after the other (the two engines share the cores, and a
decode forward is memory-bound), rows are padded as the engine pads them on
this machine (cpu_engine/rows.py), and the times are of one sequence with the
rows as new tokens after a ``--context``-token cache: several sequences'
rows cost the same in the linear layers, which dominate at short context.
Times are medians (a decode loop meets the typical forward, not the
luckiest). Not counted: the draft's catch-up on accepted tokens, sampling,
and whatever the serving engine adds per forward beyond the model's own
(packing rows, per-sequence attention, the scheduler). So the tokens per
second are upper bounds; a ratio between two configurations is exact only
as far as those uncounted costs are small or scale like the forwards.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.policy.expectation import expected_tokens_per_round


@dataclass(frozen=True)
class Ceiling:
    streams: int
    window: int  # 0: plain decoding
    tokens_per_second: float


@dataclass(frozen=True)
class Forwards:
    """One model's forwards here: ``ms(n)`` is the time of a forward carrying n
    rows of work (padded as the engine pads), ``capacity`` the rows one may carry."""

    ms: Callable[[int], float]
    capacity: int

    def seconds(self, rows: int) -> float:
        """``rows`` rows of work, in forwards of at most ``capacity`` rows."""
        return sum(self.ms(part) for part in split(rows, self.capacity)) / 1000.0


def split(rows: int, capacity: int) -> list[int]:
    """The forwards ``rows`` rows of work take at ``capacity`` rows per forward."""
    full, rest = divmod(rows, capacity)
    return [capacity] * full + ([rest] if rest else [])


def ceilings(streams: int, alpha: float, max_window: int, target: Forwards, draft: Forwards | None,
             prompt_tokens: int, max_tokens: int) -> list[Ceiling]:
    """Tokens/s of ``streams`` requests in step, each prefilling ``prompt_tokens``
    and generating ``max_tokens``: plain decoding (window 0), then speculation at
    each window 1..max_window (``draft`` None: drafting is free, as prompt lookup's)."""
    tokens = streams * max_tokens
    prefill = target.seconds(streams * prompt_tokens)  # it also yields each request's first token
    results = [Ceiling(streams, 0, tokens / (prefill + (max_tokens - 1) * target.seconds(streams)))]
    catch_up = 0.0 if draft is None else draft.seconds(streams * prompt_tokens)
    for k in range(1, max_window + 1):
        drafting = 0.0 if draft is None else k * draft.seconds(streams)
        rounds = (max_tokens - 1) / expected_tokens_per_round(alpha, k)
        seconds = prefill + catch_up + rounds * (drafting + target.seconds(streams * (k + 1)))
        results.append(Ceiling(streams, k, tokens / seconds))
    return results


def best(results: Sequence[Ceiling]) -> Ceiling:
    return max(results, key=lambda c: c.tokens_per_second)


def report(streams: Sequence[int], alphas: Sequence[float], max_window: int, target: Forwards, draft: Forwards,
           prompt_tokens: int, max_tokens: int, fixed_window: int) -> list[str]:
    """The table: per acceptance and stream count, plain, the best window and a fixed one."""
    lines = [f"| acceptance | streams | plain tok/s | plain / one stream | best window | speculative tok/s "
             f"| speculative / plain | speculative / one stream | window {fixed_window} / one stream |",
             "|---|---|---|---|---|---|---|---|---|"]
    for alpha in alphas:
        one = {}
        for s in streams:
            table = ceilings(s, alpha, max_window, target, draft, prompt_tokens, max_tokens)
            plain, spec, fixed = table[0], best(table[1:]), table[fixed_window]
            one = one or {"plain": plain, "spec": spec, "fixed": fixed}
            lines.append(
                f"| {alpha:.2f} | {s} | {plain.tokens_per_second:.2f} "
                f"| {plain.tokens_per_second / one['plain'].tokens_per_second:.2f}x | {spec.window} "
                f"| {spec.tokens_per_second:.2f} | {spec.tokens_per_second / plain.tokens_per_second:.2f}x "
                f"| {spec.tokens_per_second / one['spec'].tokens_per_second:.2f}x "
                f"| {fixed.tokens_per_second / one['fixed'].tokens_per_second:.2f}x |")
    return lines


def decode_weight_bytes(model_dir: str, itemsize: int) -> int:
    """Bytes of weights one decode forward reads at ``itemsize`` bytes per weight: every
    tensor of the checkpoint but the input embedding (a forward reads one row of it per
    token), unless the output layer shares it (then the forward reads all of it)."""
    from safetensors import safe_open

    config = json.loads((Path(model_dir) / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings"))
    weights = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as checkpoint:
            for name in checkpoint.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                weights += math.prod(checkpoint.get_slice(name).get_shape())
    return weights * itemsize


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a sum over a tensor far larger than the caches reads here, with
    torch's threads (median of ``repeats``): what bounds a memory-bound decode forward."""
    import torch

    values = torch.ones(int(gib * 2**30) // 4)
    values.sum()  # pages touched and threads started before timing
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        values.sum()
        seconds.append(time.perf_counter() - started)
    return values.numel() * values.element_size() / statistics.median(seconds)


def measured_forwards(model_dir: str, dtype: str, scheme: str, context: int, repeats: int, capacity: int,
                      rows_needed: Callable[[Forwards], set[int]]) -> tuple[Forwards, dict[int, float], str]:
    """Load a model as the engine does, find its row shape here, and time the
    forwards ``rows_needed`` asks for (median of ``repeats``: a decode loop
    meets the typical forward, not the luckiest)."""
    from cpu_engine import attention
    from tools.measure_forwards import ForwardTimer, load_model
    from cpu_engine.rows import MAX_BLOCK_ROWS, measure_row_shape

    model, _ = load_model(model_dir, dtype, scheme)
    # the kernel calls' shape, probed as the engine probes it; a forward carries up to ``capacity`` rows
    shape = measure_row_shape(model, min(capacity, MAX_BLOCK_ROWS), attention.BLOCK_ROWS)
    needed = {shape.rows(n) for n in rows_needed(Forwards(lambda n: 1.0, capacity))}
    timer = ForwardTimer(model, context)
    times: dict[int, list[float]] = {n: [] for n in sorted(needed)}
    for _ in range(repeats):  # every size once per repeat, so drift of a busy machine reaches all alike
        for n, samples in times.items():
            samples.append(timer.once_ms(n))
    measured = {n: statistics.median(samples) for n, samples in times.items()}
    return Forwards(lambda n: measured[shape.rows(n)], capacity), measured, shape.describe()


def recorder(forwards: Forwards, seen: set[int]) -> Forwards:
    """``forwards`` that also note the row counts asked for."""
    return Forwards(lambda n: seen.add(n) or forwards.ms(n), forwards.capacity)


def measure_pair(target_dir: str, draft_dir: str, streams: Sequence[int], max_window: int, prompt_tokens: int,
                 max_tokens: int, capacity: int, context: int = 200, repeats: int = 5,
                 dtypes: tuple[str, str] = ("auto", "bfloat16"), weights: tuple[str, str] = ("none", "int4")):
    """The target's and the draft's forwards at the row counts ``ceilings`` asks for at
    ``streams``: (target, its ms by rows, its row shape, draft, its ms, its shape)."""
    from cpu_engine.engine import resolve_dtype

    target_dtype, draft_dtype = (resolve_dtype(dtype) for dtype in dtypes)

    def rows_needed(target: Forwards, draft: Forwards) -> tuple[set[int], set[int]]:
        seen_target, seen_draft = set(), set()
        for count in streams:
            ceilings(count, 0.7, max_window, recorder(target, seen_target), recorder(draft, seen_draft),
                     prompt_tokens, max_tokens)
        return seen_target, seen_draft

    free = Forwards(lambda n: 1.0, capacity)
    target, target_ms, target_shape = measured_forwards(
        target_dir, target_dtype, weights[0], context, repeats, capacity, lambda shaped: rows_needed(shaped, free)[0])
    draft, draft_ms, draft_shape = measured_forwards(
        draft_dir, draft_dtype, weights[1], context, repeats, capacity, lambda shaped: rows_needed(target, shaped)[1])
    return target, target_ms, target_shape, draft, draft_ms, draft_shape


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target's Hugging Face model dir")
    parser.add_argument("--draft", required=True, help="the draft's Hugging Face model dir")
    parser.add_argument("--target-dtype", default="auto",
                        help="the target's dtype (default auto, as the cpu profile: bfloat16 where the CPU has it "
                        "natively, else float32)")
    parser.add_argument("--draft-dtype", default="bfloat16", help="the draft's dtype (default bfloat16, as the cpu "
                        "profile)")
    parser.add_argument("--target-weights", default="none", help="weight_quantization of the target (default none)")
    parser.add_argument("--draft-weights", default="int4", help="weight_quantization of the draft (default int4)")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--acceptance", default="0.7,0.8,0.9", help="per-token acceptance rates to tabulate")
    parser.add_argument("--prompt-tokens", type=int, default=150, help="each request's prompt (default 150)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each request's completion (default 64)")
    parser.add_argument("--max-window", type=int, default=8)
    parser.add_argument("--fixed-window", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=512,
                        help="rows per forward (the engine's max_num_tokens; default 512, the cpu profile's)")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the timed forwards")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not 1 <= args.fixed_window <= args.max_window:
        parser.error(f"--fixed-window must be between 1 and --max-window ({args.max_window})")
    from cpu_engine.engine import DTYPES, resolve_dtype

    try:
        target_dtype, draft_dtype = resolve_dtype(args.target_dtype), resolve_dtype(args.draft_dtype)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    streams = [int(s) for s in args.streams.split(",")]
    alphas = [float(a) for a in args.acceptance.split(",")]

    target, target_ms, target_shape, draft, draft_ms, draft_shape = measure_pair(
        args.target, args.draft, streams, args.max_window, args.prompt_tokens, args.max_tokens, args.capacity,
        args.context, args.repeats, (target_dtype, draft_dtype), (args.target_weights, args.draft_weights))
    print(f"# forward ms by rows ({args.threads} threads, {args.context}-token cache, median of {args.repeats}); "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each")
    print(f"# target {target_dtype}, {args.target_weights} ({target_shape}): " + ", ".join(f"{n}: {ms:.0f}" for n, ms in target_ms.items()))
    print(f"# draft {draft_dtype}, {args.draft_weights} ({draft_shape}): " + ", ".join(f"{n}: {ms:.0f}" for n, ms in draft_ms.items()))
    bandwidth = read_bandwidth(repeats=args.repeats)
    weights = decode_weight_bytes(args.target, DTYPES[target_dtype].itemsize)
    floor_ms = weights / bandwidth * 1000
    print(f"# memory: a sum over 1 GiB reads {bandwidth / 1e9:.1f} GB/s here; the target's weights a decode forward "
          f"reads are {weights / 1e9:.2f} GB in {target_dtype}, so no one-row forward beats {floor_ms:.0f} ms "
          f"(measured {target.ms(1):.0f} ms; plain decoding at most {1000 / floor_ms:.2f} tok/s per stream)")
    for line in report(streams, alphas, args.max_window, target, draft, args.prompt_tokens, args.max_tokens,
                       args.fixed_window):
        print(line)


if __name__ == "__main__":
    main()
