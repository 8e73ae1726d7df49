"""The batch forecast (coordinator/policy/batchcost.py): forward fits from
timed calls, the goodput of a whole batch per regime, and its use where the
load governor has measured nothing."""

import math

import pytest

from coordinator.policy.batchcost import BatchForecaster, CpuFit, Forecast, ForwardFit
from coordinator.policy.costmodel import CostModel, MovingAverage
from coordinator.policy.expectation import expected_tokens_per_round
from coordinator.policy.governor import PLAIN, SPECULATE, LoadGovernor
from coordinator.rounds import Round


def line(fixed, per_row):
    return lambda rows: fixed + per_row * rows


def fitted(forward, rows_seen) -> ForwardFit:
    fit = ForwardFit()
    for rows in rows_seen:
        fit.add(rows, forward(rows))
    return fit


def test_a_fit_recovers_a_forwards_fixed_and_per_row_cost():
    fit = fitted(line(0.150, 0.030), [1, 5, 1, 5, 2, 10])
    fixed, per_row = fit.line()
    assert math.isclose(fixed, 0.150, rel_tol=1e-9) and math.isclose(per_row, 0.030, rel_tol=1e-9)
    assert math.isclose(fit.predict(32), 0.150 + 0.030 * 32, rel_tol=1e-9)


def test_one_row_count_is_no_line_and_noise_never_gives_a_negative_slope_or_fixed_cost():
    assert fitted(line(0.1, 0.01), [3, 3, 3]).line() is None
    assert ForwardFit().line() is None and ForwardFit().predict(4) is None
    falling = ForwardFit()
    for rows, seconds in [(1, 0.20), (4, 0.19), (1, 0.21), (4, 0.18)]:
        falling.add(rows, seconds)
    fixed, per_row = falling.line()
    assert per_row == 0.0 and math.isclose(fixed, 0.195, rel_tol=1e-3)  # the recency-weighted mean
    steep = fitted(line(-0.5, 0.3), [2, 4, 8])  # a line through negative time at 0 rows
    fixed, per_row = steep.line()
    assert fixed == 0.0 and per_row > 0


def test_a_long_run_at_one_row_count_keeps_the_last_slope_and_follows_the_level():
    """One stream decoding plainly for a while: hundreds of 1-row forwards decay the
    start-up profile's 9-row forward away. The forecast needs a line all the same."""
    fit = fitted(line(0.130, 0.001), [1, 9, 1] + [1] * 2000)
    assert fit._least_squares() is None  # the rows' spread is gone
    for _ in range(2000):
        fit.add(1, 0.120)  # the machine a little faster meanwhile
    fixed, per_row = fit.line()
    assert math.isclose(per_row, 0.001, rel_tol=1e-6) and math.isclose(fixed + per_row, 0.120, rel_tol=1e-3)
    assert math.isclose(fit.predict(9), 0.128, rel_tol=1e-3)


def test_recent_forwards_outweigh_old_ones():
    fit = fitted(line(0.2, 0.05), [1, 4] * 50)
    for _ in range(400):  # the machine got twice as fast
        fit.add(1, 0.125)
        fit.add(4, 0.2)
    assert abs(fit.predict(1) - 0.125) / 0.125 < 0.05


def forecaster(target, draft, rows_seen=(1, 5)) -> BatchForecaster:
    batch = BatchForecaster.empty()
    for rows in rows_seen:
        batch.observe_target(rows, target(rows))
        batch.observe_draft(rows, draft(rows))
    return batch


def test_the_forecast_is_the_batch_goodput_of_each_regime_at_the_best_window():
    target, draft = line(0.150, 0.030), line(0.030, 0.002)
    forecast = forecaster(target, draft).forecast(4, acceptance=0.8, max_window=6)
    assert math.isclose(forecast.plain, 4 / target(4)) and math.isclose(forecast.plain_step, target(4))
    # the streams run out of step, in two groups of 2: each group's forwards carry 2 streams
    rates = {k: 4 * expected_tokens_per_round(0.8, k) / (2 * (k * draft(2) + target(2 * (k + 1))))
             for k in range(1, 7)}
    best = max(rates, key=rates.get)
    assert forecast.window == best and math.isclose(forecast.speculative, rates[best])


def test_compute_bound_forwards_make_plain_faster_at_a_load_where_memory_bound_ones_keep_speculation():
    draft = line(0.010, 0.0005)
    compute_bound = forecaster(line(0.100, 0.050), draft).forecast(8, acceptance=0.9, max_window=8)
    memory_bound = forecaster(line(0.150, 0.001), draft).forecast(8, acceptance=0.9, max_window=8)
    assert compute_bound.faster == PLAIN and memory_bound.faster == SPECULATE
    # one stream on the compute-bound engines: verification rows still pay there
    assert forecaster(line(0.100, 0.050), draft).forecast(1, 0.7, 8).faster == SPECULATE


def test_streams_out_of_step_cost_speculation_the_fixed_costs_a_batch_in_step_would_share():
    """Two streams, each speculating on its own: one drafts while the other verifies, so
    every forward carries one stream and the pair serves what one stream alone does
    (measured so on a 2-vCPU Intel Xeon with AMX: 5.8-6.2 tokens/s at 2 streams, 6.6 at
    one), where one batch in step would have shared each forward's fixed cost."""
    target, draft = line(0.150, 0.002), line(0.030, 0.0005)
    batch = forecaster(target, draft)
    one, two = batch.forecast(1, 0.75, 8), batch.forecast(2, 0.75, 8)
    assert two.speculative == pytest.approx(one.speculative) and two.plain == pytest.approx(2 / target(2))
    assert one.faster == SPECULATE and two.faster == PLAIN
    in_step = max(2 * expected_tokens_per_round(0.75, k) / (k * draft(2) + target(2 * (k + 1))) for k in range(1, 9))
    assert in_step > 1.15 * two.plain  # what the forecast read before: speculation at 2 streams


def test_a_draft_measured_at_one_row_count_grows_with_rows_as_the_target_does():
    batch = BatchForecaster.empty()
    for rows in (1, 5):
        batch.observe_target(rows, 0.1 + 0.02 * rows)
    batch.observe_draft(1, 0.03)
    assert math.isclose(batch.draft_seconds(1), 0.03)
    assert math.isclose(batch.draft_seconds(4), 0.03 * (0.1 + 0.02 * 4) / (0.1 + 0.02 * 1))


def test_nothing_is_forecast_until_both_engines_were_timed():
    batch = BatchForecaster.empty()
    assert batch.forecast(2, 0.7, 4) is None
    batch.observe_target(1, 0.1)
    batch.observe_target(4, 0.2)
    assert batch.forecast(2, 0.7, 4) is None  # no draft forward yet
    batch.observe_draft(1, 0.02)
    assert batch.forecast(2, 0.7, 4) is not None


def test_the_cost_model_feeds_the_fits_with_the_rows_its_rounds_carried():
    costs = CostModel(streams=2)
    costs.observe(Round(tokens=[1, 2, 3], drafted=0, accepted=0, finished=False, target_sample=0.6))
    costs.observe(Round(tokens=[1, 2, 3], drafted=3, accepted=2, finished=False, drafter="draft_model",
                        draft_sample=0.09, target_sample=0.5))
    # prompt lookup's drafts are a search, not draft forwards: only its verification is a sample
    costs.observe(Round(tokens=[1], drafted=2, accepted=0, finished=False, drafter="prompt_lookup",
                        draft_sample=0.001, target_sample=0.4))
    target, draft = costs.batch.target, costs.batch.draft
    assert target.samples == 3 and draft.samples == 1
    assert draft.mean() == pytest.approx((2, 0.03))  # 2 streams, one draft forward per drafted token
    # plain: 2 rows at 0.2 s a forward; verification: 2 streams of 4 rows, and of 3 rows
    fixed, per_row = target.line()
    assert fixed + per_row * 2 == pytest.approx(0.2, abs=0.02) and per_row > 0


def test_a_load_never_measured_starts_in_the_regime_the_forecast_prices_faster():
    def governor_over(target):
        batch = forecaster(target, line(0.010, 0.0005))
        return LoadGovernor(forecast=lambda streams: batch.forecast(streams, 0.9, 8))
    compute_bound, memory_bound = governor_over(line(0.100, 0.050)), governor_over(line(0.150, 0.001))
    assert not compute_bound.speculation_allowed(8) and memory_bound.speculation_allowed(8)
    assert compute_bound.speculation_allowed(1)  # one stream is never governed
    reason = compute_bound.why_plain(8)
    assert "forward costs and the coordinator's CPU predict plain decoding" in reason and "not measured at this load yet" in reason, reason


def test_measured_epochs_overrule_the_forecast():
    clock = [0.0]
    batch = forecaster(line(0.100, 0.050), line(0.030, 0.001))
    governor = LoadGovernor(epoch_seconds=10.0, explore_every=2, max_explore_every=2, clock=lambda: clock[0],
                            forecast=lambda streams: batch.forecast(streams, 0.7, 8))
    governor.emitted(0, 8)
    seen = []
    for _ in range(12):  # speculation in fact serves more here: the forecast was wrong
        regime = SPECULATE if governor.speculation_allowed(8) else PLAIN
        seen.append(regime)
        for _ in range(10):
            clock[0] += 1.0
            governor.emitted({SPECULATE: 30.0, PLAIN: 10.0}[regime], 8)
    assert seen[0] == PLAIN, seen  # the forecast's start
    # speculation is tried as it would be after a lost try, wins its two epochs,
    # and from then on only single epochs of plain decoding re-check the verdict
    first = seen.index(SPECULATE)
    assert first <= 4 and seen[first:first + 2] == [SPECULATE] * 2, seen
    after = seen[first:]
    assert not any(a == b == PLAIN for a, b in zip(after, after[1:])), seen
    assert seen[first:].count(SPECULATE) > 2 * seen[first:].count(PLAIN), seen


def test_epochs_calibrate_the_forecast_at_loads_not_measured_yet():
    """The raw forecast prices speculation 1.2x plain at every load, but its epochs at 2 streams
    serve half what it predicted: the calibrated forecast carries that to 8 streams, never
    measured, which then starts plain; the error of each epoch's prediction is kept per regime."""
    def raw(streams):
        return Forecast(streams, plain=5.0 * streams, speculative=6.0 * streams, window=4, plain_step=0.2)

    clock = [0.0]
    governor = LoadGovernor(epoch_seconds=10.0, clock=lambda: clock[0], forecast=raw)
    assert LoadGovernor(forecast=raw).speculation_allowed(8) and governor.predicted(8) == raw(8)  # before any epoch
    governor.emitted(0, 2)
    measured = {SPECULATE: 6.0, PLAIN: 10.0}  # at 2 streams: speculation 0.5x, plain 1.0x its forecast
    for _ in range(6):
        regime = SPECULATE if governor.speculation_allowed(2) else PLAIN
        for _ in range(10):
            clock[0] += 1.0
            governor.emitted(measured[regime], 2)
    assert set(governor.calibration) == {PLAIN, SPECULATE}
    at_eight = governor.predicted(8)
    assert at_eight.speculative == pytest.approx(24.0, rel=0.05) and at_eight.plain == pytest.approx(40.0, rel=0.05)
    assert not governor.speculation_allowed(8)  # priced from the calibrated forecast
    assert "predict plain decoding 40" in governor.why_plain(8)
    assert governor.forecast_error[SPECULATE] == pytest.approx(0.0, abs=0.05)  # learnt by the last epochs
    errors = governor.take_epoch_errors()  # every epoch's, for the metrics' histogram
    assert {regime for regime, _ in errors} == {SPECULATE, PLAIN} and len(errors) >= 5
    assert errors[-1][1] == governor.forecast_error[errors[-1][0]]
    assert governor.take_epoch_errors() == []
    assert governor.predicted(1).plain == pytest.approx(5.0, rel=0.05)  # the metrics show one stream too


def test_an_uncalibrated_forecast_of_speculation_must_win_by_a_margin():
    def governor_over(speculative):
        return LoadGovernor(forecast=lambda streams: Forecast(streams, plain=10.0, speculative=speculative,
                                                              window=4, plain_step=0.2))
    assert not governor_over(11.0).speculation_allowed(2)  # 10 % better: within the raw model's error
    assert governor_over(11.0).why_plain(2).endswith(
        "speculation's 11.00 at 2 streams (not measured at this load yet); until its epochs have "
        "calibrated the forecast, speculation must be predicted 15% faster")
    assert governor_over(12.0).speculation_allowed(2)
    calibrated = governor_over(11.0)
    calibrated.calibration[SPECULATE] = MovingAverage(1.0, 2)  # its epochs measured what it predicted
    assert calibrated.speculation_allowed(2)


def test_the_coordinators_cpu_per_round_and_per_plain_token_are_told_apart_from_mixed_intervals():
    """Intervals of serving mix speculative rounds and plain tokens; the fit recovers
    what each costs the coordinator's CPU, and says nothing of a cost it cannot tell."""
    fit = CpuFit()
    for rounds, tokens in [(100, 20), (40, 300), (10, 900), (200, 0), (0, 500)] * 4:
        fit.add(0.002 * rounds + 0.0003 * tokens, rounds, tokens)
    per_round, per_token = fit.costs()
    assert per_round == pytest.approx(0.002) and per_token == pytest.approx(0.0003)
    only_plain = CpuFit()
    only_plain.add(0.3, 0, 1000)
    assert only_plain.costs() == (None, pytest.approx(0.0003))
    same_mix = CpuFit()  # every interval in the same proportion: the two costs cannot be told apart
    for scale in (1, 2, 3):
        same_mix.add(scale * 0.23, 100 * scale, 100 * scale)
    assert same_mix.costs() == (None, None)


def test_a_coordinator_at_its_cpu_bound_caps_each_regime_and_plain_decoding_wins():
    """GPU-like forwards (7 ms, nearly free rows) and a cheap, accurate draft: the
    engines alone price speculation 2x plain decoding at 16 streams, but a speculative
    round costs the coordinator 4 ms of CPU and a plain token 0.3 ms; one process
    spends about a CPU second a second, so speculation is capped at 250 rounds/s
    (under 1,850 tokens/s even at the longest window, which the cap favours) and plain
    decoding, at ~2,100, is the faster regime. At one stream neither bound binds."""
    gpu = forecaster(line(0.007, 0.00003), line(0.0005, 0.00001))
    uncapped = gpu.forecast(16, acceptance=0.95, max_window=8)
    assert uncapped.faster == SPECULATE and uncapped.speculative > 1.9 * uncapped.plain
    for rounds, tokens in [(200, 50), (50, 2000)] * 3:
        gpu.cpu.add(0.004 * rounds + 0.0003 * tokens, rounds, tokens)
    capped = gpu.forecast(16, acceptance=0.95, max_window=8)
    assert capped.faster == PLAIN and capped.window == 8
    assert capped.speculative == pytest.approx(expected_tokens_per_round(0.95, 8) / 0.004)
    assert capped.plain == pytest.approx(uncapped.plain)  # 2,100 tokens/s: under plain's CPU bound of 3,300
    one = gpu.forecast(1, acceptance=0.95, max_window=8)
    assert one == uncapped_at_one(gpu)


def uncapped_at_one(batch: BatchForecaster):
    bare = BatchForecaster(batch.target, batch.draft)
    return bare.forecast(1, acceptance=0.95, max_window=8)


def test_the_cost_model_samples_the_coordinators_cpu_once_a_second_against_the_rounds_between():
    wall, cpu = [0.0], [5.0]
    costs = CostModel(cpu_clock=lambda: cpu[0], wall_clock=lambda: wall[0])
    spec = Round([1, 2, 3], 3, 2, False, 0.004, 0.008, drafter="draft_model", draft_sample=0.004, target_sample=0.008)
    plain = Round([7], 0, 0, False, 0.0, 0.007, target_sample=0.007)
    for second in range(6):
        for _ in range(100 if second % 2 else 20):
            wall[0] += 0.01 if second % 2 else 0.05
            cpu[0] += 0.002
            costs.observe(spec)
        for _ in range(50 if second % 2 else 200):
            cpu[0] += 0.0003
            costs.observe(plain)
    assert costs.batch.cpu.samples >= 4
    per_round, per_token = costs.coordinator_cpu()
    assert per_round == pytest.approx(0.002, rel=0.05) and per_token == pytest.approx(0.0003, rel=0.1)
    assert CostModel().coordinator_cpu() == (None, None)  # no CPU clock: nothing measured, nothing capped


def test_a_held_back_request_is_told_why_when_the_forecast_now_favours_speculation():
    """The load started plain on the forecast when its first request asked; the forecast has
    since moved (more forwards timed), but the regime waits for speculation's turn."""
    prices = {PLAIN: 10.0, SPECULATE: 8.0}
    clock = [0.0]
    governor = LoadGovernor(epoch_seconds=10.0, clock=lambda: clock[0], forecast=lambda streams: Forecast(
        streams, plain=prices[PLAIN], speculative=prices[SPECULATE], window=4, plain_step=0.2))
    assert not governor.speculation_allowed(2)
    governor.emitted(0, 2)
    for _ in range(10):
        clock[0] += 1.0
        governor.emitted(10.0, 2)
    prices[SPECULATE] = 13.0  # 30 % faster now
    assert not governor.speculation_allowed(2)
    assert governor.why_plain(2).endswith("; the load started plain when it was first priced, "
                                          "and speculation is tried in its turn")
