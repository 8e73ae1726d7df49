"""The draft-verify loop (coordinator/decoding/loop.py), a speculative round at a
time: greedy output equal to plain decoding, seeded sampling verified by
rejection sampling, fallback, a failing draft, the adaptive window."""

import pytest

from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.engines.contract import EngineError, EngineOutput
from coordinator.policy.costmodel import CostModel
from coordinator.policy.speculation import Mode, SpeculationPolicy
from coordinator.sampling.params import SamplingParams
from tests.fakes import ToyEngine, noisy, toy_logits
from tests.loop_helpers import FakeClock, TimedEngine, run, tokens_of


@pytest.mark.parametrize("window", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("flip_every", [0, 2, 3, 7])
def test_greedy_output_equals_plain_decoding_for_every_window(window, flip_every):
    plain, _ = run([1, 2, 3], 40, ToyEngine(), ToyEngine(), window=0)
    spec, _ = run([1, 2, 3], 40, ToyEngine(noisy(toy_logits, flip_every)), ToyEngine(), window=window)
    assert tokens_of(spec) == tokens_of(plain)
    assert len(tokens_of(spec)) == 40


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8)])
def test_seeded_sampling_is_repeatable_and_verified_by_rejection(temperature, top_k, top_p):
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    target = ToyEngine()
    first, _ = run([5], 30, ToyEngine(noisy(toy_logits, 3)), target, window=4, sampling=sampling)
    again, _ = run([5], 30, ToyEngine(noisy(toy_logits, 3)), ToyEngine(), window=4, sampling=sampling)
    assert tokens_of(first) == tokens_of(again) and len(tokens_of(first)) == 30
    # the draft's distribution went to the target (rejection sampling), one row per draft token
    assert target.received_draft_logits and all(
        logits.shape[0] == k for logits, (_, k) in zip(target.received_draft_logits, [c for c in target.calls if c[1]])
    )
    other, _ = run([5], 30, ToyEngine(), ToyEngine(), window=4, sampling=SamplingParams(temperature, top_k, top_p, 99))
    assert tokens_of(other) != tokens_of(first)


def test_greedy_requests_send_no_draft_logits():
    target = ToyEngine()
    run([5], 20, ToyEngine(), target, window=4)
    assert target.received_draft_logits == []


def test_a_sampled_request_can_be_verified_by_token_matching_instead():
    """use_draft_logits false (NVIDIA's BLS input): no draft distribution is
    sent; the target keeps its own samples, so the output is still the target's."""
    sampling = SamplingParams(temperature=0.8, seed=77)
    target = ToyEngine()
    rounds, _ = run([5], 30, ToyEngine(noisy(toy_logits, 3)), target, window=4, sampling=sampling,
                    draft_distribution=False)
    again, _ = run([5], 30, ToyEngine(noisy(toy_logits, 3)), ToyEngine(), window=4, sampling=sampling,
                   draft_distribution=False)
    assert target.received_draft_logits == [] and sum(r.drafted for r in rounds) > 0
    assert tokens_of(rounds) == tokens_of(again) and len(tokens_of(rounds)) == 30


@pytest.mark.parametrize("sampling", [SamplingParams(log_probs=True),
                                      SamplingParams(temperature=0.8, top_k=5, seed=3, log_probs=True)])
def test_log_probs_are_the_targets_whether_a_token_was_drafted_or_not(sampling):
    """Each emitted token's log probability is log softmax of the target's
    row at its context (temperature applied, before top-k), as TensorRT-LLM's
    output_log_probs; greedy speculation reports exactly plain decoding's."""
    from coordinator.sampling.maths import token_log_prob

    prompt = [5, 1]
    rounds, _ = run(prompt, 20, ToyEngine(noisy(toy_logits, 3)), ToyEngine(), window=3, sampling=sampling)
    tokens = tokens_of(rounds)
    reported = [p for r in rounds for p in r.log_probs]
    assert len(reported) == len(tokens) == 20 and any(r.drafted for r in rounds)
    for i, token in enumerate(tokens):
        expected = token_log_prob(toy_logits(prompt + tokens[:i]), sampling, token)
        assert reported[i] == pytest.approx(expected, abs=1e-12)
    if sampling.greedy:
        plain, _ = run(prompt, 20, ToyEngine(), ToyEngine(), window=0, sampling=sampling)
        assert [p for r in plain for p in r.log_probs] == reported


def test_a_perfect_draft_is_always_accepted_when_sampling():
    sampling = SamplingParams(temperature=1.0, seed=5)
    rounds, _ = run([3], 24, ToyEngine(), ToyEngine(), window=3, sampling=sampling)
    assert sum(r.accepted for r in rounds) == sum(r.drafted for r in rounds) > 0


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
    assert policy.mode is Mode.FALLBACK and "below fallback_threshold" in policy.reason
    # stopped after the evidence window (8 tokens); then only probes of 2 after every 8 plain rounds
    assert [r.drafted for r in rounds[:2]] == [4, 4]
    probes = [r.drafted for r in rounds[2:] if r.drafted]
    assert probes == [2, 2, 2, 2]
    plain, _ = run([1], 40, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)


def test_failing_draft_degrades_to_target_only_and_still_completes():
    draft = ToyEngine()
    draft.fail_with = RuntimeError("draft unloaded")
    rounds, policy = run([1], 10, draft, ToyEngine(), window=4)
    assert len(tokens_of(rounds)) == 10
    assert policy.mode is Mode.DRAFT_FAILED and "draft model failed" in policy.reason
    assert sum(r.drafted for r in rounds) == 0


def test_target_answering_outside_its_contract_is_an_error():
    class Broken(ToyEngine):
        async def generate(self, input_ids, max_new_tokens, *args, **kwargs):
            return EngineOutput([7] * (max_new_tokens + 1))

    with pytest.raises(EngineError):
        run([1], 5, ToyEngine(), Broken(), window=2)


def test_adaptive_policy_stops_drafting_when_the_draft_costs_too_much():
    clock = FakeClock()
    # a draft token costs as much as a target step: no window can pay
    draft = TimedEngine(clock, 0.0, 1.0, noisy(toy_logits, 2))
    target = TimedEngine(clock, 1.0, 0.0)
    policy = SpeculationPolicy(4, 0.0, costs=CostModel(), first_round_plain=False)
    rounds, _ = run([1], 60, draft, target, policy=policy, clock=clock)
    assert policy.mode is Mode.UNPROFITABLE
    assert sum(r.drafted for r in rounds[10:]) <= 2 * 3  # probes only


def test_adaptive_policy_drafts_long_windows_for_a_cheap_accurate_draft():
    clock = FakeClock()
    draft = TimedEngine(clock, 0.0, 0.05)
    target = TimedEngine(clock, 1.0, 0.01)
    policy = SpeculationPolicy(6, 0.3, costs=CostModel(), first_round_plain=False)
    rounds, _ = run([1], 60, draft, target, policy=policy, clock=clock)
    assert policy.mode is Mode.SPECULATING
    assert max(r.drafted for r in rounds) == 6 and rounds[-2].drafted == 6


def test_prefill_and_draft_catch_up_calls_are_not_cost_samples():
    clock = FakeClock()
    draft = TimedEngine(clock, 0.0, 0.1)
    target = TimedEngine(clock, 1.0, 0.0)
    costs = CostModel()
    policy = SpeculationPolicy(3, 0.0, costs=costs, adaptive=False, first_round_plain=False)
    run(list(range(1, 200)), 13, draft, target, policy=policy, clock=clock)
    # 13 tokens in rounds of 4: 3 verify rounds + 1 plain (last token). The target's
    # first call (the prompt's prefill) is not sampled; the draft prefills the prompt
    # in an untimed catch-up call of its own, so all three of its rounds are samples.
    timings = costs.cell(context=200)
    assert timings.verify[3].samples == 2 and timings.draft[DRAFT_MODEL][3].samples == 3
    assert timings.plain_step.samples == 1
    assert draft.calls[0] == (1, 0)  # the catch-up


def test_every_plain_round_says_why_it_did_not_speculate():
    def contrarian(context):
        logits = toy_logits(context)
        logits[logits.argmax()] = -1e9
        return logits

    fell_back, _ = run([1], 40, ToyEngine(contrarian), ToyEngine(), window=4, threshold=0.3)
    assert all(r.plain_reason == "" for r in fell_back if r.drafted)
    assert {r.plain_reason for r in fell_back[:-1] if not r.drafted} == {"low_acceptance"}
    assert fell_back[-1].plain_reason == "last_token"  # one token left: nothing to draft before it
    off, _ = run([1], 10, ToyEngine(), ToyEngine(), window=0)
    assert off and {r.plain_reason for r in off} == {"not_requested"}
    draft = ToyEngine()
    draft.fail_with = RuntimeError("draft unloaded")
    failed, _ = run([1], 10, draft, ToyEngine(), window=4)
    assert {r.plain_reason for r in failed[:-1]} == {"draft_failed"}
    first = SpeculationPolicy(max_window=4, fallback_threshold=0.0, adaptive=False)
    started, _ = run([1], 10, ToyEngine(), ToyEngine(), policy=first)
    assert started[0].plain_reason == "first_round" and started[1].drafted
