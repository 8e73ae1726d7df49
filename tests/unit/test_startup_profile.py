"""The engines timed at start-up price the first burst at a load the server has not served."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.policy.costmodel import CostModel
from coordinator.policy.governor import PLAIN, SPECULATE, LoadGovernor
from coordinator.policy.startup_profile import DRAFT, TARGET, ForwardSample, profile_engines
from tests.fakes import ToyEngine

WINDOW = 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedEngine(ToyEngine):
    """A toy engine whose forwards take ``fixed + per_row * rows`` seconds of ``clock``:
    a plain call one forward of one row per token, a verification one forward of
    its drafts plus one (the prefill of a cached prompt is its last token's row)."""

    def __init__(self, clock: Clock, fixed: float, per_row: float, round_trip: float = 0.0):
        super().__init__()
        self.clock, self.fixed, self.per_row, self.round_trip = clock, fixed, per_row, round_trip
        self.seen: set[tuple[int, ...]] = set()

    def forward(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    async def generate(self, input_ids, max_new_tokens, sampling, draft_tokens=(), draft_logits=None,
                       return_logits=False):
        output = await super().generate(input_ids, max_new_tokens, sampling, draft_tokens, draft_logits,
                                        return_logits)
        prompt = tuple(input_ids)
        prefill = 0 if prompt in self.seen else len(prompt) - 1
        self.seen.add(prompt)
        self.clock.now += self.round_trip + self.forward(prefill + 1)
        if draft_tokens:
            self.clock.now += self.forward(len(draft_tokens) + 1) - self.forward(1)
        else:
            self.clock.now += (len(output.tokens) - 1) * self.forward(1)
        return output


def profile(target, draft, clock, **options):
    return asyncio.run(profile_engines(target, draft, list(range(3, 40)), WINDOW, clock=clock, **options))


def test_each_engine_is_timed_as_serving_reports_it():
    clock = Clock()
    target = TimedEngine(clock, fixed=0.150, per_row=0.010)
    draft = TimedEngine(clock, fixed=0.030, per_row=0.002)
    result = profile(target, draft, clock)
    assert result.seconds_at(TARGET, 1) == pytest.approx(0.160)
    assert result.seconds_at(TARGET, WINDOW + 1) == pytest.approx(0.150 + 0.010 * (WINDOW + 1))
    assert result.seconds_at(DRAFT, 1) == pytest.approx(0.032)
    assert {(s.engine, s.rows) for s in result.samples} == {(TARGET, 1), (TARGET, WINDOW + 1), (DRAFT, 1)}
    # the prompt's prefill (untimed) came first in each engine; the timed calls reuse it
    assert target.calls[0] == (1, 0) and draft.calls[0] == (1, 0)
    assert "target 160.0 ms a forward at 1 row" in result.describe(WINDOW)


def test_each_figure_is_the_least_of_its_tries():
    clock = Clock()
    target = TimedEngine(clock, fixed=0.150, per_row=0.010)
    slow_first = iter([0.5])
    original = target.forward
    target.forward = lambda rows: original(rows) + next(slow_first, 0.0)  # the first forward is slow
    result = profile(target, None, clock, repeats=2)
    assert result.seconds_at(TARGET, 1) == pytest.approx(0.160)
    assert result.seconds_at(DRAFT, 1) is None  # no draft engine, nothing timed for it


@pytest.mark.parametrize("window, repeats", [(0, 3), (4, 0)])
def test_a_profile_needs_a_window_and_a_try(window, repeats):
    with pytest.raises(ValueError, match="window and repeats of at least 1"):
        asyncio.run(profile_engines(ToyEngine(), None, [1, 2, 3], window, repeats=repeats))


def compute_bound_profile() -> list[ForwardSample]:
    """A CPU's engines: every row costs (speculation loses once several streams share a forward)."""
    return [ForwardSample(TARGET, 1, 0.160), ForwardSample(TARGET, WINDOW + 1, 0.260),
            ForwardSample(DRAFT, 1, 0.050)]


def memory_bound_profile() -> list[ForwardSample]:
    """A GPU's: extra rows nearly free, the draft a twentieth of the target."""
    return [ForwardSample(TARGET, 1, 0.020), ForwardSample(TARGET, WINDOW + 1, 0.0205),
            ForwardSample(DRAFT, 1, 0.001)]


@pytest.mark.parametrize("samples, regime", [(compute_bound_profile(), PLAIN), (memory_bound_profile(), SPECULATE)])
def test_a_fresh_servers_first_burst_is_priced_from_the_profile(samples, regime):
    """Before a single request: without the profile the forecast has nothing to
    price a burst of two with, and the governor lets it speculate blind."""
    costs = CostModel()
    governor = LoadGovernor(forecast=lambda streams: costs.forecast(streams, 0.75, WINDOW))
    assert costs.forecast(2, 0.75, WINDOW) is None and governor.speculation_allowed(2)
    costs.observe_profile(samples)
    assert costs.forecast(2, 0.75, WINDOW) is not None
    assert governor.speculation_allowed(2) is (regime == SPECULATE)
    if regime == PLAIN:
        assert "predict plain decoding" in governor.why_plain(2)


def test_the_profile_can_be_turned_off_and_a_value_that_is_not_a_bool_is_refused():
    from coordinator.settings import CoordinatorSettings, SettingsError

    assert CoordinatorSettings().engine_profile
    assert not CoordinatorSettings.from_parameters({"engine_profile": "false"}, environ={}).engine_profile
    with pytest.raises(SettingsError, match="coordinator parameter engine_profile must be bool, got '0'"):
        CoordinatorSettings.from_parameters({"engine_profile": "0"}, environ={})
