"""The side-by-side table of an AIPerf sweep: speculation on against off.

Pure: parsed AIPerf exports (``profile_export_aiperf.json``, AIPerf 0.13.0's
layout: one object per metric with its ``unit`` and ``avg``/``p50``/...)
in, rows and a markdown table out. ``tools/aiperf_sweep.py`` runs AIPerf and
reads the files; keeping the arithmetic here lets it be tested in
milliseconds on a trimmed real export (``tests/data/aiperf_export.json``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# (key in our rows, AIPerf's metric, its statistic we report, markdown heading)
METRICS = (
    ("output_token_throughput", "output_token_throughput", "avg", "output tokens/s"),
    ("request_throughput", "request_throughput", "avg", "requests/s"),
    ("ttft_ms", "time_to_first_token", "p50", "p50 TTFT ms"),
    ("itl_ms", "inter_token_latency", "p50", "p50 ITL ms"),
    ("request_latency_ms", "request_latency", "p50", "p50 request latency ms"),
)
MODES = ("on", "off")  # speculation on: the server's default; off: speculation_window 0


@dataclass(frozen=True)
class Run:
    """One ``aiperf profile`` of the sweep and what it left."""

    endpoint: str  # template, chat or completions
    concurrency: int
    mode: str  # "on" or "off"
    export: dict | None  # the parsed JSON export; None when AIPerf wrote none
    failure: str = ""  # why there is no export (AIPerf's exit status and last words)


class ExportError(ValueError):
    """An export that is not shaped like AIPerf 0.13.0's."""


def _stat(export: dict, metric: str, stat: str) -> float | None:
    entry = export.get(metric)
    if entry is None:
        return None  # e.g. no TTFT without streaming, no errors in a clean run
    if not isinstance(entry, dict) or stat not in entry:
        raise ExportError(f"AIPerf export: metric {metric!r} has no {stat!r} (got {entry!r:.200})")
    return float(entry[stat])


def run_metrics(run: Run) -> dict:
    """A run's figures: the reported metrics, successful requests and errors. A run
    without an export counts as failed (``errors`` None, ``failure`` says why)."""
    if run.export is None:
        return {"requests": 0, "errors": None, "failure": run.failure or "no AIPerf export"}
    figures = {key: _stat(run.export, metric, stat) for key, metric, stat, _ in METRICS}
    figures["requests"] = int(_stat(run.export, "request_count", "avg") or 0)
    figures["errors"] = int(_stat(run.export, "error_request_count", "avg") or 0)
    figures["error_messages"] = [
        str(item.get("error_details", {}).get("message", item))[:300] for item in run.export.get("error_summary", [])
    ]
    figures["failure"] = run.failure or ("AIPerf cancelled the run" if run.export.get("was_cancelled") else "")
    return figures


def _ratio(on: float | None, off: float | None) -> float | None:
    if on is None or off is None or off == 0:
        return None
    return on / off


def build_rows(runs: Iterable[Run]) -> list[dict]:
    """One row per endpoint and concurrency (in the order the runs came), each with
    the ``on`` and ``off`` figures (None for a mode not run) and ``ratio``: on / off
    of every reported metric."""
    rows: dict[tuple[str, int], dict] = {}
    for run in runs:
        if run.mode not in MODES:
            raise ValueError(f"speculation mode must be one of {MODES}, got {run.mode!r}")
        row = rows.setdefault((run.endpoint, run.concurrency),
                              {"endpoint": run.endpoint, "concurrency": run.concurrency, "on": None, "off": None})
        if row[run.mode] is not None:
            raise ValueError(f"two runs of {run.endpoint} at concurrency {run.concurrency} with speculation {run.mode}")
        row[run.mode] = run_metrics(run)
    for row in rows.values():
        on, off = row["on"] or {}, row["off"] or {}
        row["ratio"] = {key: _ratio(on.get(key), off.get(key)) for key, *_ in METRICS}
    return list(rows.values())


def failed(figures: dict | None) -> bool:
    """Whether a mode's run had errors or did not complete (a mode not run did not fail)."""
    if figures is None:
        return False
    return bool(figures.get("failure")) or figures.get("errors") != 0


def has_errors(rows: Iterable[dict]) -> bool:
    return any(failed(row[mode]) for row in rows for mode in MODES)


def _number(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def _cell(row: dict, key: str) -> str:
    return " / ".join(_number((row[mode] or {}).get(key)) for mode in MODES)


def _errors(figures: dict | None) -> str:
    if figures is None:
        return "–"
    if figures.get("errors") is None:
        return "failed"
    return str(figures["errors"]) + (" (failed)" if figures.get("failure") else "")


def markdown(rows: list[dict]) -> str:
    """The table: each metric as "on / off", and on / off of the output token throughput."""
    headings = ["endpoint", "concurrency", "requests on / off"]
    for key, _, _, heading in METRICS:
        headings.append(f"{heading} on / off")
        if key == "output_token_throughput":
            headings.append("tokens/s on ÷ off")
    headings.append("errors on / off")
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for row in rows:
        cells = [row["endpoint"], str(row["concurrency"]),
                 " / ".join(str((row[mode] or {}).get("requests", "–")) for mode in MODES)]
        for key, *_ in METRICS:
            cells.append(_cell(row, key))
            if key == "output_token_throughput":
                ratio = row["ratio"][key]
                cells.append("–" if ratio is None else f"**{ratio:.2f}×**")
        cells.append(" / ".join(_errors(row[mode]) for mode in MODES))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
