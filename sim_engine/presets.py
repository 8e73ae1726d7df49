"""Latency and acceptance presets of the sim profile, each with its source.

A forward's time is ``base + per_row * (rows - 1)`` milliseconds, rows being
all the tokens it carries (prefill rows cost as decode rows). Nothing
GPU-related is claimed from the sim except what the coordinator costs and
decides: the numbers are fixed so that runs compare, not measured here."""

from __future__ import annotations

from dataclasses import dataclass

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


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(f"unknown sim preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


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
