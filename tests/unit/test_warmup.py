"""The draft model's background catch-up on the prompt, and whether it pays
(coordinator/drafters/warmup.py)."""

import asyncio

from coordinator.decoding.loop import speculative_decode
from coordinator.drafters.draft_model import (
    CATCH_UP_CHUNK,
    CATCH_UP_FIRST,
    catch_up_ends,
)
from coordinator.engines.contract import EngineOutput
from coordinator.policy.costmodel import (
    PREFILL_EXPLORE_EVERY,
    PREFILL_MIN_SAMPLES,
    CostModel,
    load_bucket,
)
from coordinator.policy.governor import PLAIN, LoadGovernor
from coordinator.policy.speculation import SpeculationPolicy
from tests.fakes import ToyEngine
from tests.loop_helpers import (
    GREEDY,
    FakeClock,
    RecordingEngine,
    costs_where_the_draft_prefill_costs,
    run,
    run_stretched,
    tokens_of,
)


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


def test_a_catch_up_waits_while_another_request_s_prompt_prefills_on_the_target():
    """In a burst of arrivals, a request's warm-up started at its first token would
    take the cores (or the GPU) the later prompts' first tokens wait on: it starts
    once no prompt is prefilling, and meanwhile the draft model drafts nothing."""
    governor = LoadGovernor()
    governor.prefill_started()  # another request's prompt
    target_calls, draft_calls_at = [], []

    async def target_step():
        target_calls.append(len(target_calls))
        if len(target_calls) == 4:  # the other prompt's first token
            governor.prefill_ended()

    async def draft_step():
        draft_calls_at.append(len(target_calls))

    prompt = [1 + (i * 7) % 50 for i in range(2 * CATCH_UP_CHUNK)]
    plain, _ = run(prompt, 40, ToyEngine(), ToyEngine(), window=0)
    draft, target = RecordingEngine(draft_step), RecordingEngine(target_step)
    policy = SpeculationPolicy(4, 0.3, costs=CostModel(streams=2), governor=governor)
    rounds = run_stretched(prompt, 40, draft, target, policy)
    assert tokens_of(rounds) == tokens_of(plain)
    assert draft_calls_at and min(draft_calls_at) >= 4  # not one draft forward before the other's first token
    assert sum(r.drafted for r in rounds) > 0  # and it speculates once that prompt is in
    waiting = [r for r in rounds if not r.speculative][1:4]
    assert all(r.plain_reason == "draft_catching_up" and len(r.tokens) <= 2 for r in waiting)
    # with no other prompt prefilling, the warm-up starts after the first stretch
    draft, target = RecordingEngine(), RecordingEngine()
    run_stretched(prompt, 40, draft, target, SpeculationPolicy(4, 0.3, costs=CostModel(streams=2),
                                                               governor=LoadGovernor()))
    assert draft.lengths[0] == CATCH_UP_FIRST
