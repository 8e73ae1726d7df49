"""Drafters (coordinator/drafters/): prompt lookup's matching, the hybrid's
choice, and the loop with each of them: greedy output equal to plain
decoding, and sampled output distributed as the target's when the drafts
come without a distribution (token matching)."""

import asyncio

import numpy as np
import pytest

from coordinator.policy.costmodel import CostModel
from coordinator.drafters import hybrid as hybrid_module, registry
from coordinator.drafters.base import DrafterOptions
from coordinator.drafters.registry import DRAFT_MODEL, PROMPT_LOOKUP
from coordinator.drafters.hybrid import HybridDrafter
from coordinator.drafters.draft_model import ModelDrafter, CATCH_UP_CHUNK, CATCH_UP_FIRST, catch_up_ends
from coordinator.drafters.prompt_lookup import PromptLookupDrafter, lookup
from coordinator.verification.outcome import score_alternatives
from coordinator.decoding.loop import speculative_decode
from coordinator.policy.speculation import Mode, SpeculationPolicy
from coordinator.rounds import Round
from coordinator.sampling.params import SamplingParams
from coordinator.sampling.maths import processed_probs
from tests.fakes import VOCAB, ToyEngine, toy_logits
from tests.stats import gof_pvalue

GREEDY = SamplingParams()
HYBRID = hybrid_module.NAME


def make_drafter(name, model):
    return registry.build(name, DrafterOptions(model=model))


def test_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix_that_occurs():
    #          0  1  2  3  4  5  6  7  8  9
    context = [7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    assert lookup(context, 3, max_ngram=3, min_ngram=1) == (2, [4, 5, 1])  # "1 2" last seen at 5: then 4 5 1
    assert lookup([5, 6, 1, 2, 3, 8, 2, 3], 2, 3, 1) == (2, [8, 2])
    assert lookup([1, 2, 3, 4], 4, 3, 1) == (0, [])  # the last token never occurred before
    assert lookup([1, 2, 3, 1, 2, 3, 1], 10, 3, 1) == (3, [2, 3, 1])  # runs up to the end of the context
    assert lookup([4, 4, 4, 4], 2, 3, 2) == (3, [4])
    assert lookup([1, 2], 0, 3, 1) == (0, [])


def test_lookup_prefers_a_longer_match_over_a_more_recent_shorter_one():
    context = [1, 2, 3, 50, 9, 3, 60, 1, 2, 3]  # "3" alone last continues with 60; "1 2 3" with 50
    assert lookup(context, 1, max_ngram=3, min_ngram=1) == (3, [50])
    assert lookup(context, 1, max_ngram=1, min_ngram=1) == (1, [60])


def test_the_hybrid_offers_prompt_lookup_only_where_the_match_is_confident():
    model = ModelDrafter(ToyEngine(), GREEDY, (), catch_up_after=6)
    hybrid = HybridDrafter(model, PromptLookupDrafter(max_ngram=3, min_ngram=3))
    assert hybrid.candidates([1, 2, 3, 9, 1, 2, 3]) == (PROMPT_LOOKUP, DRAFT_MODEL)
    assert hybrid.candidates([1, 2, 3, 9, 8, 2, 3]) == (DRAFT_MODEL,)  # only "2 3" matches
    proposal = asyncio.run(hybrid.propose([1, 2, 3, 9, 1, 2, 3], 4, seed=0, distribution=True))
    assert proposal.drafter == PROMPT_LOOKUP and proposal.tokens == [9, 1, 2, 3] and proposal.log_probs is None
    proposal = asyncio.run(hybrid.propose([1, 2, 3, 9, 1, 2, 3], 2, seed=0, distribution=False, using=DRAFT_MODEL))
    assert proposal.drafter == DRAFT_MODEL and len(proposal.tokens) == 2
    proposal = asyncio.run(hybrid.propose([1, 2, 3, 9, 8, 2, 3], 2, seed=0, distribution=False))
    assert proposal.drafter == DRAFT_MODEL and len(proposal.tokens) == 2


def test_a_warm_draft_model_is_preferred_and_reports_what_prompt_lookup_would_have_proposed():
    model = ModelDrafter(ToyEngine(), GREEDY, (), catch_up_after=6)
    hybrid = HybridDrafter(model, PromptLookupDrafter(max_ngram=3, min_ngram=3))
    context = [1, 2, 3, 9, 4, 5, 1, 2, 3]
    assert hybrid.candidates(context) == (PROMPT_LOOKUP, DRAFT_MODEL)  # cold: it would catch up on 9 tokens
    model.verified(len(context) - 2)
    assert hybrid.candidates(context) == (DRAFT_MODEL, PROMPT_LOOKUP)
    proposal = asyncio.run(hybrid.propose(context, 2, seed=0, distribution=False))
    assert proposal.drafter == DRAFT_MODEL and proposal.alternatives == ((PROMPT_LOOKUP, [9, 4, 5]),)


def test_an_alternative_is_scored_as_token_matching_would_have_verified_it():
    assert score_alternatives([(PROMPT_LOOKUP, [7, 8, 9])], [7, 8, 4]) == ((PROMPT_LOOKUP, 2, True),)
    assert score_alternatives([(PROMPT_LOOKUP, [7, 8, 9])], [7, 8]) == ((PROMPT_LOOKUP, 2, False),)  # not tried
    assert score_alternatives([(PROMPT_LOOKUP, [7])], [7, 8, 4]) == ((PROMPT_LOOKUP, 1, False),)
    assert score_alternatives([(PROMPT_LOOKUP, [5, 8])], [7, 8]) == ((PROMPT_LOOKUP, 0, True),)


def test_the_hybrid_in_the_loop_learns_prompt_lookup_from_the_draft_models_rounds():
    """Copying text with a warm draft model: the draft model drafts, and its rounds
    score prompt lookup's proposals (every emitted token right, the text copies), so
    the request's evidence for lookup grows without a round of its own; the output
    stays plain decoding's."""
    def copying(context):  # the next token repeats the one 8 positions back
        logits = np.full(VOCAB, -5.0)
        logits[context[-8]] = 5.0
        return logits

    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    target, draft = ToyEngine(copying), ToyEngine(copying)
    model = ModelDrafter(draft, GREEDY, (999,), catch_up_after=4)
    model.verified(len(prompt))  # warm: its cache holds the prompt
    hybrid = HybridDrafter(model, PromptLookupDrafter(max_ngram=3, min_ngram=3))
    policy = SpeculationPolicy(3, 0.0, costs=CostModel(), adaptive=False, first_round_plain=False)

    async def collect():
        return [r async for r in speculative_decode(prompt, 16, drafter=hybrid, target=target, policy=policy,
                                                    sampling=GREEDY, end_ids=(999,))]

    rounds = asyncio.run(collect())
    assert [t for r in rounds for t in r.tokens] == (prompt * 2)[32:48]
    assert {r.drafter for r in rounds} == {DRAFT_MODEL}
    assert [r.alternatives for r in rounds] == [((PROMPT_LOOKUP, len(r.tokens), False),) for r in rounds]
    assert policy._drafted(PROMPT_LOOKUP) == 16 and policy.acceptance_estimate(PROMPT_LOOKUP) > 0.75
    assert policy.costs.server_acceptance(0.0, PROMPT_LOOKUP) == 1.0


def test_make_drafter_names_every_drafter_and_refuses_others():
    model = lambda: ModelDrafter(ToyEngine(), GREEDY, (), catch_up_after=6)  # noqa: E731
    assert make_drafter(DRAFT_MODEL, model=model).name == DRAFT_MODEL
    assert make_drafter(PROMPT_LOOKUP, model=model).name == PROMPT_LOOKUP
    assert make_drafter(HYBRID, model=model).name == HYBRID
    with pytest.raises(ValueError, match="drafter must be one of draft_model, prompt_lookup, hybrid, got 'ngram'"):
        make_drafter("ngram", model=model)


def decode(prompt, max_new, drafter_name, target, window=5, sampling=GREEDY, policy=None, draft=None):
    policy = policy or SpeculationPolicy(window, 0.0, costs=CostModel(), adaptive=False, first_round_plain=False)
    draft = draft or ToyEngine()
    drafter = make_drafter(drafter_name, model=lambda: ModelDrafter(draft, sampling, (999,), window + 1))

    async def collect():
        return [r async for r in speculative_decode(prompt, max_new, drafter=drafter, target=target, policy=policy,
                                                    sampling=sampling, end_ids=(999,))]

    return asyncio.run(collect()), policy


def repeating(context):
    """A target that copies: after any token it likes the token that followed it last time."""
    logits = toy_logits(context)
    for i in range(len(context) - 2, -1, -1):
        if context[i] == context[-1]:
            logits[context[i + 1]] += 12.0
            break
    return logits


@pytest.mark.parametrize("drafter", [DRAFT_MODEL, PROMPT_LOOKUP, HYBRID])
def test_greedy_output_equals_plain_decoding_with_every_drafter(drafter):
    prompt = [3, 8, 1, 4, 9, 2, 7, 3, 8, 1]
    plain, _ = decode(prompt, 40, drafter, ToyEngine(repeating), window=0)
    rounds, _ = decode(prompt, 40, drafter, ToyEngine(repeating))
    assert [t for r in rounds for t in r.tokens] == [t for r in plain for t in r.tokens]
    assert sum(r.drafted for r in rounds) > 0
    assert {r.drafter for r in rounds if r.drafted} <= {DRAFT_MODEL, PROMPT_LOOKUP}


def test_prompt_lookup_on_a_copying_target_accepts_most_drafts_and_needs_few_target_calls():
    prompt = [3, 8, 1, 4, 9, 2, 7, 3, 8, 1]
    target = ToyEngine(repeating)
    rounds, _ = decode(prompt, 40, PROMPT_LOOKUP, target)
    drafted, accepted = sum(r.drafted for r in rounds), sum(r.accepted for r in rounds)
    assert accepted / drafted > 0.8
    assert len(target.calls) <= 20  # for 40 tokens (plain decoding: 40)


def peaked(context):
    """Most mass on a few tokens, so a sampled first-two-token joint has few cells."""
    rng = np.random.default_rng([len(context), *context[-2:]])
    logits = np.full(VOCAB, -30.0)
    logits[[1, 2, 3, 4]] = rng.normal(0.0, 1.0, 4)
    return logits


def test_sampled_requests_with_prompt_lookup_are_lossless_and_keep_speculating():
    """Drafts without a distribution are verified by token matching: the first two emitted
    tokens follow the target's exact joint distribution, and no request stops speculating
    for want of logits."""
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]  # lookup proposes what followed "1 2": 4 1 2
    params = SamplingParams(temperature=1.0, seed=0)
    first = processed_probs(peaked(prompt), params)
    joint = np.stack([first[t] * processed_probs(peaked(prompt + [t]), params) for t in range(VOCAB)])
    samples, drafted = [], 0
    for seed in range(3000):
        target = ToyEngine(peaked)
        rounds, policy = decode(prompt, 3, PROMPT_LOOKUP, target, window=2,
                                sampling=SamplingParams(temperature=1.0, seed=seed))
        tokens = [t for r in rounds for t in r.tokens]
        samples.append(tokens[0] * VOCAB + tokens[1])
        drafted += sum(r.drafted for r in rounds)
        assert policy.mode is Mode.SPECULATING and not target.received_draft_logits
    assert drafted > 3000  # every request drafted
    assert gof_pvalue(np.bincount(samples, minlength=VOCAB * VOCAB), joint.reshape(-1)) > 1e-4


def test_each_drafter_is_priced_by_its_own_cost_and_acceptance():
    costs = CostModel()
    policy = SpeculationPolicy(5, 0.0, costs=costs, first_round_plain=False)
    costs.observe_plain(0.2)
    for _ in range(8):
        for round_ in (Round([1] * 5, 4, 4, False, 0.0004, 0.25, PROMPT_LOOKUP, draft_sample=0.0004, target_sample=0.25),
                       Round([1], 4, 0, False, 0.24, 0.25, DRAFT_MODEL, draft_sample=0.24, target_sample=0.25)):
            costs.observe(round_)
            policy.observe(round_)
    assert costs.draft_cost(4, drafter=PROMPT_LOOKUP) < 0.01 < costs.draft_cost(4, drafter=DRAFT_MODEL)
    assert policy.acceptance_estimate(PROMPT_LOOKUP) > 0.8 > 0.3 > policy.acceptance_estimate(DRAFT_MODEL)
    assert policy.window(0, PROMPT_LOOKUP) > 0


class LengthRecordingEngine(ToyEngine):
    """A ToyEngine that records each call's input length."""

    def __init__(self):
        super().__init__()
        self.lengths: list[int] = []

    async def generate(self, input_ids, max_new_tokens, sampling, draft_tokens=(), draft_logits=None,
                       return_logits=False):
        self.lengths.append(len(input_ids))
        return await super().generate(input_ids, max_new_tokens, sampling, draft_tokens, draft_logits,
                                      return_logits)


def test_catch_up_calls_end_after_a_short_first_call_on_a_long_prompt_then_every_chunk_then_at_the_end():
    assert catch_up_ends(300, 128, 32) == [32, 160, 288, 300]
    assert catch_up_ends(257, 128, 32) == [32, 160, 257]
    assert catch_up_ends(300, 128, 128) == [128, 256, 300]
    # up to two chunks: no short first call
    assert catch_up_ends(256, 128, 32) == [128, 256]
    assert catch_up_ends(150, 128, 32) == [128, 150]
    assert catch_up_ends(20, 128, 32) == [20]
    assert catch_up_ends(0, 128, 32) == []
    assert CATCH_UP_FIRST < CATCH_UP_CHUNK
    long = 2 * CATCH_UP_CHUNK + 1
    assert catch_up_ends(long) == [CATCH_UP_FIRST, CATCH_UP_FIRST + CATCH_UP_CHUNK, 2 * CATCH_UP_CHUNK + 1]


def test_the_draft_model_catches_up_on_a_prompt_in_chunks_and_stops_when_no_longer_wanted():
    prompt = list(range(1, 2 * CATCH_UP_CHUNK + 40))
    engine, asked = LengthRecordingEngine(), []
    model = ModelDrafter(engine, GREEDY, (), catch_up_after=6)
    assert asyncio.run(model.warm_up(prompt, seed=1, wanted=lambda done: not asked.append(done))) == len(prompt)
    assert engine.lengths == catch_up_ends(len(prompt))  # each call reuses the cache the one before left
    assert asked == [0, *engine.lengths[:-1]]  # asked before each call, with what was caught up so far
    assert engine.calls == [(1, 0)] * len(engine.lengths) and model.seen == len(prompt)
    # no longer wanted after the first call: no second one, and it says how far it got
    engine = LengthRecordingEngine()
    model = ModelDrafter(engine, GREEDY, (), catch_up_after=6)
    assert asyncio.run(model.warm_up(prompt, seed=1, wanted=lambda done: done == 0)) == CATCH_UP_FIRST
    assert engine.lengths == [CATCH_UP_FIRST]
    # the hybrid passes the request's wish on
    engine = LengthRecordingEngine()
    hybrid = make_drafter(HYBRID, model=lambda: ModelDrafter(engine, GREEDY, (), catch_up_after=6))
    assert asyncio.run(hybrid.warm_up(prompt, seed=1, wanted=lambda done: False)) == 0
    assert engine.lengths == []


def test_a_new_drafter_is_one_file_and_one_registry_entry(monkeypatch):
    """tests/toy_drafter.py and one entry: the settings, the request parser, the policy, the
    cost model and the metrics take it by its name, and greedy output stays plain decoding's."""
    from coordinator.request.parse import parse_request
    from coordinator.response.metrics import DRAFT_TOKENS, MetricsRecorder
    from coordinator.settings import CoordinatorSettings
    from tests import toy_drafter

    with pytest.raises(ValueError, match="drafter must be one of"):
        CoordinatorSettings(drafter=toy_drafter.NAME)
    monkeypatch.setattr(registry, "ENTRIES", (*registry.ENTRIES, toy_drafter.ENTRY))
    monkeypatch.setitem(registry.REGISTRY, toy_drafter.NAME, toy_drafter.ENTRY)

    CoordinatorSettings(drafter=toy_drafter.NAME)
    request = parse_request({"text_input": np.array([b"x"], dtype=object),
                             "drafter": np.array([toy_drafter.NAME.encode()], dtype=object)},
                            CoordinatorSettings(), new_seed=lambda: 1)
    assert request.drafter == toy_drafter.NAME and registry.is_free(toy_drafter.NAME)
    assert CostModel().draft_cost(3, drafter=toy_drafter.NAME) == 0.0

    prompt = [5, 6, 7, 7, 7, 7, 8, 9]
    rounds, _ = decode(prompt, 24, toy_drafter.NAME, ToyEngine(repeating))
    plain, _ = decode(prompt, 24, toy_drafter.NAME, ToyEngine(repeating), window=0)
    assert [t for r in rounds for t in r.tokens] == [t for r in plain for t in r.tokens]
    assert {r.drafter for r in rounds if r.drafted} == {toy_drafter.NAME}

    made = {}
    recorder = MetricsRecorder(lambda spec: made.setdefault(spec, Counter()))
    metrics = recorder.start_request()
    for round_ in rounds:
        metrics.round(round_)
    assert made[DRAFT_TOKENS[toy_drafter.NAME]].total == sum(r.drafted for r in rounds) > 0


class Counter:
    def __init__(self):
        self.total = 0.0

    def increment(self, value):
        self.total += value

    def set(self, value):
        pass

    def observe(self, value):
        pass
