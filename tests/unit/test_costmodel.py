import math

import pytest

from coordinator.policy.costmodel import (PREFILL_MIN_SAMPLES, PRIOR_DRAFT_COST, PRIOR_VERIFY_COST, CostModel, MovingAverage, acceptance_from_rounds, predicted_speedup)
from coordinator.policy.expectation import expected_tokens_per_round


def test_expected_tokens_per_round_matches_the_geometric_series():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(0.5, 0) == 1.0
    assert math.isclose(expected_tokens_per_round(0.8, 3), 1 + 0.8 + 0.64 + 0.512)


def test_predicted_speedup_formula():
    # a = 0.8, K = 4, c = 0.1, v = 1.1: E = 3.3616, cost 1.5
    assert math.isclose(predicted_speedup(0.8, 4, 0.1, 1.1), 3.3616 / 1.5)
    assert predicted_speedup(0.8, 0, 0.1, 1.1) == 1.0


def test_acceptance_counts_only_tried_tokens():
    # rounds of 5: [2 accepted then a rejection], [5 accepted] -> 7 successes, 1 failure
    assert acceptance_from_rounds(7, 1) == 7 / 8
    assert acceptance_from_rounds(0, 0) is None


def test_moving_average_starts_with_the_mean_then_weights_recent_samples():
    average = MovingAverage()
    for sample in (1.0, 3.0):
        average.add(sample)
    assert average.value == 2.0
    for _ in range(200):
        average.add(10.0)
    assert math.isclose(average.value, 10.0, rel_tol=1e-6)


def test_priors_until_measured():
    costs = CostModel()
    assert costs.draft_cost(3) == PRIOR_DRAFT_COST and costs.verify_cost(3) == PRIOR_VERIFY_COST
    assert costs.server_acceptance(0.42) == 0.42


def test_costs_are_relative_to_the_plain_step_and_borrow_the_nearest_window():
    costs = CostModel()
    costs.observe_plain(0.2)
    costs.observe_draft(4, 0.16)  # 0.04 s per drafted token
    costs.observe_verify(4, 0.24)
    assert math.isclose(costs.draft_cost(4), 0.2)
    assert math.isclose(costs.draft_cost(1), 0.2)  # per token of the nearest measured K
    assert math.isclose(costs.verify_cost(4), 1.2) and math.isclose(costs.verify_cost(8), 1.2)
    costs.observe_verify(1, 0.2)
    assert math.isclose(costs.verify_cost(1), 1.0) and math.isclose(costs.verify_cost(2), 1.0)


def test_without_plain_steps_the_cheapest_verify_stands_in_for_one():
    costs = CostModel()
    costs.observe_verify(2, 0.3)
    costs.observe_verify(5, 0.45)
    assert math.isclose(costs.verify_cost(5), 1.5)


@pytest.mark.parametrize(
    "alpha,draft,verify,expected",
    [
        (0.9, 0.05, 1.0, 8),  # cheap, accurate draft: the longest window
        (0.0, 0.05, 1.0, 0),  # never accepted: plain decoding
        (0.8, 1.0, 1.0, 0),  # draft as dear as the target: never pays
        (0.6, 0.2, 1.0, 2),  # moderate: a short window
    ],
)
def test_best_window(alpha, draft, verify, expected):
    costs = CostModel()
    costs.observe_plain(1.0)
    for k in range(1, 9):
        costs.observe_draft(k, draft * k)
        costs.observe_verify(k, verify)
    k, speedup = costs.best_window(alpha, 8)
    assert k == expected
    if k:
        assert speedup == max(predicted_speedup(alpha, n, draft, verify) for n in range(1, 9)) > 1
    else:
        assert speedup == 1.0


def test_server_acceptance_from_rounds():
    costs = CostModel()
    for _ in range(50):
        costs.observe_acceptance(3, rejected=True)  # 3 successes, 1 failure
    assert math.isclose(costs.server_acceptance(0.0), 0.75)


def test_the_catch_up_price_at_a_load_with_none_measured_is_the_nearest_lower_loads():
    """More streams share the cores, so a lower load's price is a floor; a lower
    load never borrows a higher one's."""
    costs = CostModel()
    for _ in range(PREFILL_MIN_SAMPLES):
        costs.observe_draft_prefill(100, 2.0, context=100, streams=2)
    assert costs.draft_prefill_seconds(100, streams=8) == costs.draft_prefill_seconds(100, streams=2)
    assert math.isclose(costs.draft_prefill_seconds(100, streams=2), 0.02)
    assert costs.draft_prefill_seconds(100, streams=1) is None
    for _ in range(PREFILL_MIN_SAMPLES):
        costs.observe_draft_prefill(100, 5.0, context=100, streams=8)
    assert math.isclose(costs.draft_prefill_seconds(100, streams=8), 0.05)  # its own, once measured
