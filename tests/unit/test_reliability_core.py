"""Reliability of the pure core: the draft deadline, per-round cancellation and
the prompt-size guard, with toy engines (no models, no Triton)."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from coordinator.settings import CoordinatorSettings
from coordinator.decoding.generation import RequestCancelled, generate_text
from coordinator.policy.governor import LoadGovernor
from coordinator.decoding.loop import speculative_decode
from coordinator.response.metrics import DRAFT_FAILURES, REQUESTS, MetricsRecorder
from coordinator.policy.speculation import Mode, SpeculationPolicy
from coordinator.request.parse import GenerationRequest, InputError
from coordinator.sampling.params import SamplingParams
from coordinator.request.tokenizer import Codec, SpecialTokens
from tests.fakes import ToyEngine, toy_logits
from tests.unit.test_metrics import Fake as FakeInstrument

GREEDY = SamplingParams()


class SlowDraft(ToyEngine):
    """A draft whose calls take ``delay`` seconds (of real asyncio time)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay
        self.finished = 0

    async def generate(self, *args, **kwargs):
        await asyncio.sleep(self.delay)
        self.finished += 1
        return await super().generate(*args, **kwargs)


def decode(prompt, max_new, draft, target, draft_timeout, window=4):
    policy = SpeculationPolicy(window, 0.0, adaptive=False, first_round_plain=False)

    async def collect():
        rounds = [r async for r in speculative_decode(
            prompt, max_new, draft=draft, target=target, policy=policy, sampling=GREEDY, end_ids=(999,),
            draft_timeout=draft_timeout)]
        await asyncio.sleep(0.3)  # let a late draft call finish in the background
        return rounds

    return asyncio.run(collect()), policy


def test_a_draft_slower_than_the_deadline_is_dropped_and_the_request_completes():
    draft = SlowDraft(0.2)
    rounds, policy = decode([1, 2], 12, draft, ToyEngine(), draft_timeout=0.05)
    plain, _ = decode([1, 2], 12, ToyEngine(), ToyEngine(), draft_timeout=None, window=0)
    assert [t for r in rounds for t in r.tokens] == [t for r in plain for t in r.tokens]
    assert policy.mode is Mode.DRAFT_FAILED
    assert policy.reason == "draft model failed: draft did not answer within 0.05 s (draft_timeout_seconds)"
    assert sum(r.drafted for r in rounds) == 0
    assert len(draft.calls) == 1 and draft.finished == 1  # one late call, left to finish, never retried


def test_a_draft_within_the_deadline_is_used():
    rounds, policy = decode([1, 2], 12, SlowDraft(0.01), ToyEngine(), draft_timeout=5.0)
    assert policy.mode is Mode.SPECULATING and sum(r.drafted for r in rounds) > 0


def test_a_background_prefill_slower_than_the_deadline_still_lets_the_request_draft():
    """The draft's prefill of a greedy prompt runs while the target decodes: a
    slow one (a long prompt, a crowd of them) costs no token, so no deadline
    ends it and the request drafts once it is done."""

    class SlowFirstCall(SlowDraft):
        async def generate(self, *args, **kwargs):
            if not self.calls:
                await asyncio.sleep(self.delay)
            return await ToyEngine.generate(self, *args, **kwargs)

    class PacedTarget(ToyEngine):
        async def generate(self, *args, **kwargs):
            await asyncio.sleep(0.01)
            return await super().generate(*args, **kwargs)

    draft = SlowFirstCall(0.15)
    policy = SpeculationPolicy(4, 0.0, adaptive=False)  # the first round plain, then the background prefill

    async def collect():
        return [r async for r in speculative_decode(
            [1, 2], 60, draft=draft, target=PacedTarget(), policy=policy, sampling=GREEDY, end_ids=(999,),
            draft_timeout=0.05)]

    rounds = asyncio.run(collect())
    plain, _ = decode([1, 2], 60, ToyEngine(), ToyEngine(), draft_timeout=None, window=0)
    assert [t for r in rounds for t in r.tokens] == [t for r in plain for t in r.tokens]
    assert draft.calls[0] == (1, 0)  # the prefill, which outlived the deadline three times over
    assert policy.mode is not Mode.DRAFT_FAILED and sum(r.drafted for r in rounds) > 0


def test_a_late_draft_that_then_fails_is_not_reported_as_never_retrieved(caplog):
    class SlowFailing(SlowDraft):
        async def generate(self, *args, **kwargs):
            await asyncio.sleep(self.delay)
            raise RuntimeError("boom")

    with caplog.at_level("INFO"):
        rounds, policy = decode([1], 6, SlowFailing(0.1), ToyEngine(), draft_timeout=0.02)
    assert len([t for r in rounds for t in r.tokens]) == 6 and policy.mode is Mode.DRAFT_FAILED
    assert "late draft call failed after its deadline: boom" in caplog.text
    assert "never retrieved" not in caplog.text


# -- generation: cancellation, prompt-size guard, metrics ---------------------


def tiny_codec() -> Codec:
    """A word-level tokenizer over a handful of words (ids 0..5), eos 5."""
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "[UNK]": 4, "</s>": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return Codec(tokenizer, SpecialTokens.from_json(json.dumps({"eos_token_ids": [5], "pad_token_id": 5})))


def small_vocab_logits(context):
    logits = toy_logits(context)[:6].copy()
    logits[5] = -1e9  # never end
    return logits


def request(prompt="a b c", max_tokens=30, window=3):
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, speculation_window=window, sampling=GREEDY,
                             adaptive_window=False)


def test_codec_reports_its_longest_token():
    assert tiny_codec().max_token_bytes == len("[UNK]")


def test_cancellation_stops_generation_after_the_current_round():
    target, draft = ToyEngine(small_vocab_logits), ToyEngine(small_vocab_logits)
    asked = []

    def cancelled():
        asked.append(len(target.calls))
        return len(target.calls) >= 2  # the client goes away during round two

    async def collect():
        return [c async for c in generate_text(request(), tiny_codec(), draft=draft, target=target,
                                               settings=CoordinatorSettings(), cancelled=cancelled)]

    with pytest.raises(RequestCancelled):
        asyncio.run(collect())
    assert len(target.calls) == 2  # no engine call after the round in which it was cancelled
    assert asked == [1, 2]


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing():
    settings = CoordinatorSettings(max_context_tokens=16, default_max_tokens=4, max_tokens_limit=8)
    codec = tiny_codec()
    prompt = "a" * (16 * codec.max_token_bytes + 1)

    async def collect():
        return [c async for c in generate_text(request(prompt, 4), codec, draft=ToyEngine(), target=ToyEngine(),
                                               settings=settings)]

    with pytest.raises(InputError, match=r"text_input is 81 bytes; at most 80 bytes can fit the context limit of 16"):
        asyncio.run(collect())


def test_draft_timeout_is_counted_as_a_draft_failure_in_the_metrics():
    instruments = {}

    def make(spec):
        return instruments.setdefault(spec, FakeInstrument())

    recorder = MetricsRecorder(make)
    metrics = recorder.start_request()
    settings = CoordinatorSettings(draft_timeout_seconds=0.02)
    # The draft's prompt prefill (no deadline) runs behind the target's first
    # rounds, paced so that it ends in time for a proposal, which is late.
    target = SlowDraft(0.01)
    target.logits_fn = small_vocab_logits
    draft = SlowDraft(0.2)
    draft.logits_fn = small_vocab_logits

    async def collect():
        chunks = [c async for c in generate_text(request(max_tokens=64), tiny_codec(), draft=draft, target=target,
                                                 settings=settings, metrics=metrics)]
        await asyncio.sleep(0.3)
        return chunks

    chunks = asyncio.run(collect())
    metrics.finish("success")
    assert chunks[-1].final and chunks[-1].stats.completion_tokens == 64
    assert "did not answer within 0.02 s" in chunks[-1].stats.fallback_reason
    assert instruments[DRAFT_FAILURES].total == 1
    assert instruments[REQUESTS["success"]].total == 1


def test_the_load_governors_clock_stops_for_a_prompts_prefill_and_starts_again_however_the_request_ends():
    """The first round carries the prompt's prefill: the governor's epoch clock
    stops from the request's arrival to its first token, and starts again
    when a request fails before that token too (else it would stay stopped)."""
    governor = LoadGovernor()
    seen = []

    class Watched(ToyEngine):
        """Notes whether a prefill is running as each call starts (a stream runs through generate)."""

        streaming = False

        async def generate(self, *args, **kwargs):
            if not self.streaming:
                seen.append(governor._prefills)
            return await super().generate(*args, **kwargs)

        async def stream(self, *args, **kwargs):
            seen.append(governor._prefills)
            self.streaming = True
            try:
                async for chunk in super().stream(*args, **kwargs):
                    yield chunk
            finally:
                self.streaming = False

    async def collect(target):
        return [c async for c in generate_text(request(max_tokens=6), tiny_codec(), draft=ToyEngine(small_vocab_logits),
                                               target=target, settings=CoordinatorSettings(), governor=governor)]

    asyncio.run(collect(Watched(small_vocab_logits)))
    assert seen[0] == 1 and set(seen[1:]) == {0} and len(seen) > 1  # prefilling during the first call only
    failing = Watched(small_vocab_logits)
    failing.fail_with = RuntimeError("target: stub process is not healthy")
    with pytest.raises(RuntimeError):
        asyncio.run(collect(failing))
    assert governor._prefills == 0 and governor._resumed is not None
