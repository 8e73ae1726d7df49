"""What the loop's tests share: running the loop to its end on toy engines, a
scripted clock, and engines that record or time their calls."""

import asyncio

from coordinator.decoding.loop import speculative_decode
from coordinator.policy.costmodel import PREFILL_MIN_SAMPLES, CostModel
from coordinator.policy.speculation import SpeculationPolicy
from coordinator.sampling.params import SamplingParams
from tests.fakes import ToyEngine, toy_logits

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


def run_stretched(prompt, max_new, draft, target, policy, stretch=16, sampling=GREEDY, end_ids=(999,)):
    async def collect():
        return [r async for r in speculative_decode(
            prompt, max_new, draft=draft, target=target, policy=policy, sampling=sampling, end_ids=end_ids,
            plain_stretch=stretch)]

    return asyncio.run(collect())


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


