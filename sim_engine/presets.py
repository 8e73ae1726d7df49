"""Latency and acceptance presets of the sim profile, each with its source.

A forward's time is ``base + per_row * (rows - 1)`` milliseconds, rows being
all the tokens it carries (prefill rows cost as decode rows). Nothing
GPU-related is claimed from the sim except what the coordinator costs and
decides: the numbers are fixed so that runs compare, not measured here.

A preset is named (``PRESETS``) or is a timing table that tools/gpu_timing.py
wrote: ``path.json`` (its first pair) or ``path.json#pair`` (the pair of that
name). ``preset`` resolves both, so the launcher's check at start, the Triton
sim engine and the tools accept the same values."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PRESET = "h100-8b-1b"


@dataclass(frozen=True)
class StepTime:
    base_ms: float  # one row
    per_row_ms: float  # each row beyond the first

    def seconds(self, rows: int) -> float:
        return (self.base_ms + self.per_row_ms * max(rows - 1, 0)) / 1000.0


@dataclass(frozen=True)
class Preset:
    name: str
    target: StepTime
    draft: StepTime
    agreement: float  # P(draft's greedy token == target's), per position, independently
    second_choice: float  # where it is not: P(the draft's second choice is the target's token)
    source: str

    def step(self, role: str) -> StepTime:
        return self.target if role == "target" else self.draft


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "h100-8b-1b",
            target=StepTime(7.0, 0.03),
            draft=StepTime(1.5, 0.01),
            agreement=0.8,
            second_choice=0.5,
            source="The order of bf16 decode on one H100 SXM by memory bandwidth: 16 GB of 8B weights at "
                   "3.35 TB/s >= 4.8 ms, 2.5 GB of 1B weights >= 0.75 ms, plus kernel-launch overheads "
                   "(NVIDIA H100 datasheet, HBM3 3.35 TB/s). Acceptance 0.8 per position: the order of "
                   "Llama-3.1-8B/3.2-1B greedy agreement on code and chat. Fixed so that runs compare.",
        ),
        Preset(
            "a100-8b-1b",
            target=StepTime(10.5, 0.04),
            draft=StepTime(2.0, 0.012),
            agreement=0.8,
            second_choice=0.5,
            source="As h100-8b-1b with an A100 80GB SXM's 2.04 TB/s (NVIDIA A100 datasheet): 16 GB / "
                   "2.04 TB/s >= 7.8 ms and 2.5 GB >= 1.2 ms, plus launch overheads.",
        ),
        Preset(
            "h100-70b-1b",
            target=StepTime(25.0, 0.05),
            draft=StepTime(1.5, 0.01),
            agreement=0.75,
            second_choice=0.5,
            source="Llama-3.1-70B in fp8 on two H100s with tensor parallelism (70 GB of weights over "
                   "2 x 3.35 TB/s >= 10.4 ms, plus all-reduces and launches), the 1B draft as in "
                   "h100-8b-1b: the setting of NVIDIA's draft-target BLS example (about 2x at batch 1).",
        ),
    )
}


class UnknownPreset(ValueError):
    pass


TABLE_SUFFIX = ".json"


def is_table(name: str) -> bool:
    """A value whose path (before an optional ``#pair``) ends in .json names a timing table."""
    return name.partition("#")[0].endswith(TABLE_SUFFIX)


def preset(name: str) -> Preset:
    if is_table(name):
        path, _, pair = name.partition("#")
        return preset_from_table(path, pair or None)
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(f"unknown sim preset {name!r}; valid presets: {', '.join(PRESETS)}, or a timing "
                            f"table path{TABLE_SUFFIX}[#pair] (tools/gpu_timing.py)") from None


def absolute(name: str) -> str:
    """``name`` with a table's path made absolute: the Triton model that reads it
    does not run in the launcher's working directory."""
    if not is_table(name):
        return name
    path, hash_, pair = name.partition("#")
    return f"{Path(path).expanduser().resolve()}{hash_}{pair}"


# -- timing tables (tools/gpu_timing.py) ---------------------------------------

ACCEPTANCE_DEFAULTS = DEFAULT_PRESET  # a timing table holds step times only; its acceptance comes from here


def preset_from_table(path: str | Path, pair: str | None = None) -> Preset:
    """The preset of one pair of a timing table: its fitted step times, and the
    acceptance from the table where it has one (it never does as the tool
    writes it: random weights say nothing about agreement), else DEFAULT_PRESET's."""
    table = _read_table(Path(path))
    entry = _pair(table, path, pair)
    where = f"sim preset table {path}, pair {entry['name']!r}"
    fields = entry.get("preset")
    if not isinstance(fields, dict):
        raise UnknownPreset(f"{where}: no field 'preset' (the fitted step times)")
    target, draft = _step(fields, "target", where), _step(fields, "draft", where)
    fallback = PRESETS[ACCEPTANCE_DEFAULTS]
    agreement = _fraction(fields, "agreement", fallback.agreement, where)
    second_choice = _fraction(fields, "second_choice", fallback.second_choice, where)
    return Preset(f"{path}#{entry['name']}", target, draft, agreement, second_choice,
                  _table_source(table, entry, path, [k for k in ("agreement", "second_choice") if k in fields]))


def _read_table(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as error:
        raise UnknownPreset(f"sim preset table {path}: cannot read it ({error.strerror or error})") from None
    try:
        table = json.loads(text)
    except ValueError as error:
        raise UnknownPreset(f"sim preset table {path}: not valid JSON ({error})") from None
    pairs = table.get("pairs") if isinstance(table, dict) else None
    if not isinstance(pairs, list) or not pairs or not all(isinstance(p, dict) and "name" in p for p in pairs):
        raise UnknownPreset(f"sim preset table {path}: no field 'pairs' (a non-empty list of named pairs, as "
                            "tools/gpu_timing.py writes it)")
    return table


def _pair(table: dict, path, name: str | None) -> dict:
    pairs = table["pairs"]
    if name is None:
        return pairs[0]
    for entry in pairs:
        if entry["name"] == name:
            return entry
    raise UnknownPreset(f"sim preset table {path}: no pair {name!r}; pairs in the file: "
                        f"{', '.join(str(p['name']) for p in pairs)}")


def _step(fields: dict, role: str, where: str) -> StepTime:
    step = fields.get(role)
    if not isinstance(step, dict):
        raise UnknownPreset(f"{where}: no field 'preset.{role}' (base_ms and per_row_ms)")
    base = _number(step, "base_ms", f"preset.{role}", where)
    per_row = _number(step, "per_row_ms", f"preset.{role}", where)
    if base <= 0:
        raise UnknownPreset(f"{where}: field 'preset.{role}.base_ms' must be above 0, got {base}")
    return StepTime(base, per_row)


def _number(fields: dict, key: str, prefix: str, where: str) -> float:
    if key not in fields:
        raise UnknownPreset(f"{where}: no field '{prefix}.{key}'")
    value = fields[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UnknownPreset(f"{where}: field '{prefix}.{key}' must be a finite number >= 0, got {value!r}")
    return float(value)


def _fraction(fields: dict, key: str, default: float, where: str) -> float:
    if key not in fields:
        return default
    value = _number(fields, key, "preset", where)
    if value > 1:
        raise UnknownPreset(f"{where}: field 'preset.{key}' must be a probability (0 to 1), got {value}")
    return value


def _table_source(table: dict, entry: dict, path, from_table: list[str]) -> str:
    machine = table.get("machine", {}) if isinstance(table.get("machine"), dict) else {}
    tiny = " TINY test configs, not the real architectures:" if table.get("tiny") else ""
    acceptance = {0: f"acceptance from the {ACCEPTANCE_DEFAULTS} preset (a timing table holds none)",
                  1: f"{' '.join(from_table)} from the table, the rest of the acceptance from the "
                     f"{ACCEPTANCE_DEFAULTS} preset",
                  2: "acceptance from the table"}[len(from_table)]
    return (f"Timing table {path}, pair {entry['name']}:{tiny} step times fitted at context "
            f"{entry.get('context', '?')} on {machine.get('device', 'an unnamed device')} with Hugging Face "
            f"PyTorch forwards of random weights (tools/gpu_timing.py; an upper bound on an engine's step times); "
            f"{acceptance}.")


def expected_tokens(agreement: float, window: int) -> float:
    """Tokens one round emits on average with ``window`` drafts accepted
    independently with probability ``agreement`` each: the accepted prefix plus one."""
    if agreement >= 1.0:
        return window + 1.0
    return (1.0 - agreement ** (window + 1)) / (1.0 - agreement)


def ideal(p: Preset, streams: int = 1, max_window: int = 8) -> tuple[float, int]:
    """The ideal speed-up of greedy speculative over plain decoding at ``streams``
    streams in lock-step, from the step times and the acceptance alone (no
    serving overhead), and the window that reaches it. A round: ``window`` draft
    forwards of ``streams`` rows, then one target forward of ``streams * (window + 1)`` rows."""
    plain = p.target.seconds(streams)  # one token per stream
    best, best_window = 1.0, 0
    for window in range(1, max_window + 1):
        round_seconds = window * p.draft.seconds(streams) + p.target.seconds(streams * (window + 1))
        speedup = expected_tokens(p.agreement, window) / round_seconds * plain
        if speedup > best:
            best, best_window = speedup, window
    return best, best_window
