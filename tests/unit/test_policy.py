"""The speculation policy's rule (coordinator/policy/speculation.py docstring), step by step."""

from coordinator.policy.costmodel import CostModel
from coordinator.drafters.registry import DRAFT_MODEL, PROMPT_LOOKUP
from coordinator.policy.speculation import Mode, PolicySettings, SpeculationPolicy
from coordinator.rounds import Round


def play(policy, drafted, accepted, drafter=DRAFT_MODEL, context=0, **fields):
    """Report one round to the cost model and the policy, as the loop does."""
    round_ = Round([0] * (accepted + 1), drafted, accepted, False, drafter=drafter if drafted else "",
                   context=context, **fields)
    policy.costs.observe(round_)
    return policy.observe(round_)


def measured_costs(draft=0.1, verify=1.0, windows=range(1, 9)):
    costs = CostModel()
    costs.observe_plain(1.0)
    for k in windows:
        costs.observe_draft(k, draft * k)
        costs.observe_verify(k, verify)
    return costs


def fixed(window=4, threshold=0.3, **kwargs):
    return SpeculationPolicy(window, threshold, adaptive=False, first_round_plain=False, **kwargs)


def test_fixed_window_drafts_max_window():
    policy = fixed(5)
    assert policy.window() == 5
    policy.record(5, 5)
    assert policy.window() == 5


def test_zero_window_is_plain_decoding():
    assert SpeculationPolicy(0, 0.3).window() == 0
    assert fixed(0).window() == 0


def test_fallback_needs_evidence_then_acts_below_threshold():
    policy = fixed(4, 0.5)  # server-wide prior: 0.5 worth 4 trials
    policy.record(4, 0)  # 4 drafted < min_evidence 8: no decision yet
    assert policy.mode is Mode.SPECULATING
    policy.record(4, 0)  # per token (0 + 4 * 0.5) / (2 + 4) = 0.33 < 0.5
    assert policy.mode is Mode.FALLBACK and "per-token acceptance 0.33 below fallback_threshold 0.5" in policy.reason
    assert policy.window() == 0


def test_at_threshold_keeps_speculating():
    policy = fixed(4, 0.5)
    policy.record(4, 1)
    policy.record(4, 1)  # (2 + 2) / (4 + 4) = 0.5: one accepted per rejection
    assert policy.mode is Mode.SPECULATING


def test_one_long_window_that_is_rejected_early_does_not_stop_a_request():
    """A window of 8 at a per-token acceptance of 0.75 accepts 34 % of its tokens
    on average; a ratio over drafted tokens (1/8 here) would fall back on one round."""
    policy = fixed(8, 0.3)
    policy.record(8, 1)
    assert policy.mode is Mode.SPECULATING


def test_a_useless_draft_still_falls_back_within_a_few_rounds():
    policy = fixed(8, 0.3)
    policy.record(8, 0)
    policy.record(8, 0)  # (0 + 2) / (2 + 4) = 0.33
    assert policy.mode is Mode.SPECULATING
    policy.record(8, 0)  # 2 / 7 = 0.29
    assert policy.mode is Mode.FALLBACK


def enter_fallback(policy):
    for _ in range(8):
        policy.record(4, 0)
        if policy.mode is Mode.FALLBACK:
            return
    raise AssertionError("no fallback")


def plain_until_probe(policy, limit=200):
    for n in range(limit):
        k = policy.window()
        if k:
            return n, k
        policy.record_plain()
    raise AssertionError("no probe")


def test_fallback_probes_every_interval_and_backs_off():
    policy = fixed(4, 0.3)
    enter_fallback(policy)
    gaps = []
    for _ in range(8):
        gap, k = plain_until_probe(policy)
        assert k == 2  # probe_window
        gaps.append(gap)
        policy.record(2, 0)  # the draft is still useless
    # every 4 probes (8 tokens of evidence) fail, the interval doubles: 8,8,8,8 then 16,...
    assert gaps == [8, 8, 8, 8, 16, 16, 16, 16]
    assert policy.mode is Mode.FALLBACK


def test_fallback_interval_is_capped():
    policy = fixed(4, 0.3, settings=PolicySettings(max_probe_interval=16))
    enter_fallback(policy)
    gaps = []
    for _ in range(16):
        gap, _ = plain_until_probe(policy)
        gaps.append(gap)
        policy.record(2, 0)
    assert max(gaps) == 16


def test_speculation_resumes_when_probes_clear_threshold_plus_hysteresis():
    policy = fixed(4, 0.3)
    enter_fallback(policy)
    for probe in range(4):  # 8 probe tokens, 2 accepted, 4 rejections: 0.33 per token < 0.3 + 0.1
        plain_until_probe(policy)
        policy.record(2, 1 if probe < 2 else 0)
    assert policy.mode is Mode.FALLBACK
    for _ in range(4):  # 8 probe tokens, 8 accepted
        plain_until_probe(policy)
        policy.record(2, 2)
    assert policy.mode is Mode.SPECULATING and policy.window() == 4
    # the rounds that caused the fallback no longer count against it: only the probes' 8 of 8
    assert policy.recent_acceptance() == (8 + 4 * 0.5) / (8 + 4)


def test_draft_failure_is_final_for_the_request():
    policy = fixed(4, 0.3)
    policy.draft_failed(RuntimeError("unloaded"))
    assert policy.mode is Mode.DRAFT_FAILED and "unloaded" in policy.reason
    for _ in range(300):
        assert policy.window() == 0
        policy.record_plain()


def test_adaptive_window_follows_acceptance():
    costs = measured_costs(draft=0.1)
    policy = SpeculationPolicy(8, 0.0, costs=costs, settings=PolicySettings(prior_trials=1.0))
    for _ in range(10):
        policy.record(8, 8)
    high = policy.window()
    assert high == 8
    for _ in range(10):
        policy.record(4, 1)  # a ~ 0.5
    low = policy.window()
    assert 0 < low < high


def test_adaptive_goes_plain_when_nothing_pays_and_resumes_after_a_good_probe():
    costs = measured_costs(draft=0.3)
    policy = SpeculationPolicy(6, 0.0, costs=costs)
    for _ in range(6):
        policy.record(2, 0)
    assert policy.window() == 0 and policy.mode is Mode.UNPROFITABLE
    assert "predicted to beat plain" in policy.reason
    # the numbers that priced it, so a wrong cost or acceptance shows in fallback_reason
    alpha, best = policy.acceptance_estimate(), costs.likeliest_window(policy.acceptance_estimate(), 6)
    assert (f"per-token acceptance {alpha:.2f}; the best, {best}, "
            f"{costs.predictions(alpha, 6)[best - 1]:.2f}x: a drafted token costs {costs.draft_cost(best):.2f} "
            f"plain steps, verifying {costs.verify_cost(best):.2f})") in policy.reason
    gap, k = plain_until_probe(policy)
    # the probe measures the window the cost model rates best, even below plain decoding
    assert gap == 8 and k == costs.likeliest_window(policy.acceptance_estimate(), 6) >= 1
    policy.record(k, 0)
    assert plain_until_probe(policy) == (8, k)  # still unprofitable: probed again as often, no back-off
    for _ in range(10):
        policy.record(2, 2)  # the draft became accurate
    assert policy.mode is Mode.SPECULATING and policy.window() > 0


def test_a_fresh_servers_first_rejected_token_does_not_stop_its_request():
    """One drafted token rejected is the whole of a fresh server's evidence: it took the
    server's estimate to 0, and the request stopped and probed one token at a time for
    the rest of its tokens. It drafts on until it has ``min_evidence`` tokens of its own."""
    policy = SpeculationPolicy(6, 0.0, costs=measured_costs(draft=0.3), first_round_plain=False)
    assert policy.window() == 1  # the prior (0.5) pays for one token here
    play(policy, 1, 0)
    assert policy.costs.server_acceptance(0.5) == 0.0
    drafted = 1
    while drafted < policy.settings.min_evidence:
        k = policy.window()
        assert k >= 1 and policy.mode is Mode.SPECULATING
        play(policy, k, 0)
        drafted += k
    assert policy.window() == 0 and policy.mode is Mode.UNPROFITABLE  # its own evidence now says so


def test_a_request_stops_on_one_rejection_where_the_server_has_measured_the_draft():
    costs = measured_costs(draft=0.3)
    for _ in range(8):
        costs.observe_acceptance(0, rejected=True)
    policy = SpeculationPolicy(6, 0.0, costs=costs, first_round_plain=False)
    assert policy.window() == 0 and policy.mode is Mode.UNPROFITABLE


def test_costs_measured_at_long_contexts_do_not_change_a_short_requests_decision():
    """The same request decides the same whatever ran before it: timings are
    kept per context bucket, and a bucket with nothing measured starts from
    the priors, not from another bucket's numbers."""
    def first_windows(costs):
        policy = SpeculationPolicy(5, 0.3, costs=costs, first_round_plain=False)
        windows = []
        for _ in range(6):
            k = policy.window(context=150)
            windows.append(k)
            play(policy, k, k)
        return windows

    fresh = first_windows(CostModel())
    after_long = CostModel()
    for _ in range(50):  # long prompts where verifying was expensive and the draft slow
        after_long.observe_plain(0.2, context=2000)
        after_long.observe_draft(4, 0.4, context=2000)
        after_long.observe_verify(4, 0.5, context=2000)
    assert after_long.best_window(0.9, 5, context=2000)[0] == 0
    assert first_windows(after_long) == fresh and fresh[-1] == 5


def test_costs_are_kept_per_load():
    costs = CostModel()
    costs.observe_plain(0.2, streams=1)
    costs.observe_verify(4, 0.22, streams=1)
    costs.observe_plain(0.3, streams=8)
    costs.observe_verify(4, 0.9, streams=8)  # eight streams' verifications fill the forwards
    assert abs(costs.verify_cost(4, streams=1) - 1.1) < 1e-9 and abs(costs.verify_cost(4, streams=8) - 3.0) < 1e-9
    costs.streams = 7  # the load now: the 5-8 bucket
    assert abs(costs.verify_cost(4) - 3.0) < 1e-9


def test_new_requests_start_from_the_server_wide_acceptance():
    costs = measured_costs(draft=0.1)
    for _ in range(100):
        costs.observe_acceptance(0, rejected=True)  # the server has seen nothing accepted
    assert SpeculationPolicy(6, 0.0, costs=costs, first_round_plain=False).window() == 0
    costs = measured_costs(draft=0.1)
    for _ in range(100):
        costs.observe_acceptance(6, rejected=False)
    assert SpeculationPolicy(6, 0.0, costs=costs, first_round_plain=False).window() == 6


def test_round_reports_feed_the_shared_cost_model_and_the_policy_writes_none_of_it():
    costs = CostModel()
    policy = SpeculationPolicy(4, 0.0, costs=costs)
    policy.observe(Round([1], 0, 0, False, target_sample=0.2))
    policy.observe(Round([1, 2, 3, 4], 4, 3, False, drafter=DRAFT_MODEL, draft_sample=0.08, target_sample=0.22))
    assert costs.cells == {} and costs.trials == {}  # the policy only reads the cost model
    play(policy, 0, 0, target_sample=0.2)
    reported = play(policy, 4, 3, draft_sample=0.08, target_sample=0.22)
    assert abs(costs.draft_cost(4) - 0.1) < 1e-9
    assert abs(costs.verify_cost(4) - 1.1) < 1e-9
    assert costs.server_acceptance(0.5) == 0.75
    assert reported.mode == Mode.SPECULATING and reported.held_back is None


def test_a_free_drafter_keeps_drafting_while_the_draft_model_has_fallen_back():
    """Prompt lookup runs no model: a miss costs its verification rows only, so
    the fallback threshold (about what a draft model costs) does not stop it."""
    policy = fixed(4, threshold=0.5)
    for _ in range(4):
        play(policy, 4, 0, drafter=PROMPT_LOOKUP)
    assert policy.mode is Mode.SPECULATING and policy.window(drafter=PROMPT_LOOKUP) == 4
    for _ in range(2):
        play(policy, 4, 0)
    assert policy.mode is Mode.FALLBACK
    assert policy.window() == 0 and policy.window(drafter=PROMPT_LOOKUP) == 4
    assert policy.plan(100, (PROMPT_LOOKUP, DRAFT_MODEL)) == (PROMPT_LOOKUP, 4)
    assert policy.plan(100, (DRAFT_MODEL,)) == (DRAFT_MODEL, 0)
    policy.draft_failed(RuntimeError("draft engine gone"))
    assert policy.plan(100, (PROMPT_LOOKUP, DRAFT_MODEL)) == (PROMPT_LOOKUP, 4)
    assert policy.plain_rounds_planned(free_drafter=True) == 1 and policy.plain_rounds_planned() > 10**6


def test_a_free_drafter_alone_gets_plain_calls_as_long_as_the_plain_streak_so_far():
    """Every call is a round trip (and on a busy engine the rest of the forward
    under way): where only a free drafter is left and the text has not let it
    draft for n tokens, the next call asks for n, and a round that drafts
    starts over. The streak counts tokens, not time: the same text, the same calls."""
    policy = fixed(4)
    policy.draft_failed(RuntimeError("draft engine gone"))
    planned = []
    for _ in range(7):
        planned.append(policy.plain_rounds_planned(free_drafter=True))
        policy.record_plain(planned[-1])
    assert planned == [1, 1, 2, 4, 8, 16, 32]
    play(policy, 4, 1, drafter=PROMPT_LOOKUP)
    assert policy.plain_rounds_planned(free_drafter=True) == 1
    play(policy, 0, 0)  # a round with nothing proposed is plain
    assert policy.plain_rounds_planned(free_drafter=True) == 1
    policy.record_plain(3)
    assert policy.plain_rounds_planned(free_drafter=True) == 4


def test_a_free_drafters_streak_does_not_delay_the_draft_models_next_round():
    speculating = fixed(4)
    speculating.record_plain(5)
    assert speculating.plain_rounds_planned(free_drafter=True) == 1
    fallen_back = fixed(4, threshold=0.5, settings=PolicySettings(probe_interval=6))
    for _ in range(2):
        play(fallen_back, 4, 0)
    assert fallen_back.mode is Mode.FALLBACK
    fallen_back.record_plain(4)
    assert fallen_back.plain_rounds_planned(free_drafter=True) == 2  # the probe is due after 2 more


def test_plan_takes_the_drafter_predicted_to_serve_more_tokens_per_second():
    costs = measured_costs(draft=0.2)
    for _ in range(50):
        costs.observe_acceptance(4, rejected=True, drafter=DRAFT_MODEL)  # a = 4/5 at 0.2 steps a token
    policy = SpeculationPolicy(8, 0.3, costs=costs, first_round_plain=False)
    for _ in range(3):
        play(policy, 4, 2, drafter=PROMPT_LOOKUP)  # a = 2/3, drafting for free
    lookup_k, lookup_speedup = costs.best_window(policy.acceptance_estimate(PROMPT_LOOKUP), 8, drafter=PROMPT_LOOKUP)
    model_k, model_speedup = costs.best_window(policy.acceptance_estimate(DRAFT_MODEL), 8)
    assert lookup_speedup > model_speedup
    assert policy.plan(0, (PROMPT_LOOKUP, DRAFT_MODEL)) == (PROMPT_LOOKUP, lookup_k)
    for _ in range(8):
        play(policy, 4, 0, drafter=PROMPT_LOOKUP)  # the text stopped repeating itself
    model_k = costs.best_window(policy.acceptance_estimate(DRAFT_MODEL), 8)[0]
    assert policy.plan(0, (PROMPT_LOOKUP, DRAFT_MODEL)) == (DRAFT_MODEL, model_k)


def test_a_request_tries_prompt_lookup_itself_before_a_poor_server_prior_rules_it_out():
    """Whether prompt lookup pays depends on the text: a copy-heavy request after
    a run of requests where it did badly still finds out for itself."""
    costs = measured_costs(draft=0.2)
    for _ in range(50):
        costs.observe_acceptance(4, rejected=True, drafter=DRAFT_MODEL)
        costs.observe_acceptance(0, rejected=True, drafter=PROMPT_LOOKUP)
    policy = SpeculationPolicy(8, 0.3, costs=costs, first_round_plain=False)
    chosen, k = policy.plan(0, (PROMPT_LOOKUP, DRAFT_MODEL))
    assert chosen == PROMPT_LOOKUP and k >= 1
    while chosen == PROMPT_LOOKUP:
        play(policy, k, k, drafter=PROMPT_LOOKUP)  # everything accepted: the text is copying
        chosen, k = policy.plan(0, (PROMPT_LOOKUP, DRAFT_MODEL))
        if policy._drafted(PROMPT_LOOKUP) >= 24:
            break
    assert chosen == PROMPT_LOOKUP and k == 8  # its own evidence now rules: long windows


def test_where_the_draft_model_is_preferred_prompt_lookup_earns_its_rounds_on_scored_evidence():
    """A warm draft model is preferred (candidates' order): prompt lookup is not
    tried on a round of its own on a poor server prior, but each round the draft
    model drafts scores lookup's proposal against the target's tokens, and once
    that evidence says the text copies, lookup drafts."""
    costs = measured_costs(draft=0.2)
    for _ in range(50):
        costs.observe_acceptance(4, rejected=True, drafter=DRAFT_MODEL)
        costs.observe_acceptance(0, rejected=True, drafter=PROMPT_LOOKUP)
    policy = SpeculationPolicy(8, 0.3, costs=costs, first_round_plain=False)
    assert policy.plan(0, (DRAFT_MODEL, PROMPT_LOOKUP))[0] == DRAFT_MODEL
    for _ in range(3):  # the draft model's rounds; lookup would have had every emitted token right
        play(policy, 4, 4, alternatives=((PROMPT_LOOKUP, 5, False),))
    assert policy.plan(0, (DRAFT_MODEL, PROMPT_LOOKUP)) == (PROMPT_LOOKUP, 8)
    assert policy._rounds == 3  # evidence, not rounds


def test_a_free_drafter_predicted_not_to_pay_probes_every_probe_interval_offers():
    costs = measured_costs(draft=0.2, verify=1.5)
    for _ in range(50):
        costs.observe_acceptance(0, rejected=True, drafter=PROMPT_LOOKUP)
    policy = SpeculationPolicy(8, 0.3, costs=costs, first_round_plain=False,
                               settings=PolicySettings(probe_interval=4))
    assert policy.window(drafter=PROMPT_LOOKUP) >= 1  # not measured on this request yet: tried
    play(policy, 8, 0, drafter=PROMPT_LOOKUP)
    offers = [policy.window(drafter=PROMPT_LOOKUP) for _ in range(7)]
    assert offers[:2] == [0, 0] and offers[2] >= 1 and offers[3:6] == [0, 0, 0] and offers[6] >= 1
    assert policy.mode is Mode.SPECULATING  # the draft model's state is its own


def test_first_round_is_plain_so_the_first_token_costs_what_plain_decoding_costs():
    policy = SpeculationPolicy(4, 0.3, adaptive=False)
    assert policy.window() == 0
    policy.record_plain()
    assert policy.window() == 4


def test_a_draft_model_priced_away_plans_plain_decoding_to_the_end_unless_a_free_drafter_is_left():
    policy = SpeculationPolicy(4, 0.3)
    assert policy.mode is Mode.SPECULATING and policy.plain_rounds_planned() == 1
    assert policy.plain_rounds_planned(draft_model=False) > 10**6
    assert policy.plain_rounds_planned(free_drafter=True, draft_model=False) == 1
