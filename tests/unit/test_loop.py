import asyncio

import pytest

from coordinator.policy.costmodel import PREFILL_EXPLORE_EVERY, PREFILL_MIN_SAMPLES, CostModel, load_bucket
from coordinator.drafters.draft_model import CATCH_UP_CHUNK, CATCH_UP_FIRST, catch_up_ends
from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.engines.contract import EngineError, EngineOutput
from coordinator.decoding.loop import common_prefix_length, speculative_decode
from coordinator.verification.outcome import reached_end_by_count
from coordinator.policy.governor import PLAIN, LoadGovernor
from coordinator.policy.speculation import Mode, SpeculationPolicy
from coordinator.sampling.params import SamplingParams, call_seed
from tests.fakes import ToyEngine, noisy, toy_logits

GREEDY = SamplingParams()


def run(prompt, max_new, draft, target, window=4, threshold=0.0, sampling=GREEDY, end_ids=(999,), policy=None,
        draft_sampling=None, clock=None, draft_distribution=True):
    policy = policy or SpeculationPolicy(window, threshold, adaptive=False, first_round_plain=False)
    extra = {"clock": clock} if clock else {}
    extra["draft_distribution"] = draft_distribution

    async def collect():
        return [r async for r in speculative_decode(
            prompt, max_new, draft=draft, target=target, policy=policy, sampling=sampling, end_ids=end_ids,
            draft_sampling=draft_sampling, **extra)]

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


# ---------------------------------------------------------------------------
# the end token, whether or not the engines return it


def greedy_reference(prompt, n, end=None):
    """Plain greedy decoding of toy_logits, written independently of the loop and the engines."""
    out = []
    while len(out) < n:
        token = int(toy_logits(list(prompt) + out).argmax())
        if token == end:
            break
        out.append(token)
    return out


ENGINE_KINDS = {
    "tensorrt_llm": {},  # end token neither returned nor counted
    "returns_end_token": {"returns_end_token": True},
    "continues_after_verify": {"continues_after_verify": True},
}


@pytest.mark.parametrize("kind", list(ENGINE_KINDS))
@pytest.mark.parametrize("end_at", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("window", [0, 1, 3, 4])
@pytest.mark.parametrize("flip_every", [0, 3])
def test_ends_where_plain_decoding_ends_whatever_the_engines_do_with_the_end_token(kind, end_at, window, flip_every):
    """The end token is the greedy token at position ``end_at``: the request ends
    there, without it, for engines that drop it (TensorRT-LLM), return it, or
    keep decoding after a verification; and never raises."""
    prompt = [4, 8]
    full = greedy_reference(prompt, 20)
    end = full[end_at]
    expected = greedy_reference(prompt, 20, end=end)
    options = ENGINE_KINDS[kind]
    draft = ToyEngine(noisy(toy_logits, flip_every), end_id=end, **options)
    target = ToyEngine(end_id=end, **options)
    rounds, _ = run(prompt, 20, draft, target, window=window, end_ids=(end,))
    assert tokens_of(rounds) == expected
    assert rounds[-1].finished and all(not r.finished for r in rounds[:-1])
    # at most one extra call, with an engine whose verification keeps decoding
    extra = 1 if kind == "continues_after_verify" else 0
    assert len(target.calls) <= len(rounds) <= (len(expected) + 1 + extra)


def test_a_target_call_that_returns_no_token_ends_the_request():
    """TensorRT-LLM returns zero tokens when the first new token is the end id."""
    end = int(toy_logits([1, 2]).argmax())  # the first greedy token after [1, 2]
    for window in (0, 4):
        rounds, _ = run([1, 2], 20, ToyEngine(end_id=end), ToyEngine(end_id=end), window=window, end_ids=(end,))
        assert tokens_of(rounds) == [] and len(rounds) == 1 and rounds[0].finished


def test_the_draft_never_proposes_the_end_token():
    prompt = [4, 8]
    end = greedy_reference(prompt, 10)[3]
    draft = ToyEngine(returns_end_token=True, end_id=end)
    target = ToyEngine(end_id=end)
    sent = []
    original = target.generate

    async def spy(input_ids, max_new_tokens, sampling, draft_tokens=(), **kwargs):
        sent.append(list(draft_tokens))
        return await original(input_ids, max_new_tokens, sampling, draft_tokens, **kwargs)

    target.generate = spy
    rounds, _ = run(prompt, 20, draft, target, window=6, end_ids=(end,))
    assert tokens_of(rounds) == greedy_reference(prompt, 20, end=end)
    assert all(end not in drafts for drafts in sent)


@pytest.mark.parametrize("reached,accepted,requested,verified,ended", [
    (0, 0, 1, False, True),  # plain step, end first
    (1, 0, 1, False, False),
    (2, 2, 3, True, True),  # all returned tokens are drafts: the next one was the end
    (3, 2, 3, True, False),  # 2 accepted + bonus
    (2, 1, 4, True, False),  # rejection: correction token, the normal stop
    (3, 1, 4, True, True),  # kept decoding after the correction, then the end
    (4, 1, 4, True, False),
    (2, 0, 5, False, True),  # a multi-token plain call that stopped early
])
def test_reached_end_by_count(reached, accepted, requested, verified, ended):
    assert reached_end_by_count(reached, accepted, requested, verified) is ended


# ---------------------------------------------------------------------------
# random state: every engine call has a seed of its own


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


class FakeClock:
    """Engine calls take a scripted number of seconds (drafts: per token)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class RecordingEngine(ToyEngine):
    """Records each call's input length, and awaits ``before_call()`` (if any)
    before answering: a call that takes time, or that something happens during."""

    def __init__(self, before_call=None):
        super().__init__()
        self.lengths, self.before_call = [], before_call

    async def generate(self, input_ids, max_new_tokens, sampling, *args, **kwargs):
        self.lengths.append(len(input_ids))
        if self.before_call is not None:
            await self.before_call()
        return await super().generate(input_ids, max_new_tokens, sampling, *args, **kwargs)


class TimedEngine(ToyEngine):
    def __init__(self, clock, fixed, per_token, logits_fn=toy_logits):
        super().__init__(logits_fn)
        self.clock, self.fixed, self.per_token = clock, fixed, per_token

    async def generate(self, input_ids, max_new_tokens, sampling, draft_tokens=(), **kwargs):
        out = await super().generate(input_ids, max_new_tokens, sampling, draft_tokens, **kwargs)
        work = len(draft_tokens) if draft_tokens else max_new_tokens
        self.clock.now += self.fixed + self.per_token * work
        return out


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


# ---- fewer round trips: plain stretches in one streamed call, the draft warmed up in the background ----


def run_stretched(prompt, max_new, draft, target, policy, stretch=16, sampling=GREEDY, end_ids=(999,)):
    async def collect():
        return [r async for r in speculative_decode(
            prompt, max_new, draft=draft, target=target, policy=policy, sampling=sampling, end_ids=end_ids,
            plain_stretch=stretch)]

    return asyncio.run(collect())


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


def costs_where_the_draft_prefill_costs(seconds_per_token, context, streams=0):
    costs = CostModel(streams=streams)
    for k in range(1, 5):
        costs.observe_draft(k, 0.02 * k, context=context)
        costs.observe_verify(k, 0.11, context=context)
    costs.observe_plain(0.1, context=context)
    for _ in range(PREFILL_MIN_SAMPLES):
        costs.observe_draft_prefill(context, seconds_per_token * context, context=context)
    for _ in range(20):
        costs.observe_acceptance(3, rejected=True)
    return costs


def test_a_draft_catch_up_that_would_not_pay_is_skipped_and_the_request_says_so():
    """A long prompt, a short completion: the draft model's prefill of the prompt is
    priced against what speculation would save over the tokens left."""
    prompt = [1 + (i * 7) % 50 for i in range(600)]
    draft, target = ToyEngine(), ToyEngine()
    policy = SpeculationPolicy(4, 0.3, costs=costs_where_the_draft_prefill_costs(0.01, 600))
    rounds = run_stretched(prompt, 12, draft, target, policy)
    plain, _ = run(prompt, 12, ToyEngine(), ToyEngine(), window=0)
    assert tokens_of(rounds) == tokens_of(plain)
    assert draft.calls == [] and sum(r.drafted for r in rounds) == 0
    assert policy.reason.startswith("draft model not used: catching up on 601 tokens (~6.0 s)")
    # nothing will draft in this request: its plain tokens come in stretches, as plain decoding's do
    assert target.streamed == [1, 11]
    # the same request with a cheap prefill, or a completion long enough to earn it back, warms up and speculates
    for cost, tokens in ((0.0001, 12), (0.01, 1000)):
        draft = ToyEngine()
        policy = SpeculationPolicy(4, 0.3, costs=costs_where_the_draft_prefill_costs(cost, 600))
        rounds = run_stretched(prompt, tokens, draft, ToyEngine(), policy)
        # (later rounds are priced from the toy engines' wall-clock timings, which a busy
        # machine makes noisy: only the catch-up decision is asserted)
        assert draft.calls[0] == (1, 0) and sum(r.drafted for r in rounds) > 0
        assert not policy.reason.startswith("draft model not used")


def test_a_catch_up_under_load_is_priced_by_the_time_every_stream_decoding_waits_for_it():
    """The draft's catch-up forwards take the cores every stream's target step
    needs (the engines take turns), so under load its time is paid once per
    stream decoding, against what it saves the one request."""
    for streams, pays in ((1, True), (8, False)):
        costs = costs_where_the_draft_prefill_costs(1 / 600, 600, streams=streams)
        policy = SpeculationPolicy(4, 0.3, costs=costs)
        # predicted to save about 3.8 s over 100 tokens; the catch-up takes 1 s
        assert policy.catch_up_pays(600, 100) is pays
    assert policy.reason.startswith("draft model not used: catching up on 600 tokens (~1.0 s, waited out by "
                                    "the 8 requests decoding: ~8.0 s) is predicted to save less")


def test_a_catch_up_stops_once_the_server_holds_speculation_back_at_its_load():
    """Its forwards take the cores the other streams need: once the load
    governor measured plain decoding faster at this load, no further call."""
    governor = LoadGovernor()

    async def verdict():  # the governor's verdict arrives during the first call
        governor.regimes[load_bucket(2)] = PLAIN

    prompt = [1 + (i * 7) % 50 for i in range(6 * CATCH_UP_CHUNK)]
    plain, _ = run(prompt, 40, ToyEngine(), ToyEngine(), window=0)
    draft = RecordingEngine(verdict)
    policy = SpeculationPolicy(4, 0.3, costs=CostModel(streams=2), governor=governor)
    rounds = run_stretched(prompt, 40, draft, ToyEngine(), policy)
    assert tokens_of(rounds) == tokens_of(plain)
    assert draft.lengths == [CATCH_UP_FIRST] and sum(r.drafted for r in rounds) == 0


def test_the_draft_warm_up_is_timed_for_the_cost_model():
    costs = CostModel()
    for request in range(PREFILL_MIN_SAMPLES):
        assert costs.draft_prefill_seconds(121) is None  # a first call pays one-time costs: not priced yet
        run_stretched([1, 2, 3] * 40, 20, ToyEngine(), ToyEngine(), SpeculationPolicy(4, 0.3, costs=costs))
    assert costs.draft_prefill_seconds(121) is not None
    assert costs.draft_prefill_seconds(5000) == costs.draft_prefill_seconds(121)  # a floor for longer contexts


def test_a_refused_catch_up_is_measured_again_every_few_requests():
    """An estimate that stops the draft model must not rule for good: nothing
    would ever measure it again."""
    prompt = [1 + (i * 7) % 50 for i in range(600)]
    costs = costs_where_the_draft_prefill_costs(0.01, 600)
    warmed_up = []
    for _ in range(2 * PREFILL_EXPLORE_EVERY):
        draft = ToyEngine()
        run_stretched(prompt, 12, draft, ToyEngine(), SpeculationPolicy(4, 0.3, costs=costs))
        warmed_up.append(bool(draft.calls))
    assert warmed_up == ([False] * (PREFILL_EXPLORE_EVERY - 1) + [True]) * 2


def test_a_request_that_ends_before_its_draft_caught_up_issues_no_further_catch_up_call():
    """Triton cannot cancel an engine call, so the catch-up goes in chunks and a
    finished request starts no new one: at most the call in flight runs on."""
    prompt = [1 + (i * 7) % 50 for i in range(6 * CATCH_UP_CHUNK)]
    draft, costs = RecordingEngine(lambda: asyncio.sleep(0.05)), CostModel()  # a chunk of the prompt's prefill

    async def request_then_wait():
        rounds = [r async for r in speculative_decode(
            prompt, 3, draft=draft, target=ToyEngine(), policy=SpeculationPolicy(4, 0.3, costs=costs),
            sampling=GREEDY, end_ids=(999,), plain_stretch=16)]
        calls_at_the_end = len(draft.lengths)
        await asyncio.sleep(0.5)  # long enough for every chunk, had they been issued
        return rounds, calls_at_the_end

    rounds, calls_at_the_end = asyncio.run(request_then_wait())
    assert sum(len(r.tokens) for r in rounds) == 3 and sum(r.drafted for r in rounds) == 0
    assert 1 <= calls_at_the_end < 6 and len(draft.lengths) == calls_at_the_end
    assert draft.lengths == catch_up_ends(len(prompt))[:calls_at_the_end]
    # what it did is a price sample of its own (seconds per token caught up)
    assert costs.cell(len(prompt)).draft_prefill.samples == 1


def test_a_catch_up_whose_own_calls_show_it_will_not_pay_stops_and_the_request_decodes_plainly():
    """A fresh server has no price for a long prompt's catch-up, so the first
    requests catch up to measure it; the request's own first call already tells
    what the rest would cost, and a rest that cannot pay over the tokens left stops."""
    class Clocked(RecordingEngine):
        """Every call costs ``seconds`` on the fake clock; streamed plain tokens 0.1 s each."""

        def __init__(self, clock, seconds):
            super().__init__(self._spend)
            self.clock, self.seconds = clock, seconds

        async def _spend(self):
            await asyncio.sleep(0)
            self.clock.now += self.seconds

        async def stream(self, input_ids, max_new_tokens, sampling):
            self.streamed.append(max_new_tokens)
            output = await ToyEngine.generate(self, input_ids, max_new_tokens, sampling)
            for token in output.tokens:
                await asyncio.sleep(0)
                self.clock.now += 0.1
                yield EngineOutput([token])

    def request(draft_seconds):
        clock, costs = FakeClock(), CostModel()
        costs.observe_plain(0.1, context=len(prompt))
        draft, policy = Clocked(clock, draft_seconds), SpeculationPolicy(4, 0.3, costs=costs)

        async def collect():
            return [r async for r in speculative_decode(
                prompt, 40, draft=draft, target=Clocked(clock, 0.1), policy=policy, sampling=GREEDY,
                end_ids=(999,), plain_stretch=16, clock=clock)]

        return asyncio.run(collect()), draft, policy

    prompt = [1 + (i * 7) % 50 for i in range(6 * CATCH_UP_CHUNK)]
    plain, _ = run(prompt, 40, ToyEngine(), ToyEngine(), window=0)
    rounds, draft, policy = request(draft_seconds=1.0)
    assert tokens_of(rounds) == tokens_of(plain)
    # its first call of 32 tokens took 1 s: the other 737 would take 23 s, more than the
    # at most 4 s that 40 tokens of 0.1 s could save; so no second call, and no draft model
    assert CATCH_UP_FIRST == 32 and len(prompt) + 1 == 769
    assert draft.lengths == [CATCH_UP_FIRST] and sum(r.drafted for r in rounds) == 0
    assert policy.reason.startswith(f"draft model not used: the rest of its catch-up on {len(prompt) + 1} tokens")
    # a cheap catch-up goes on to its end
    rounds, draft, policy = request(draft_seconds=0.001)
    assert tokens_of(rounds) == tokens_of(plain)
    assert draft.lengths[:7] == catch_up_ends(len(prompt) + 1)
    assert not policy.reason.startswith("draft model not used")
