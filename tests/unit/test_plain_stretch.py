"""Fewer round trips: plain decoding in one streamed call per stretch
(coordinator/decoding/loop.py plain_stretch_rounds)."""

from coordinator.policy.costmodel import CostModel, load_bucket
from coordinator.policy.governor import PLAIN, LoadGovernor
from coordinator.policy.speculation import Mode, SpeculationPolicy
from tests.fakes import ToyEngine, noisy, toy_logits
from tests.loop_helpers import run, run_stretched, tokens_of


def test_plain_decoding_is_one_streamed_call_per_stretch():
    target = ToyEngine()
    rounds = run_stretched([1, 2, 3], 40, ToyEngine(), target, SpeculationPolicy(0, 0.3), stretch=16)
    plain, _ = run([1, 2, 3], 40, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)
    assert target.streamed == [16, 16, 8]  # three calls for 40 tokens, not 40
    assert all(len(r.tokens) == 1 for r in rounds)  # still streamed a token at a time
    assert rounds[-1].finished and not any(r.finished for r in rounds[:-1])


def test_a_stretch_that_reaches_the_end_stops_there():
    plain, _ = run([1, 2, 3], 16, ToyEngine(), ToyEngine(), window=0)
    tokens = tokens_of(plain)
    n = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])  # the end token first appears at n
    target = ToyEngine(end_id=tokens[n])
    rounds = run_stretched([1, 2, 3], 40, ToyEngine(), target, SpeculationPolicy(0, 0.3), end_ids=(tokens[n],))
    assert tokens_of(rounds) == tokens[:n]
    assert rounds[-1].finished and target.streamed == [16]


def test_the_draft_prefills_the_prompt_in_the_background_after_the_first_token():
    draft, target = ToyEngine(noisy(toy_logits, 5)), ToyEngine()
    policy = SpeculationPolicy(4, 0.3, adaptive=False)  # first round plain
    rounds = run_stretched([1, 2, 3], 30, draft, target, policy)
    plain, _ = run([1, 2, 3], 30, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)
    assert target.streamed[0] == 1  # the first token alone: time to first token is plain decoding's
    assert draft.calls[0] == (1, 0)  # then the draft's warm-up call over the prompt and that token
    assert sum(r.drafted for r in rounds) > 0  # and speculation afterwards


def test_after_a_fallback_the_plain_rounds_until_the_next_probe_are_one_call():
    def contrarian(context):
        logits = toy_logits(context)
        logits[logits.argmax()] = -1e9
        return logits

    target = ToyEngine()
    policy = SpeculationPolicy(4, 0.3, adaptive=False, first_round_plain=False)
    rounds = run_stretched([1], 40, ToyEngine(contrarian), target, policy)
    assert policy.mode is Mode.FALLBACK
    assert target.streamed[:2] == [8, 8]  # probe_interval plain rounds, each stretch one call
    plain, _ = run([1], 40, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)


def test_a_request_the_load_governor_holds_back_asks_for_calls_as_long_as_plain_decodings():
    """Plain decoding was measured faster at this load: a held-back request's calls are
    a plain request's, each shorter one would only add a round trip (a traced cold burst
    of 4 streams on the cpu profile: calls of 8-14 tokens, five or six a request against
    plain decoding's four, 0.84x its tokens/s)."""
    governor = LoadGovernor()
    governor.regimes[load_bucket(4)] = PLAIN
    policy = SpeculationPolicy(4, 0.3, costs=CostModel(streams=4), governor=governor)
    target = ToyEngine()
    rounds = run_stretched([1, 2, 3], 40, ToyEngine(), target, policy, stretch=16)
    plain, _ = run([1, 2, 3], 40, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)
    assert target.streamed == [16, 16, 8] and sum(r.drafted for r in rounds) == 0
