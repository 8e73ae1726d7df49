"""Random state: every engine call of a request has a seed of its own."""

import pytest

from coordinator.decoding.loop import common_prefix_length
from coordinator.sampling.params import SamplingParams, call_seed
from tests.fakes import ToyEngine, noisy, toy_logits
from tests.loop_helpers import run, tokens_of


def test_every_engine_call_of_a_request_gets_its_own_seed_and_the_same_request_seed_repeats():
    sampling = SamplingParams(temperature=1.0, seed=77)
    draft, target = ToyEngine(noisy(toy_logits, 3)), ToyEngine()
    first, _ = run([5], 30, draft, target, window=3, sampling=sampling)
    seeds = draft.seeds + target.seeds
    assert len(seeds) == len(set(seeds)) and len(target.seeds) == len(first)
    again_draft, again_target = ToyEngine(noisy(toy_logits, 3)), ToyEngine()
    again, _ = run([5], 30, again_draft, again_target, window=3, sampling=sampling)
    assert tokens_of(again) == tokens_of(first) and again_target.seeds == target.seeds


def test_call_seeds_differ_by_role_position_and_request_seed():
    seeds = {call_seed(s, p, r) for s in (0, 1, 2**63 + 5) for p in range(50) for r in ("draft", "target")}
    assert len(seeds) == 3 * 50 * 2 and all(0 <= s < 2**64 for s in seeds)
    with pytest.raises(ValueError, match="role"):
        call_seed(1, 2, "drafter")


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
