"""The sim profile's engine (sim_engine/): its synthetic LM, its compact greedy
path against calls.py on full rows, its forward times and batching, and the
presets. Its TensorRT-LLM semantics are tested with the CPU engine's tests
(tests/unit/test_trtllm_semantics.py, the ``sim`` cases)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from coordinator.sampling.params import SamplingParams
from sim_engine.engine import SimEngine, EngineRequest
from sim_engine.lm import SyntheticLM
from sim_engine.presets import PRESETS, StepTime, UnknownPreset, expected_tokens, ideal, preset
from trtllm_emulation import calls

VOCAB = 151_936


def test_h100_8b_1b_is_the_documented_preset():
    p = preset("h100-8b-1b")
    assert (p.target.base_ms, p.target.per_row_ms, p.draft.base_ms, p.draft.per_row_ms) == (7.0, 0.03, 1.5, 0.01)
    assert (p.agreement, p.second_choice) == (0.8, 0.5)
    assert p.target.seconds(1) == pytest.approx(0.007) and p.target.seconds(9) == pytest.approx(0.00724)
    assert all(p.source for p in PRESETS.values())
    speedup, window = ideal(p)
    assert window == 4 and speedup == pytest.approx(expected_tokens(0.8, 4) / (4 * 1.5 + 7.12) * 7.0)


def test_an_unknown_preset_names_the_valid_ones():
    with pytest.raises(UnknownPreset, match="h100-8b-1b"):
        preset("h100")


def test_the_drafts_agreement_and_second_choice_rates():
    target, draft = SyntheticLM(VOCAB, "target"), SyntheticLM(VOCAB, "draft", 0.8, 0.5)
    rng = random.Random(0)
    top = second = n = 0
    for _ in range(20000):
        context = [rng.randrange(150000) for _ in range(rng.randrange(1, 6))]
        want = target.greedy(context)
        tokens, _ = draft.row(context)
        n += 1
        top += tokens[0] == want
        second += tokens[0] != want and tokens[1] == want
    assert abs(top / n - 0.8) < 0.015
    assert abs(second / (n - top) - 0.5) < 0.03


def _full(engine, request):
    """calls.py on the full rows of the real vocabulary (what the compact path must equal)."""
    lm, context = engine.lm, list(request.input_ids)
    if request.draft_tokens is not None:
        drafts = list(request.draft_tokens)
        rows = np.stack([lm.full_row(context + drafts[:i]) for i in range(len(drafts) + 1)])
        return calls.verify(rows, drafts, None, request.max_new_tokens, request.sampling, request.end_id).tokens
    fed = []

    def step(token):
        fed.append(token)
        return lm.full_row(context + fed[1:])

    return calls.generate(step, context[-1], request.max_new_tokens, request.sampling, request.end_id).tokens


def test_greedy_calls_on_compact_rows_equal_calls_py_on_full_rows():
    engine = SimEngine(SyntheticLM(VOCAB, "target"), StepTime(0, 0), sleep=False)
    drafter = SyntheticLM(VOCAB, "draft")
    rng = random.Random(1)
    for i in range(40):
        prompt = [rng.randrange(150000) for _ in range(rng.randrange(1, 20))]
        plain = engine.run(EngineRequest(np.array(prompt), 6)).tokens
        drafts = []
        for _ in range(rng.randrange(1, 6)):
            drafts.append(drafter.greedy(prompt + drafts))
        end = plain[2] if i % 3 == 0 else None
        for request in (EngineRequest(np.array(prompt), 6, end_id=end),
                        EngineRequest(np.array(prompt), len(drafts) + 1, end_id=end, draft_tokens=np.array(drafts))):
            assert engine.run(request).tokens == _full(engine, request)


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(round(seconds, 9))
        self.now += seconds


def test_forwards_take_the_tables_time_for_all_their_rows_and_batch_in_flight():
    clock = FakeClock()
    engine = SimEngine(SyntheticLM(VOCAB, "target"), StepTime(7.0, 0.03), clock=clock, sleeper=clock.sleep)
    a = engine.submit(EngineRequest(np.arange(1, 11), 3))  # context phase: 10 rows, yields its first token
    engine.step()
    assert clock.slept == [pytest.approx(0.007 + 0.03e-3 * 9)] and len(a.plain.tokens) == 1
    b = engine.submit(EngineRequest(np.arange(50, 53), 1, draft_tokens=np.array([7, 8])))  # joins: 3 + 2 rows
    done = engine.step()
    assert engine.last_forward == (2, 6) and done == [b]
    assert clock.slept[-1] == pytest.approx(0.007 + 0.03e-3 * 5)
    engine.step()
    assert a.finished and engine.last_forward == (1, 1)
    # the next call of the same sequence finds its prefix in the pool: only the new token is a row
    tokens = engine.result(a).tokens
    engine.submit(EngineRequest(np.concatenate([np.arange(1, 11), tokens[:2], [5]]), 1))
    engine.step()
    assert engine.last_forward == (1, 1)


def test_a_forward_counts_from_when_its_calls_arrived_not_from_when_the_adapter_got_to_them():
    """An idle engine begins a forward as a call arrives (TensorRT-LLM's executor
    picks it up as it is enqueued): the adapter's own Python work before the step
    is inside the forward's time. A call that arrives while a forward runs waits
    for that forward's end."""
    clock = FakeClock()
    engine = SimEngine(SyntheticLM(VOCAB, "target"), StepTime(7.0, 0.0), clock=clock, sleeper=clock.sleep)
    clock.now = 1.0
    engine.submit(EngineRequest(np.arange(1, 4), 2), arrived=0.9995)  # read 0.5 ms ago
    engine.step()
    assert clock.slept == [pytest.approx(0.0065)] and clock.now == pytest.approx(1.0065)
    engine.submit(EngineRequest(np.arange(10, 14), 1), arrived=1.003)  # arrived during that forward
    engine.step()  # both calls: begins when the last forward's time was up
    assert clock.slept[-1] == pytest.approx(0.007) and clock.now == pytest.approx(1.0135)
    clock.now = 2.0
    engine.submit(EngineRequest(np.arange(20, 24), 1))  # no arrival given: now
    engine.step()
    assert clock.slept[-1] == pytest.approx(0.007)


def test_sampled_calls_carry_the_real_vocabulary_and_follow_their_seed():
    engine = SimEngine(SyntheticLM(VOCAB, "draft"), StepTime(0, 0), sleep=False)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=5)
    one = engine.run(EngineRequest(np.array([1, 2, 3]), 4, sampling=params, return_logits=True))
    assert one.logits.shape == (len(one.tokens), VOCAB)
    assert engine.run(EngineRequest(np.array([1, 2, 3]), 4, sampling=params)).tokens == one.tokens
