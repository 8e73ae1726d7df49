import asyncio

import pytest

from coordinator.loop import EngineError, common_prefix_length, speculative_decode
from coordinator.policy import SpeculationPolicy
from coordinator.sampling import SamplingParams
from tests.fakes import ToyEngine, noisy, toy_logits

GREEDY = SamplingParams()


def run(prompt, max_new, draft, target, window=4, threshold=0.0, sampling=GREEDY, end_ids=(999,)):
    policy = SpeculationPolicy(window, threshold)

    async def collect():
        return [r async for r in speculative_decode(
            prompt, max_new, draft=draft, target=target, policy=policy, sampling=sampling, end_ids=end_ids)]

    return asyncio.run(collect()), policy


def tokens_of(rounds):
    return [t for r in rounds for t in r.tokens]


@pytest.mark.parametrize("window", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("flip_every", [0, 2, 3, 7])
def test_greedy_output_equals_plain_decoding_for_every_window(window, flip_every):
    plain, _ = run([1, 2, 3], 40, ToyEngine(), ToyEngine(), window=0)
    spec, _ = run([1, 2, 3], 40, ToyEngine(noisy(toy_logits, flip_every)), ToyEngine(), window=window)
    assert tokens_of(spec) == tokens_of(plain)
    assert len(tokens_of(spec)) == 40


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8)])
def test_seeded_sampling_is_identical_with_and_without_speculation(temperature, top_k, top_p):
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    plain, _ = run([5], 30, ToyEngine(), ToyEngine(), window=0, sampling=sampling)
    spec, _ = run([5], 30, ToyEngine(noisy(toy_logits, 3)), ToyEngine(), window=4, sampling=sampling)
    assert tokens_of(spec) == tokens_of(plain)
    other, _ = run([5], 30, ToyEngine(), ToyEngine(), window=0, sampling=SamplingParams(temperature, top_k, top_p, 99))
    assert tokens_of(other) != tokens_of(plain)


def test_statistics_are_consistent_and_a_perfect_draft_is_fully_accepted():
    rounds, _ = run([1], 31, ToyEngine(), ToyEngine(), window=5)
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    assert accepted == drafted > 0
    # 31 tokens in rounds of 6 (5 accepted + 1): k never exceeds what is still allowed - 1
    assert [len(r.tokens) for r in rounds] == [6, 6, 6, 6, 6, 1]
    assert [r.drafted for r in rounds] == [5, 5, 5, 5, 5, 0]


def test_window_is_capped_by_remaining_budget():
    target = ToyEngine()
    run([1], 3, ToyEngine(), target, window=8)
    assert target.calls[0] == (3, 2)


def test_stops_at_end_token_without_emitting_it():
    end = int(toy_logits([1, 2]).argmax())  # the first greedy token after [1, 2]
    rounds, _ = run([1, 2], 20, ToyEngine(end_id=end), ToyEngine(end_id=end), window=4, end_ids=(end,))
    assert tokens_of(rounds) == [] and rounds[-1].finished


def test_useless_draft_triggers_fallback_to_plain_decoding():
    def contrarian(context):  # always proposes a token the target never picks
        logits = toy_logits(context)
        logits[logits.argmax()] = -1e9
        return logits

    draft, target = ToyEngine(contrarian), ToyEngine()
    rounds, policy = run([1], 40, draft, target, window=4, threshold=0.3)
    assert policy.fallen_back and "below fallback_threshold" in policy.reason
    assert sum(r.drafted for r in rounds) <= 12  # stopped drafting after the evidence window
    assert rounds[-1].drafted == 0
    plain, _ = run([1], 40, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)


def test_failing_draft_degrades_to_target_only_and_still_completes():
    draft = ToyEngine()
    draft.fail_with = RuntimeError("draft unloaded")
    rounds, policy = run([1], 10, draft, ToyEngine(), window=4)
    assert len(tokens_of(rounds)) == 10
    assert policy.fallen_back and "draft model failed" in policy.reason
    assert sum(r.drafted for r in rounds) == 0


def test_target_answering_outside_its_contract_is_an_error():
    class Broken(ToyEngine):
        async def generate(self, *args, **kwargs):
            return []

    with pytest.raises(EngineError):
        run([1], 5, ToyEngine(), Broken(), window=2)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
