"""The server-wide load switch (coordinator/policy/governor.py) with a fake clock."""

from coordinator.policy.costmodel import CostModel, MovingAverage
from coordinator.policy.governor import PLAIN, SPECULATE, LoadGovernor
from coordinator.policy.speculation import UNBOUNDED, Mode, SpeculationPolicy


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def governed(streams, **settings):
    """A governor on a fake clock whose first epoch at ``streams`` requests has started."""
    clock = Clock()
    governor = LoadGovernor(epoch_seconds=10.0, clock=clock, **settings)
    governor.emitted(0, streams)
    return clock, governor


def run_epoch(governor, clock, tokens_per_second, streams, seconds=10.0):
    """One epoch of ``seconds`` at ``streams`` requests emitting ``tokens_per_second`` together."""
    for _ in range(int(seconds)):
        clock.now += 1.0
        governor.emitted(tokens_per_second, streams)


def regimes_over(governor, clock, rates, streams, epochs):
    seen = []
    for _ in range(epochs):
        seen.append(PLAIN if not governor.speculation_allowed(streams) else SPECULATE)
        run_epoch(governor, clock, rates[seen[-1]], streams)
    return seen


def test_plain_decoding_wins_where_it_serves_more_tokens_and_speculation_is_retried_ever_more_rarely():
    clock = Clock()
    governor = LoadGovernor(epoch_seconds=10.0, explore_every=5, max_explore_every=20, clock=clock)
    governor.emitted(0, 8)  # the first epoch at 8 streams starts
    seen = regimes_over(governor, clock, {SPECULATE: 4.0, PLAIN: 11.0}, streams=8, epochs=62)
    assert seen[:4] == [SPECULATE, SPECULATE, PLAIN, PLAIN]  # two epochs of each are measured first
    # then plain; speculation is tried again for one epoch after 5 epochs won by plain, and each try
    # that loses doubles the wait (10, then 20, the most here)
    tries = [epoch for epoch, regime in enumerate(seen) if regime == SPECULATE]
    assert tries == [0, 1, 8, 19, 40, 61]
    assert abs(governor.rate(8, PLAIN) - 11.0) < 1e-9


def test_a_try_that_wins_resets_the_wait_between_tries():
    clock, governor = governed(8, explore_every=3, max_explore_every=12)
    seen = regimes_over(governor, clock, {SPECULATE: 4.0, PLAIN: 11.0}, streams=8, epochs=20)
    assert [epoch for epoch, regime in enumerate(seen) if regime == SPECULATE] == [0, 1, 6, 13]
    # the workload changes: speculation now serves more, and wins the next try
    seen = regimes_over(governor, clock, {SPECULATE: 30.0, PLAIN: 11.0}, streams=8, epochs=40)
    first_win = seen.index(SPECULATE)
    assert seen[:first_win] == [PLAIN] * first_win and first_win <= 12  # the try was due within the longest wait
    # speculating now, plain decoding is tried again after 3 epochs, not after the 12 plain had reached
    assert seen[first_win:first_win + 5] == [SPECULATE] * 3 + [PLAIN, SPECULATE]


def test_each_load_has_its_own_regime_and_speculation_keeps_winning_where_it_pays():
    clock, governor = governed(2, explore_every=4)
    seen = regimes_over(governor, clock, {SPECULATE: 7.0, PLAIN: 5.0}, streams=2, epochs=10)
    assert seen.count(SPECULATE) >= 7 and seen[4:7] == [SPECULATE] * 3
    assert governor.speculation_allowed(8)  # nothing measured at 8 streams: speculation is the default


def test_one_stream_is_not_governed():
    clock, governor = governed(1)
    regimes_over(governor, clock, {SPECULATE: 1.0, PLAIN: 9.0}, streams=1, epochs=6)
    assert governor.rates == {} and governor.speculation_allowed(1)


def test_an_epoch_cut_short_by_a_change_of_load_measures_nothing():
    clock = Clock()
    governor = LoadGovernor(epoch_seconds=10.0, clock=clock)
    for streams in (2, 4, 2, 4, 2, 4):
        clock.now += 6.0
        governor.emitted(10, streams)
    assert governor.rates == {}


def test_an_epoch_with_an_engine_failure_measures_nothing():
    """A target reloading for 40 s under two streams: the epoch that spans the
    outage would record a speculative rate of almost nothing, and plain decoding
    would win that load until speculation is explored again."""
    clock, governor = governed(2)
    run_epoch(governor, clock, 7.0, streams=2, seconds=4)  # speculating when the engine dies
    governor.disrupted()
    clock.now += 40.0  # the reload: nothing emitted
    run_epoch(governor, clock, 7.0, streams=2, seconds=9)  # serving again, a partial epoch
    assert governor.rates == {}
    run_epoch(governor, clock, 7.0, streams=2, seconds=2)  # the epoch that started after the outage ends
    # counted, the outage would end the first epoch at 35 tokens over 45 s (0.8 tokens/s)
    assert governor.rate(2, SPECULATE) > 6.5 and governor.speculation_allowed(2)


def test_a_failed_draft_call_disrupts_the_governors_epoch():
    governor = LoadGovernor(epoch_seconds=10.0, clock=Clock())
    policy = SpeculationPolicy(5, 0.3, costs=CostModel(), governor=governor)
    governor._bucket = 2
    policy.draft_failed(RuntimeError("draft: stub process is not healthy"))
    assert governor._bucket is None and policy.mode is Mode.DRAFT_FAILED


def test_a_held_back_request_decodes_plainly_in_stretches_and_resumes_without_a_fallback():
    """It is no fallback (the mode stays speculating), but its fallback_reason says why it decoded plainly."""
    clock = Clock()
    governor = LoadGovernor(epoch_seconds=10.0, clock=clock)
    governor.regimes[governor_bucket(4)] = PLAIN
    costs = CostModel(streams=4)
    policy = SpeculationPolicy(5, 0.3, costs=costs, first_round_plain=False, governor=governor)
    assert policy.held_back and policy.window() == 0 and policy.plain_rounds_planned() == UNBOUNDED
    assert policy.mode is Mode.SPECULATING
    assert policy.reason == ("the load governor holds speculation back at 3-4 streams: "
                             "plain decoding measured faster at a lower load")
    governor.rates[(governor_bucket(4), PLAIN)] = MovingAverage(10.5, 3)
    governor.rates[(governor_bucket(4), SPECULATE)] = MovingAverage(8.25, 2)
    policy.window()
    assert policy.reason.endswith("3-4 streams: plain decoding measured 10.50 tokens/s against speculation's 8.25")
    costs.streams = 1  # another load bucket, where nothing says plain
    assert not policy.held_back and policy.window() > 0


def governor_bucket(streams):
    from coordinator.policy.costmodel import load_bucket

    return load_bucket(streams)


def test_a_higher_load_starts_plain_where_a_lower_one_measured_plain_faster_and_still_explores():
    clock, governor = governed(2, explore_every=4)
    regimes_over(governor, clock, {SPECULATE: 5.0, PLAIN: 7.0}, streams=2, epochs=6)
    assert not governor.speculation_allowed(2)
    assert not governor.speculation_allowed(4) and not governor.speculation_allowed(8)  # inherited, nothing measured
    governor.emitted(0, 4)
    seen = regimes_over(governor, clock, {SPECULATE: 12.0, PLAIN: 10.0}, streams=4, epochs=14)
    # plain (measured for two epochs, then until its turn to explore: the inherited verdict counts as
    # a lost try, so after twice explore_every), then speculation is measured for two epochs and,
    # faster here, wins
    assert seen[:9] == [PLAIN] * 9 and seen[9:] == [SPECULATE] * 5


def test_a_higher_load_starts_speculating_where_the_lower_one_found_speculation_faster():
    clock, governor = governed(2)
    regimes_over(governor, clock, {SPECULATE: 7.0, PLAIN: 5.0}, streams=2, epochs=6)
    assert governor.speculation_allowed(4)


def test_a_prompt_prefill_stops_the_epochs_clock_and_its_time_is_not_charged_to_the_regime():
    """Four requests arriving together prefill for seconds with no token decoded: an
    epoch that began with them read 3.5 tokens/s against its neighbours' 9.3 on a
    2-core machine, whatever its regime. The epoch counts decoding time only."""
    clock, governor = governed(4)
    for _ in range(4):
        governor.prefill_started()
    clock.now += 6.0  # the four prefills; the running streams (none yet) decode nothing
    for _ in range(4):
        governor.prefill_ended()
    run_epoch(governor, clock, 8.0, streams=4, seconds=9)
    assert governor.rates == {}  # 9 s counted: the prefill's 6 s were not
    run_epoch(governor, clock, 8.0, streams=4, seconds=1)
    assert abs(governor.rate(4, SPECULATE) - 8.0) < 1e-9


def test_tokens_decoded_while_another_request_prefills_are_not_counted():
    clock, governor = governed(2)
    run_epoch(governor, clock, 6.0, streams=2, seconds=4)
    governor.prefill_started()  # a request arrives while another decodes
    run_epoch(governor, clock, 1.0, streams=2, seconds=5)  # slowed down by the prefill: not counted
    governor.prefill_ended()
    run_epoch(governor, clock, 6.0, streams=2, seconds=6)
    assert abs(governor.rate(2, SPECULATE) - 6.0) < 1e-9


def test_a_step_that_began_during_a_prefill_counts_for_its_share_after_it():
    clock, governor = governed(2)
    governor.prefill_started()
    clock.now += 3.0
    governor.prefill_ended()
    clock.now += 1.0
    governor.emitted(8, 2, seconds=4.0)  # a speculative round of 4 s, 1 s of it after the prefill: 2 tokens
    clock.now += 9.0
    governor.emitted(18, 2, seconds=9.0)
    assert abs(governor.rate(2, SPECULATE) - 2.0) < 1e-9  # (2 + 18) tokens over 10 s


def test_the_regimes_are_compared_on_decoding_whatever_epochs_the_arrivals_land_in():
    """Plain decoding serves 6 tokens/s here and speculation 5, and new requests
    arrive (a 4 s prefill each, nothing decoded meanwhile) at the start of the
    epochs that happen to be plain: counted, those would make speculation win."""
    clock, governor = governed(2, explore_every=10)
    seen = []
    for _ in range(12):
        regime = SPECULATE if governor.speculation_allowed(2) else PLAIN
        seen.append(regime)
        if regime == PLAIN:
            governor.prefill_started()
            clock.now += 4.0
            governor.prefill_ended()
        run_epoch(governor, clock, {SPECULATE: 5.0, PLAIN: 6.0}[regime], streams=2)
    assert seen[:4] == [SPECULATE, SPECULATE, PLAIN, PLAIN] and seen[4:] == [PLAIN] * 8
    assert abs(governor.rate(2, PLAIN) - 6.0) < 1e-9


def test_a_plain_start_inherited_through_a_load_that_has_not_explored_yet():
    """2 streams measured plain faster; 3-4 streams started plain on that and has
    not tried speculation yet; 5-8 streams, next, starts plain too (it started
    speculating, and its first epochs re-learned the loss)."""
    clock, governor = governed(2)
    regimes_over(governor, clock, {SPECULATE: 5.0, PLAIN: 7.0}, streams=2, epochs=6)
    governor.emitted(0, 4)
    assert regimes_over(governor, clock, {SPECULATE: 8.0, PLAIN: 10.0}, streams=4, epochs=3) == [PLAIN] * 3
    assert not governor.speculation_allowed(8)


def test_the_nearest_load_that_measured_both_regimes_decides_a_new_loads_start():
    clock, governor = governed(2, explore_every=2)
    regimes_over(governor, clock, {SPECULATE: 5.0, PLAIN: 7.0}, streams=2, epochs=6)
    governor.emitted(0, 4)
    regimes_over(governor, clock, {SPECULATE: 12.0, PLAIN: 10.0}, streams=4, epochs=12)  # speculation wins at 4
    assert governor.speculation_allowed(8)


def test_a_regime_that_takes_the_lead_runs_its_full_wait_before_the_other_is_tried():
    """Plain led for eight epochs, then slowed (the workload changed) until its
    average fell under speculation's: speculation now leads, and plain decoding
    is tried again after explore_every epochs, not at once on the count plain
    had gathered while it led (a logged run switched back after one epoch)."""
    clock, governor = governed(4, explore_every=10)
    regimes_over(governor, clock, {SPECULATE: 6.0, PLAIN: 7.0}, streams=4, epochs=10)
    seen = regimes_over(governor, clock, {SPECULATE: 6.0, PLAIN: 2.0}, streams=4, epochs=14)
    first_lead = seen.index(SPECULATE)
    assert first_lead <= 4 and seen[first_lead:first_lead + 10] == [SPECULATE] * 10


def test_an_epoch_is_booked_under_the_regime_its_requests_were_told_though_the_forecast_moved_meanwhile():
    """The forecast learns from every round: one that priced plain decoding faster when
    a burst's requests asked, then speculation 30 % faster by the time the epoch ended,
    once booked that held-back epoch as speculation's, and the next one speculated."""
    from coordinator.policy.batchcost import Forecast

    prices = {PLAIN: 10.0, SPECULATE: 8.0}
    clock, governor = governed(4, forecast=lambda streams: Forecast(
        streams, plain=prices[PLAIN], speculative=prices[SPECULATE], window=4, plain_step=0.2))
    assert not governor.speculation_allowed(4)  # the burst's requests are held back
    prices[SPECULATE] = 13.0
    run_epoch(governor, clock, 10.0, 4)
    assert governor.rates.get((governor._bucket, SPECULATE)) is None
    assert governor.rates[(governor._bucket, PLAIN)].samples == 1
    assert not governor.speculation_allowed(4)  # plain stays until speculation's turn to explore
    run_epoch(governor, clock, 10.0, 4)
    assert not governor.speculation_allowed(4)


def test_a_load_with_nothing_to_price_it_speculates_and_is_priced_once_it_can_be():
    forecast = [None]
    clock, governor = governed(2, forecast=lambda streams: forecast[0])
    assert governor.speculation_allowed(2)  # blind: nothing timed yet
    from coordinator.policy.batchcost import Forecast
    forecast[0] = Forecast(2, plain=10.0, speculative=8.0, window=4, plain_step=0.2)
    assert not governor.speculation_allowed(2)  # the profile arrived: priced now, and fixed
    forecast[0] = Forecast(2, plain=10.0, speculative=13.0, window=4, plain_step=0.2)
    assert not governor.speculation_allowed(2)
