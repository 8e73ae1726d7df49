"""The load test's own report: one row per (concurrent users, speculation on/off).

Locust's statistics are cumulative over the whole run; a step ramp needs them
per step. The locustfile keeps one record per request (start and end time,
mode, time to first token, inter-token latency, tokens, drafted and accepted
tokens, error) and the shape keeps the phases (start, end, users, mode). From
those, for each phase and speculation mode:

* throughput (requests/s, tokens/s): requests that *ended* inside the phase,
  over the phase's duration;
* latencies, tokens/s per stream and acceptance: requests that started *and*
  ended inside the phase (a request that straddles a change of concurrency
  saw two loads; it is counted under ``spanning`` and left out);
* errors: failed requests that started inside the phase.

Files, for a prefix P (``--csv P`` of locust): ``P_specdec_requests.csv`` (every
request), ``P_specdec_phases.csv``, ``P_specdec_summary.csv``,
``P_specdec_summary.md`` (the table printed at the end) and ``P_specdec.png``
(latencies and tokens/s against concurrency). ``python -m loadtests.report P``
renders the summary, table and plot again from the first two.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

MODES = ("on", "off")


@dataclass
class RequestRecord:
    started: float  # time.time() at send
    ended: float
    mode: str  # "on" (speculation) or "off" (speculation_window 0)
    stream: bool
    prompt: str
    max_tokens: int
    temperature: float
    ok: bool
    error: str = ""  # failure kind, empty when ok
    ttft: float | None = None  # seconds; streaming requests only
    itl: float | None = None  # seconds per token after the first chunk
    latency: float = 0.0  # seconds to the final response
    tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    worker: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.latency if self.latency > 0 else 0.0


@dataclass
class Phase:
    index: int
    users: int
    mode: str  # "on", "off" or "mix"
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 0.0)


@dataclass
class SummaryRow:
    phase: int
    users: int
    speculation: str
    seconds: float
    requests: int  # ended inside the phase, successfully
    requests_per_second: float
    tokens_per_second_total: float
    measured: int  # started and ended inside the phase (latency statistics)
    spanning: int
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    latency_p50: float | None
    latency_p95: float | None
    tokens_per_second_per_stream: float | None  # mean over measured requests
    tokens_mean: float | None
    draft_tokens: int
    accepted_draft_tokens: int
    errors: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], phases: list[Phase]) -> list[SummaryRow]:
    rows = []
    for phase in phases:
        modes = MODES if phase.mode == "mix" else (phase.mode,)
        for mode in modes:
            mine = [r for r in records if r.mode == mode]
            ended = [r for r in mine if r.ok and phase.start <= r.ended < phase.end]
            inside = [r for r in ended if r.started >= phase.start]
            spanning = [r for r in mine if r.ok and phase.start <= r.started < phase.end and r.ended >= phase.end]
            errors = [r for r in mine if not r.ok and phase.start <= r.started < phase.end]
            if phase.mode == "mix" and not (ended or spanning or errors):
                continue  # a mixed phase with too few users for this mode
            ttfts = [r.ttft for r in inside if r.ttft is not None]
            itls = [r.itl for r in inside if r.itl is not None]
            latencies = [r.latency for r in inside]
            seconds = phase.seconds
            rows.append(SummaryRow(
                phase=phase.index,
                users=phase.users,
                speculation=mode,
                seconds=seconds,
                requests=len(ended),
                requests_per_second=len(ended) / seconds if seconds else 0.0,
                tokens_per_second_total=sum(r.tokens for r in ended) / seconds if seconds else 0.0,
                measured=len(inside),
                spanning=len(spanning),
                ttft_p50=_percentile(ttfts, 50),
                ttft_p95=_percentile(ttfts, 95),
                itl_p50=_percentile(itls, 50),
                itl_p95=_percentile(itls, 95),
                latency_p50=_percentile(latencies, 50),
                latency_p95=_percentile(latencies, 95),
                tokens_per_second_per_stream=float(np.mean([r.tokens_per_second for r in inside])) if inside else None,
                tokens_mean=float(np.mean([r.tokens for r in inside])) if inside else None,
                draft_tokens=sum(r.draft_tokens for r in inside),
                accepted_draft_tokens=sum(r.accepted_draft_tokens for r in inside),
                errors=len(errors),
            ))
    return rows


def _fmt(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * scale:.{digits}f}"


def markdown_table(rows: list[SummaryRow]) -> str:
    lines = [
        "| users | speculation | requests | requests/s | p50 TTFT s | p95 TTFT s | p50 ITL ms "
        "| tokens/s per stream | tokens/s total | acceptance | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        acceptance = "–" if row.acceptance is None else (
            f"{row.acceptance:.2f} ({row.accepted_draft_tokens}/{row.draft_tokens})")
        lines.append(
            f"| {row.users} | {row.speculation} | {row.requests} | {row.requests_per_second:.3f} "
            f"| {_fmt(row.ttft_p50)} | {_fmt(row.ttft_p95)} | {_fmt(row.itl_p50, 0, 1000)} "
            f"| {_fmt(row.tokens_per_second_per_stream)} | {row.tokens_per_second_total:.2f} "
            f"| {acceptance} | {row.errors} |"
        )
    return "\n".join(lines)


def comparison_lines(rows: list[SummaryRow]) -> list[str]:
    """Speculation on vs off at each concurrency: per-stream tokens/s, TTFT, throughput."""
    by_users: dict[int, dict[str, SummaryRow]] = {}
    for row in rows:
        by_users.setdefault(row.users, {})[row.speculation] = row
    lines = []
    for users, pair in sorted(by_users.items()):
        on, off = pair.get("on"), pair.get("off")
        if not (on and off) or not (on.tokens_per_second_per_stream and off.tokens_per_second_per_stream):
            continue
        parts = [f"per-stream tokens/s {on.tokens_per_second_per_stream / off.tokens_per_second_per_stream:.2f}x"]
        if on.ttft_p50 and off.ttft_p50:
            parts.append(f"p50 TTFT {on.ttft_p50 / off.ttft_p50:.2f}x")
        if off.tokens_per_second_total:
            parts.append(f"total tokens/s {on.tokens_per_second_total / off.tokens_per_second_total:.2f}x")
        lines.append(f"{users} user(s), speculation on / off: " + ", ".join(parts))
    return lines


def notes(rows: list[SummaryRow]) -> list[str]:
    out = []
    spanning = sum(r.spanning for r in rows)
    if spanning:
        out.append(f"{spanning} request(s) straddled a change of concurrency and are left out of the latency columns.")
    empty = [r for r in rows if r.measured == 0]
    if empty:
        out.append("no request started and ended within "
                   + ", ".join(f"{r.users} user(s)/{r.speculation}" for r in empty)
                   + ": the phase was shorter than a request; lengthen --step-seconds or lower --max-tokens.")
    thin = [r for r in rows if 0 < r.measured < 3]
    if thin:
        out.append("fewer than 3 measured requests in "
                   + ", ".join(f"{r.users} user(s)/{r.speculation}" for r in thin)
                   + ": lengthen the steps (--step-seconds) for stable percentiles.")
    return out


def render_text(rows: list[SummaryRow]) -> str:
    parts = [markdown_table(rows)]
    extra = comparison_lines(rows) + notes(rows)
    if extra:
        parts.append("\n".join(extra))
    return "\n\n".join(parts) + "\n"


def plot(rows: list[SummaryRow], path: Path, title: str = "") -> bool:
    """Latencies and tokens/s against concurrency, one line per mode. False
    when matplotlib is missing (the rest of the report is still written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("time to first token (s)", [("ttft_p50", "p50", "-"), ("ttft_p95", "p95", "--")]),
        ("inter-token latency (ms)", [("itl_p50", "p50", "-"), ("itl_p95", "p95", "--")]),
        ("tokens/s per stream", [("tokens_per_second_per_stream", "mean", "-")]),
        ("tokens/s, all streams", [("tokens_per_second_total", "total", "-")]),
    ]
    colors = {"on": "tab:blue", "off": "tab:orange"}
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for axis, (label, series) in zip(axes.flat, panels):
        for mode in MODES:
            mine = sorted((r for r in rows if r.speculation == mode), key=lambda r: r.users)
            for attribute, stat, style in series:
                points = [(r.users, getattr(r, attribute)) for r in mine if getattr(r, attribute) is not None]
                if not points:
                    continue
                xs, ys = zip(*points)
                if attribute.startswith("itl"):
                    ys = [y * 1000 for y in ys]
                axis.plot(xs, ys, style, marker="o", color=colors[mode],
                          label=f"speculation {mode}" + (f" {stat}" if len(series) > 1 else ""))
        axis.set_xlabel("concurrent users")
        axis.set_ylabel(label)
        users = sorted({r.users for r in rows})
        if users:
            axis.set_xticks(users)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.suptitle(title or "coordinator load test: speculation on vs off")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# ------------------------------------------------------------ files ----

def _write(path: Path, items: list, columns: list[str]) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        for item in items:
            row = asdict(item)
            writer.writerow({k: ("" if row[k] is None else row[k]) for k in columns})


def _read(path: Path, cls):
    types = {f.name: f.type for f in fields(cls)}
    items = []
    with open(path, newline="") as source:
        for row in csv.DictReader(source):
            values = {}
            for name, text in row.items():
                kind = str(types[name])
                if text == "" and "None" in kind:
                    values[name] = None
                elif kind.startswith("bool"):
                    values[name] = text == "True"
                elif kind.startswith("int"):
                    values[name] = int(text)
                elif kind.startswith("float"):
                    values[name] = float(text)
                else:
                    values[name] = text
            items.append(cls(**values))
    return items


def write_reports(prefix: str, records: list[RequestRecord], phases: list[Phase], title: str = "") -> tuple[str, list[Path]]:
    """Write every file for ``prefix``; returns the printed text and the paths."""
    base = Path(prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = {name: Path(f"{prefix}_specdec_{name}") for name in ("requests.csv", "phases.csv", "summary.csv", "summary.md")}
    _write(paths["requests.csv"], sorted(records, key=lambda r: r.started), [f.name for f in fields(RequestRecord)])
    _write(paths["phases.csv"], phases, [f.name for f in fields(Phase)])
    rows = summarize(records, phases)
    columns = [f.name for f in fields(SummaryRow)]
    with open(paths["summary.csv"], "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(columns + ["acceptance"])
        for row in rows:
            values = asdict(row)
            writer.writerow(["" if values[c] is None else values[c] for c in columns]
                            + ["" if row.acceptance is None else f"{row.acceptance:.4f}"])
    text = render_text(rows)
    paths["summary.md"].write_text(text)
    written = list(paths.values())
    png = Path(f"{prefix}_specdec.png")
    if plot(rows, png, title):
        written.append(png)
    return text, written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="the --csv prefix of the run, e.g. reports/loadtest/locust")
    args = parser.parse_args(argv)
    records = _read(Path(f"{args.prefix}_specdec_requests.csv"), RequestRecord)
    phases = _read(Path(f"{args.prefix}_specdec_phases.csv"), Phase)
    text, written = write_reports(args.prefix, records, phases)
    print(text, end="")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
