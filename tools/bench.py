"""``specdec-bench``: plain, adaptive and fixed-window speculative decoding,
side by side, on one running server with the same prompts (greedy, one stream).

Every prompt runs once per mode, back to back, and the order of the modes
rotates from one prompt to the next (so slow drift of a shared machine, and
whichever request pays the prompt's prefill first, hit every mode alike).
Modes: ``plain`` (speculation_window 0), ``adaptive`` (the cost model picks
the window in 1..--window each round) and ``fixed-K`` for each K of
--fixed-windows (K drafts every round, adaptive_window false).

It reports per mode tokens/s, the speed-up over plain, the acceptance, the
per-token acceptance alpha, tokens per round, time to first text, and the
speed-up the cost model predicts from the measured alpha and engine costs
(see ``coordinator/policy/costmodel.py``) next to the measured one. Greedy
speculation is lossless, so every speculative text must equal plain's: any
difference is counted and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shlex
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from coordinator.request.api import COUNTED, Statistics
from tools.client import Completion, build_inputs, stream_completion
from tools.stream import MODEL
from tools.prompts import (
    HUMANEVAL_PROBLEMS,
    HUMANEVAL_RESERVED,
    PromptError,
    file_prompts,
    humaneval_prompts,
    random_prompts,
)
from coordinator.policy.costmodel import acceptance_from_rounds, best_of, predicted_speedup

TARGET_FRACTION = 0.9  # the goal: a measured speed-up of at least 90 % of the predicted one

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


class BenchError(RuntimeError):
    """A benchmark setting or prerequisite is wrong (message meant for the user)."""


def load_prompts(spec: str, *, first: int, last: int, count: int, seed: int) -> tuple[list[tuple[str, str]], list[str]]:
    """(prompts, notes) of a --prompts value: humaneval, random or file:PATH."""
    notes = []
    try:
        if spec == "humaneval":
            if last >= HUMANEVAL_RESERVED:
                notes.append(
                    f"HumanEval problems {HUMANEVAL_RESERVED}-{HUMANEVAL_PROBLEMS - 1} are reserved for independent "
                    "acceptance measurement; do not tune on results that include them "
                    f"(dev range: 0-{HUMANEVAL_RESERVED - 1})"
                )
            return humaneval_prompts(first, last), notes
        if spec == "random":
            if count < 1:
                raise BenchError(f"--count must be at least 1, got {count}")
            return random_prompts(count, seed), notes
        if spec.startswith("file:"):
            return file_prompts(spec[len("file:"):]), notes
    except PromptError as error:
        raise BenchError(str(error)) from error
    raise BenchError(f"--prompts must be humaneval, random or file:PATH, got {spec!r}")


# -- modes -------------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    name: str
    window: int  # speculation_window sent (0: plain decoding)
    adaptive: bool | None = None  # adaptive_window sent (None: not sent)

    @property
    def fixed(self) -> bool:
        return self.window > 0 and self.adaptive is False

    @property
    def label(self) -> str:
        """Window column: 0, K, or <=W for the adaptive mode."""
        return f"≤{self.window}" if self.adaptive else str(self.window)

    def inputs(self, prompt: str, max_tokens: int):
        return build_inputs(prompt, max_tokens, speculation_window=self.window, adaptive_window=self.adaptive,
                            temperature=0.0)


PLAIN = "plain"


def make_modes(window: int, fixed_windows: Sequence[int] = ()) -> list[Mode]:
    """plain, adaptive (window 1..``window``) and fixed-K for each K."""
    if window < 1:
        raise BenchError(f"--window must be at least 1, got {window}")
    if any(k < 1 for k in fixed_windows) or len(set(fixed_windows)) != len(fixed_windows):
        raise BenchError(f"--fixed-windows must be distinct windows of at least 1, got {list(fixed_windows)}")
    modes = [Mode(PLAIN, 0), Mode("adaptive", window, True)]
    return modes + [Mode(f"fixed-{k}", k, False) for k in sorted(fixed_windows)]


def parse_windows(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4] (argparse type)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, got {text!r}") from None


def run_order(modes: Sequence[Mode], index: int) -> list[Mode]:
    """The modes rotated by the prompt's index: each mode runs first (and in
    every other position) equally often; with two modes, alternation."""
    shift = index % len(modes)
    return list(modes[shift:]) + list(modes[:shift])


# -- results and aggregation -------------------------------------------------

@dataclass
class PromptResult:
    prompt_id: str
    order: list[str]  # mode names in the order they ran
    completions: dict[str, Completion]

    def identical(self, mode: str) -> bool:
        return self.completions[mode].text == self.completions[PLAIN].text


@dataclass
class Totals(Statistics):
    """Sums over the prompts of one mode (the counted statistics, summed)."""

    prompts: int = 0
    seconds: float = 0.0
    fallbacks: int = 0  # prompts whose completion reported a fallback_reason
    first_chunk_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_second(self) -> float | None:
        return _ratio(self.completion_tokens, self.seconds)

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens."""
        return _ratio(self.accepted_draft_tokens, self.draft_tokens)

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance (maximum likelihood: accepted / (accepted + rejected rounds))."""
        return acceptance_from_rounds(self.accepted_draft_tokens, self.rejected_rounds)

    @property
    def tokens_per_round(self) -> float | None:
        return _ratio(self.completion_tokens, self.speculative_rounds + self.plain_rounds)

    @property
    def p50_time_to_first_chunk(self) -> float | None:
        return statistics.median(self.first_chunk_seconds) if self.first_chunk_seconds else None


def aggregate(completions: Iterable[Completion]) -> Totals:
    totals = Totals()
    for c in completions:
        totals.prompts += 1
        totals.seconds += c.seconds
        for name in COUNTED:
            setattr(totals, name, getattr(totals, name) + getattr(c, name))
        totals.fallbacks += bool(c.fallback_reason)
        if c.time_to_first_chunk is not None:
            totals.first_chunk_seconds.append(c.time_to_first_chunk)
    return totals


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


# -- the cost model's prediction from measured inputs --------------------------

def plain_step_seconds(plain: Totals) -> float | None:
    """t_plain: server-side seconds per plain target step (the cost unit)."""
    return _ratio(plain.plain_seconds, plain.plain_rounds)


def draft_cost(totals: Totals, t_plain: float | None) -> float | None:
    """c: draft seconds per drafted token, in plain steps."""
    per_token = _ratio(totals.draft_seconds, totals.draft_tokens)
    return per_token / t_plain if per_token is not None and t_plain else None


def verify_cost(totals: Totals, t_plain: float | None) -> float | None:
    """v: verify seconds per speculative round, in plain steps."""
    per_round = _ratio(totals.verify_seconds, totals.speculative_rounds)
    return per_round / t_plain if per_round is not None and t_plain else None


def predict_fixed(alpha: float | None, k: int, c: float | None, v: float | None) -> float | None:
    """E(K) / (K c + v), or None while an input is unmeasured."""
    if alpha is None or c is None or v is None or k * c + v <= 0:
        return None
    return predicted_speedup(alpha, k, c, v)


def predict_best_window(alpha: float | None, c: float | None, max_window: int, verify_costs: dict[int, float],
                        default_verify: float | None) -> tuple[int, float] | None:
    """(K, predicted speed-up) of the best K in 1..max_window, v(K) from
    ``verify_costs`` where measured, else ``default_verify``; (0, 1.0) when no
    window beats plain decoding (what the adaptive policy does then)."""
    predictions = [predict_fixed(alpha, k, c, verify_costs.get(k, default_verify)) for k in range(1, max_window + 1)]
    return None if None in predictions else best_of(predictions)


# -- summary -----------------------------------------------------------------

def summarise(results: Sequence[PromptResult], modes: Sequence[Mode]) -> dict:
    """Per-mode aggregates, predictions, identity check and the exit code
    (1 when any speculative text differs from plain's)."""
    totals = {m.name: aggregate(r.completions[m.name] for r in results) for m in modes}
    plain = totals[PLAIN]
    t_plain = plain_step_seconds(plain)
    plain_rate = plain.tokens_per_second
    fixed_v = {}
    for m in modes:
        if m.fixed:
            v = verify_cost(totals[m.name], t_plain)
            if v is not None:
                fixed_v[m.window] = v

    rows, mismatched = [], []
    for m in modes:
        t = totals[m.name]
        c, v = draft_cost(t, t_plain), verify_cost(t, t_plain)
        predicted = predicted_window = None
        if m.fixed:
            predicted, predicted_window = predict_fixed(t.alpha, m.window, c, v), m.window
        elif m.adaptive:
            best = predict_best_window(t.alpha, c, m.window, fixed_v, v)
            if best is not None:
                predicted_window, predicted = best
        rate = t.tokens_per_second
        speedup = rate / plain_rate if rate is not None and plain_rate else None
        different = [] if m.name == PLAIN else [r.prompt_id for r in results if not r.identical(m.name)]
        mismatched += [{"prompt": p, "mode": m.name} for p in different]
        rows.append({
            "mode": m.name, "window": m.window, "adaptive": m.adaptive, "prompts": t.prompts,
            "completion_tokens": t.completion_tokens, "seconds": t.seconds, "tokens_per_second": rate,
            "speedup": speedup, "draft_tokens": t.draft_tokens, "accepted_draft_tokens": t.accepted_draft_tokens,
            "acceptance": t.acceptance, "alpha": t.alpha, "speculative_rounds": t.speculative_rounds,
            "plain_rounds": t.plain_rounds, "rejected_rounds": t.rejected_rounds,
            "tokens_per_round": t.tokens_per_round, "draft_seconds": t.draft_seconds,
            "verify_seconds": t.verify_seconds, "plain_seconds": t.plain_seconds,
            "p50_time_to_first_chunk": t.p50_time_to_first_chunk, "fallbacks": t.fallbacks,
            "draft_cost": c, "verify_cost": v, "predicted_window": predicted_window, "predicted_speedup": predicted,
            "measured_over_predicted": speedup / predicted if speedup is not None and predicted else None,
            "mismatches": len(different),
        })
    return {
        "prompts": len(results),
        "t_plain_seconds": t_plain,
        "fixed_verify_costs": {str(k): v for k, v in sorted(fixed_v.items())},
        "modes": rows,
        "mismatches": len(mismatched),
        "mismatched": mismatched,
        "exit_code": EXIT_MISMATCH if mismatched else EXIT_OK,
    }


def prompt_rows(results: Sequence[PromptResult], modes: Sequence[Mode]) -> list[dict]:
    """Raw per-(prompt, mode) rows for the JSON file."""
    rows = []
    for r in results:
        plain_rate = r.completions[PLAIN].tokens_per_second
        for m in modes:
            c = r.completions[m.name]
            row = {"prompt": r.prompt_id, "mode": m.name, "window": m.window, "adaptive": m.adaptive,
                   "position": r.order.index(m.name)}
            row.update({k: v for k, v in dataclasses.asdict(c).items() if k != "deltas"})
            row["tokens_per_second"] = c.tokens_per_second
            row["speedup"] = c.tokens_per_second / plain_rate if plain_rate else None
            row["identical"] = r.identical(m.name)
            rows.append(row)
    return rows


# -- formatting ----------------------------------------------------------------

def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


PROMPT_HEADER = (
    "| prompt | mode | tokens | tok/s | vs plain | acceptance | α | tok/round | first text s | identical |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_prompt_rows(result: PromptResult, modes: Sequence[Mode]) -> list[str]:
    """Markdown rows of one prompt (one per mode), under PROMPT_HEADER."""
    plain_rate = result.completions[PLAIN].tokens_per_second
    lines = []
    for m in modes:
        c = result.completions[m.name]
        t = aggregate([c])
        speedup = c.tokens_per_second / plain_rate if plain_rate else None
        identical = "ref" if m.name == PLAIN else ("yes" if result.identical(m.name) else "**NO**")
        lines.append(
            f"| {result.prompt_id} | {m.name} | {c.completion_tokens} | {c.tokens_per_second:.2f} | "
            f"{_fmt(speedup, '.2f', 'x')} | {_fmt(t.acceptance)} | {_fmt(t.alpha)} | {_fmt(t.tokens_per_round)} | "
            f"{_fmt(c.time_to_first_chunk)} | {identical} |"
        )
    return lines


def format_summary(summary: dict, modes: Sequence[Mode]) -> str:
    """The summary table (one row per mode) and what its columns mean."""
    by_name = {row["mode"]: row for row in summary["modes"]}
    n = summary["prompts"]
    lines = [
        "| mode | K | tok/s | vs plain | acceptance | α | tok/round | p50 first text s | c | v | predicted "
        "| measured/predicted | fell back | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        row = by_name[m.name]
        k = m.label
        if m.adaptive and row["predicted_window"] is not None:
            k += f" (best {row['predicted_window']})"
        identical = "ref" if m.name == PLAIN else f"{n - row['mismatches']}/{n}"
        ratio = row["measured_over_predicted"]
        flag = "" if ratio is None or ratio >= TARGET_FRACTION or not m.fixed else " ⚠"
        lines.append(
            f"| {m.name} | {k} | {_fmt(row['tokens_per_second'])} | {_fmt(row['speedup'], '.2f', 'x')} | "
            f"{_fmt(row['acceptance'])} | {_fmt(row['alpha'])} | {_fmt(row['tokens_per_round'])} | "
            f"{_fmt(row['p50_time_to_first_chunk'])} | {_fmt(row['draft_cost'])} | {_fmt(row['verify_cost'])} | "
            f"{_fmt(row['predicted_speedup'], '.2f', 'x')} | {_fmt(ratio, '.0%')}{flag} | "
            f"{row['fallbacks']}/{row['prompts']} | {identical} |"
        )
    return "\n".join(lines) + "\n\n" + explain(summary, modes)


def explain(summary: dict, modes: Sequence[Mode]) -> str:
    t_plain = summary["t_plain_seconds"]
    fixed = sorted(int(k) for k in summary["fixed_verify_costs"])
    notes = [
        f"{summary['prompts']} prompts. tok/s = sum of tokens / sum of client-side seconds; vs plain = its ratio "
        "to plain's. acceptance = accepted / drafted tokens; α = per-token acceptance, accepted / (accepted + "
        "rejected rounds); tok/round = tokens / (speculative + plain rounds).",
        f"c = draft seconds per drafted token and v = verify seconds per speculative round, both over "
        f"t_plain = {_fmt(t_plain and t_plain * 1000, '.1f', ' ms')} (plain mode's server-side seconds per "
        "plain target step).",
        "predicted (fixed-K) = E(K) / (K·c + v) with E(K) = (1 − α^(K+1)) / (1 − α), from that mode's own α, c "
        f"and v; the issue's target is measured/predicted ≥ {TARGET_FRACTION:.0%} (⚠ below it).",
    ]
    if any(m.adaptive for m in modes):
        source = (f"v(K) of the fixed modes for K = {', '.join(map(str, fixed))} and its own verify seconds per "
                  "round for other K" if fixed else "its own verify seconds per round for every K (add "
                  "--fixed-windows to measure v per K)")
        notes.append(
            "predicted (adaptive) = the best K of 1..W by E(K) / (K·c + v(K)), with the adaptive mode's own α and "
            f"c and {source} (1.00x, K 0 when no window beats plain): what one well-chosen fixed window would reach "
            "at that α, the yardstick for the window choice."
        )
    fell_back = [row for row in summary["modes"] if row["fallbacks"] and row["mode"] != PLAIN]
    for row in fell_back:
        notes.append(
            f"{row['mode']}: {row['fallbacks']} of {row['prompts']} prompts stopped speculating for a while "
            f"({row['plain_rounds']} plain rounds); the prediction assumes every round drafts."
        )
    for item in summary["mismatched"]:
        notes.append(f"MISMATCH: {item['mode']} text differs from plain on {item['prompt']}")
    if not summary["mismatched"]:
        notes.append("All speculative texts are identical to plain decoding.")
    return "\n".join(f"- {note}" for note in notes)


# -- files -------------------------------------------------------------------

def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=1, ensure_ascii=False, allow_nan=False, default=_json_default)
        out.write("\n")


def _json_default(value):
    raise TypeError(f"not JSON serialisable: {value!r}")


def require_matplotlib():
    """pyplot with the Agg backend, or BenchError saying how to install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise BenchError(
            "--png needs matplotlib: `.venv/bin/pip install -r requirements/cpu-serve.txt` (or drop --png)"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(path: str | Path, summary: dict, title: str = "") -> None:
    """tokens/s per mode, and measured vs predicted speed-up over plain per mode."""
    plt = require_matplotlib()
    rows = summary["modes"]
    names = [row["mode"] for row in rows]
    figure, (rates, speedups) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(rows) + 4), 4.5))
    try:
        values = [row["tokens_per_second"] or 0.0 for row in rows]
        bars = rates.bar(names, values, color=["0.6"] + ["C0"] * (len(rows) - 1))
        rates.bar_label(bars, fmt="%.2f")
        rates.set_ylim(0, max([1e-9, *values]) * 1.15)
        rates.set_ylabel("tokens/s (client side)")
        rates.set_title("throughput")
        speculative = [row for row in rows if row["mode"] != PLAIN]
        positions = range(len(speculative))
        measured = [row["speedup"] or 0.0 for row in speculative]
        predicted = [row["predicted_speedup"] or 0.0 for row in speculative]
        width = 0.4
        bars = speedups.bar([p - width / 2 for p in positions], measured, width, label="measured", color="C0")
        speedups.bar_label(bars, fmt="%.2f")
        bars = speedups.bar([p + width / 2 for p in positions], predicted, width, label="predicted", color="C1")
        speedups.bar_label(bars, fmt="%.2f")
        speedups.axhline(1.0, color="0.3", linewidth=1, linestyle="--")
        labels = [row["mode"] + (f" (best K {row['predicted_window']})" if row["adaptive"] and
                                 row["predicted_window"] is not None else "") for row in speculative]
        speedups.set_xticks(list(positions), labels)
        speedups.set_ylim(0, max([1.0, *measured, *predicted]) * 1.3)  # room for the legend
        speedups.set_ylabel("speed-up over plain")
        speedups.set_title("measured vs cost-model prediction")
        speedups.legend(loc="upper left", ncols=2)
        for axis in (rates, speedups):
            axis.tick_params(axis="x", labelrotation=30)
        save_figure(figure, path, title)
    finally:
        plt.close(figure)


def save_figure(figure, path: str | Path, title: str = "") -> None:
    """Title, tight layout, and the PNG written (its folder made)."""
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)


# -- running -------------------------------------------------------------------

def run_prompt(client, prompt: str, modes: Sequence[Mode], index: int, max_tokens: int) -> tuple[list[str], dict]:
    order = run_order(modes, index)
    completions = {m.name: stream_completion(client, m.inputs(prompt, max_tokens)) for m in order}
    return [m.name for m in order], completions


def progress_line(index: int, total: int, result: PromptResult, modes: Sequence[Mode]) -> str:
    plain_rate = result.completions[PLAIN].tokens_per_second
    parts = [f"plain {plain_rate:.2f} tok/s"]
    for m in modes[1:]:
        c = result.completions[m.name]
        ratio = c.tokens_per_second / plain_rate if plain_rate else 0.0
        parts.append(f"{m.name} {ratio:.2f}x{'' if result.identical(m.name) else ' MISMATCH'}")
    return f"[{index + 1}/{total}] {result.prompt_id}: " + ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec-bench",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Exit status: 0 ok, 1 a speculative text differed from plain decoding, 2 usage or server error. "
        "Start the server first (`make serve`).",
    )
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default localhost:8001)")
    parser.add_argument("--prompts", default="humaneval", metavar="SET",
                        help="humaneval (default), random (random characters: a useless draft) or file:PATH "
                        "(one JSON string or plain text prompt per line)")
    parser.add_argument("--first", type=int, default=0, help="first HumanEval problem (default 0)")
    parser.add_argument("--last", type=int, default=HUMANEVAL_RESERVED - 1,
                        help=f"last HumanEval problem (default {HUMANEVAL_RESERVED - 1}; {HUMANEVAL_RESERVED}-"
                        f"{HUMANEVAL_PROBLEMS - 1} are reserved for independent acceptance measurement)")
    parser.add_argument("--count", type=int, default=20, help="number of random prompts (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    parser.add_argument("--window", type=int, default=5,
                        help="speculation_window of the adaptive mode (default 5, the server's default cap)")
    parser.add_argument("--fixed-windows", type=parse_windows, default=[], metavar="K,K,...",
                        help="also run fixed windows (adaptive_window false), e.g. 1,2,4; each must be at most "
                        "the server's speculation_window (SPECDEC_SPECULATION_WINDOW raises it)")
    parser.add_argument("--per-prompt", action="store_true", help="print a markdown row per prompt and mode")
    parser.add_argument("--json", metavar="PATH", help="write per-prompt rows, the summary and the command here")
    parser.add_argument("--png", metavar="PATH", help="plot tokens/s and measured vs predicted speed-up (matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        modes = make_modes(args.window, args.fixed_windows)
        if args.max_tokens < 1:
            raise BenchError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        prompts, notes = load_prompts(args.prompts, first=args.first, last=args.last, count=args.count, seed=args.seed)
        if args.png:
            require_matplotlib()  # fail now, not after the run
    except BenchError as error:
        print(f"specdec-bench: {error}", file=sys.stderr)
        return EXIT_ERROR
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"{len(prompts)} prompts ({args.prompts}), max_tokens {args.max_tokens}, modes "
          f"{', '.join(m.name for m in modes)}, greedy, one stream, server {args.url}\n", flush=True)

    results: list[PromptResult] = []
    error = None
    try:
        with grpcclient.InferenceServerClient(args.url) as client:
            try:
                ready = client.is_model_ready(MODEL)
            except InferenceServerException as exc:
                raise BenchError(f"cannot reach the server at {args.url} ({exc.message()}); "
                                 "start one with `make serve`") from exc
            if not ready:
                raise BenchError(f"model {MODEL!r} is not ready at {args.url}")
            if args.per_prompt:
                print(PROMPT_HEADER, flush=True)
            for index, (prompt_id, prompt) in enumerate(prompts):
                order, completions = run_prompt(client, prompt, modes, index, args.max_tokens)
                result = PromptResult(prompt_id, order, completions)
                results.append(result)
                if args.per_prompt:
                    print("\n".join(format_prompt_rows(result, modes)), flush=True)
                else:
                    print(progress_line(index, len(prompts), result, modes), file=sys.stderr, flush=True)
    except InferenceServerException as exc:  # RequestFailed included: error responses, timeouts, RPC errors
        error = f"server error: {exc.message()}"
        if "speculation_window" in error:
            error += " (--window and --fixed-windows must be at most the server's speculation_window; " \
                     "SPECDEC_SPECULATION_WINDOW raises it)"
    except BenchError as exc:
        error = str(exc)
    except KeyboardInterrupt:
        error = "interrupted"
    if error:
        print(f"specdec-bench: {error}; {len(results)} of {len(prompts)} prompts completed", file=sys.stderr)
        if not results:
            return EXIT_ERROR

    summary = summarise(results, modes)
    print(("\n" if args.per_prompt else "") + format_summary(summary, modes), flush=True)
    exit_code = summary["exit_code"] if summary["exit_code"] or not error else EXIT_ERROR
    if args.json:
        write_json(args.json, {
            "command": shlex.join(["specdec-bench", *argv]),
            "argv": argv,
            "timestamp": started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": {"url": args.url, "prompts": args.prompts, "max_tokens": args.max_tokens,
                         "window": args.window, "fixed_windows": sorted(args.fixed_windows), "greedy": True},
            "modes": [dataclasses.asdict(m) for m in modes],
            "notes": notes,
            "incomplete": error,
            "exit_code": exit_code,
            "summary": _finite(summary),
            "rows": _finite(prompt_rows(results, modes)),
        })
        print(f"\nwrote {args.json}")
    if args.png:
        write_png(args.png, summary, title=f"{args.prompts}, {len(results)} prompts, max_tokens {args.max_tokens}")
        print(f"wrote {args.png}")
    return exit_code


def _finite(value):
    """NaN/inf -> None, so the JSON file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
