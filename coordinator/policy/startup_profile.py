"""The engines' forward costs, timed once when the coordinator starts.

The batch forecast (batchcost.py) prices a load from the engines' forward
costs as functions of rows, and serving feeds it, but only at the loads and
in the regimes served. A fresh replica whose first traffic is a burst of
several streams has timed no draft forward: the forecast cannot price the
burst, and the load governor lets it speculate blind, each request paying
the draft's catch-up on its prompt, until epochs have measured the load.
So before the coordinator serves, it times a few calls of each engine on a
short prompt of its own: the target decoding (one row a forward) and
verifying a window (window + 1 rows), the draft proposing (one row a
forward), each the least of ``repeats`` tries: about 16 forwards, a few
seconds on a CPU, milliseconds on a GPU. The samples are what serving's
rounds report (costmodel.CostModel.observe), round trips included, so the
forecast prices the first burst as it will price the hundredth; serving's
own samples take over as they come (the fits weigh recent forwards more).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.engines.contract import Engine
from coordinator.sampling.params import SamplingParams

TARGET, DRAFT = "target", "draft"
REPEATS = 2
# What the engines are timed on: code, as served, long enough that its prefill is
# not a one-row call, short enough to cost a second on a CPU.
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\ndef multiply(a, b):\n"
PLAIN_TOKENS = 2  # tokens of each timed plain call (its round trip spread over them)
DRAFT_TOKENS = 4  # most tokens of each timed draft call


@dataclass(frozen=True)
class ForwardSample:
    """One engine's forward at ``rows`` rows took ``seconds`` (round trip included)."""

    engine: str  # TARGET or DRAFT
    rows: int
    seconds: float


@dataclass(frozen=True)
class EngineProfile:
    samples: tuple[ForwardSample, ...]
    seconds: float  # the profile's own wall time

    def seconds_at(self, engine: str, rows: int) -> float | None:
        return next((s.seconds for s in self.samples if s.engine == engine and s.rows == rows), None)

    def describe(self, window: int) -> str:
        def ms(engine: str, rows: int) -> str:
            value = self.seconds_at(engine, rows)
            return "not timed" if value is None else f"{1000 * value:.1f} ms"

        return (f"target {ms(TARGET, 1)} a forward at 1 row, {ms(TARGET, window + 1)} at {window + 1} rows; "
                f"draft {ms(DRAFT, 1)} a forward at 1 row (measured in {self.seconds:.1f} s)")


async def profile_engines(target: Engine, draft: Engine | None, prompt: Sequence[int], window: int, *,
                          repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter) -> EngineProfile:
    """Time each engine on ``prompt`` (greedy; its prefill first, untimed, so the
    timed calls reuse its cache as a request's later rounds do)."""
    if window < 1 or repeats < 1 or not prompt:
        raise ValueError("profile_engines needs a window and repeats of at least 1 and a prompt")
    greedy = SamplingParams()
    context = list(prompt)
    started = clock()
    best: dict[tuple[str, int], float] = {}

    def keep(engine: str, rows: int, seconds: float) -> None:
        key = (engine, rows)
        best[key] = min(seconds, best.get(key, seconds))

    await target.generate(context, 1, greedy)
    if draft is not None:
        await draft.generate(context, 1, greedy)
    for _ in range(repeats):
        began = clock()
        out = await target.generate(context, PLAIN_TOKENS, greedy)
        keep(TARGET, 1, (clock() - began) / max(1, len(out.tokens)))
        drafts = [int(token) for token in out.tokens[:window]] or [int(context[-1])]
        drafts += drafts[-1:] * (window - len(drafts))
        began = clock()
        await target.generate(context, window + 1, greedy, draft_tokens=drafts)
        keep(TARGET, window + 1, clock() - began)
        if draft is not None:
            began = clock()
            out = await draft.generate(context, min(window, DRAFT_TOKENS), greedy)
            keep(DRAFT, 1, (clock() - began) / max(1, len(out.tokens)))
    samples = tuple(ForwardSample(engine, rows, seconds) for (engine, rows), seconds in sorted(best.items()))
    return EngineProfile(samples, clock() - started)
