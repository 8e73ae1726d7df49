"""The traffic split (settings.speculation_ab_fraction): arms by a hash of the
request key alone, control decoding plainly, each response and every latency
and throughput metric naming its arm. At the unit level: the session server
keeps the split off, since a split would change what every other server test's
requests decode (docs/testing.md)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from coordinator.decoding.generation import generate_text
from coordinator.request import api
from coordinator.request.parse import ARMS, CONTROL, NO_ARM, SPECULATIVE, InputError, ab_arm, parse_request
from coordinator.response import metrics as specs
from coordinator.response.metrics import MetricsRecorder
from coordinator.settings import CoordinatorSettings, SettingsError
from frontend.requests import completion_request
from tests.fakes import ToyEngine
from tests.unit.test_metrics import Clock, Fake
from tests.unit.test_reliability_core import small_vocab_logits, tiny_codec

SPLIT = CoordinatorSettings(speculation_ab_fraction=0.5)


def parse(settings=SPLIT, **inputs):
    raw = {"text_input": np.array([b"a b c"], dtype=np.object_)}
    for name, value in inputs.items():
        if isinstance(value, str):
            raw[name] = np.array([value.encode()], dtype=np.object_)
        else:
            raw[name] = np.array([value], dtype=np.int32)
    return parse_request(raw, settings, new_seed=lambda: 7)


def test_the_fraction_is_a_setting_with_an_env_override_and_is_refused_outside_0_to_1():
    assert CoordinatorSettings().speculation_ab_fraction == 0.0
    settings = CoordinatorSettings.from_parameters({}, environ={"SPECDEC_AB_FRACTION": "0.25"})
    assert settings.speculation_ab_fraction == 0.25
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(SettingsError, match="speculation_ab_fraction"):
            CoordinatorSettings.from_parameters({}, environ={"SPECDEC_AB_FRACTION": bad})
    with pytest.raises(SettingsError, match="speculation_ab_fraction"):
        CoordinatorSettings.from_parameters({"speculation_ab_fraction": "2"}, environ={})


def test_no_split_means_no_arm_even_with_a_key():
    request = parse(CoordinatorSettings(), ab_key="user-1")
    assert request.arm == NO_ARM and request.speculation_window == CoordinatorSettings().speculation_window


def test_32_distinct_keys_split_within_binomial_noise_and_each_key_keeps_its_arm():
    keys = [f"user-{i}" for i in range(32)]
    arms = [parse(ab_key=key).arm for key in keys]
    control = arms.count(CONTROL)
    assert set(arms) == {CONTROL, SPECULATIVE}
    assert abs(control - 16) <= 3 * math.sqrt(32 * 0.25)  # within 3 sigma of half
    for key, arm in zip(keys, arms):
        assert {parse(ab_key=key).arm for _ in range(3)} == {arm}  # the same key, the same arm
        assert ab_arm(key.encode(), 0.5) == arm  # a hash of the key alone: any replica, any restart


def test_the_hash_is_fixed_across_processes():
    # SHA-256, not Python's salted hash(): these arms hold on every replica.
    assert [ab_arm(f"user-{i}".encode(), 0.5) for i in range(6)] == [
        ab_arm(f"user-{i}".encode(), 0.5) for i in range(6)]
    point = int.from_bytes(__import__("hashlib").sha256(b"user-0").digest()[:8], "big") / 2.0**64
    assert ab_arm(b"user-0", point + 1e-9) == CONTROL and ab_arm(b"user-0", max(point - 1e-9, 0)) == SPECULATIVE


def test_fractions_0_and_1_put_everyone_in_one_arm():
    everyone = CoordinatorSettings(speculation_ab_fraction=1.0)
    assert {parse(everyone, ab_key=f"k{i}").arm for i in range(20)} == {CONTROL}
    assert {ab_arm(f"k{i}".encode(), 0.0) for i in range(20)} == {SPECULATIVE}


def test_control_decodes_plainly_and_speculative_keeps_the_servers_defaults():
    arms = {parse(ab_key=f"user-{i}").arm: parse(ab_key=f"user-{i}") for i in range(32)}
    assert arms[CONTROL].speculation_window == 0
    assert arms[SPECULATIVE].speculation_window == SPLIT.speculation_window
    assert arms[SPECULATIVE].adaptive_window == SPLIT.adaptive_window


def test_a_request_that_sets_its_window_is_not_reassigned():
    for i in range(16):
        request = parse(ab_key=f"user-{i}", speculation_window=3)
        assert request.arm == NO_ARM and request.speculation_window == 3


def test_requests_without_a_key_get_a_random_arm_in_proportion():
    arms = [parse(CoordinatorSettings(speculation_ab_fraction=0.3)).arm for _ in range(2000)]
    assert abs(arms.count(CONTROL) / 2000 - 0.3) < 0.05
    assert parse(ab_key="").arm in (CONTROL, SPECULATIVE)  # an empty key: random too


def test_an_oversized_key_is_refused_naming_the_input():
    with pytest.raises(InputError, match="ab_key"):
        parse(ab_key="x" * 2000)


def test_the_openai_user_is_the_key():
    generation = completion_request({"model": "coordinator", "prompt": "hi", "user": "u-42"}, 16)
    assert generation.coordinator_inputs()["ab_key"] == "u-42"


def test_the_contract_names_the_input_and_the_arm_output():
    assert "ab_key" in api.INPUT_NAMES
    assert "speculation_arm" in {spec.name for spec in api.STATISTICS}
    stats = api.Statistics(arm=CONTROL)
    assert stats.outputs()["speculation_arm"][0] == b"control"
    read = api.Statistics()
    read.read(stats.outputs().get)
    assert read.arm == CONTROL
    assert specs.ARMS == ARMS


def run(request, metrics=None):
    async def collect():
        return [c async for c in generate_text(request, tiny_codec(), draft=ToyEngine(small_vocab_logits),
                                               target=ToyEngine(small_vocab_logits), settings=SPLIT,
                                               metrics=metrics)]
    return asyncio.run(collect())


def greedy(i):
    raw = {"text_input": np.array([b"a b c"], dtype=np.object_), "max_tokens": np.array([24], dtype=np.int32),
           "ab_key": np.array([f"user-{i}".encode()], dtype=np.object_)}
    return parse_request(raw, SPLIT, new_seed=lambda: 7)


def test_greedy_texts_are_identical_across_arms_and_responses_name_their_arm():
    by_arm = {}
    for i in range(32):
        request = greedy(i)
        by_arm.setdefault(request.arm, request)
    assert set(by_arm) == {CONTROL, SPECULATIVE}
    texts = {}
    for arm, request in by_arm.items():
        chunks = run(request)
        final = chunks[-1]
        assert final.final and final.stats.arm == arm
        texts[arm] = "".join(c.text for c in chunks)
        if arm == CONTROL:
            assert final.stats.draft_tokens == 0 and final.stats.speculative_rounds == 0
        else:
            assert final.stats.draft_tokens > 0
    assert texts[CONTROL] == texts[SPECULATIVE]


def test_latency_and_throughput_metrics_carry_the_arm():
    made, clock = {}, Clock()
    recorder = MetricsRecorder(lambda spec: made.setdefault(spec, Fake()), clock=clock)
    for i in range(32):
        request = greedy(i)
        metrics = recorder.start_request()
        run(request, metrics)
        clock.now += 2.0
        metrics.finish("success")
    counts = {arm: made[specs.REQUESTS_BY_ARM[("success", arm)]].total for arm in ARMS}
    assert counts[CONTROL] + counts[SPECULATIVE] == 32 and counts[NO_ARM] == 0
    assert min(counts[CONTROL], counts[SPECULATIVE]) >= 16 - 3 * math.sqrt(8)
    for arm in (CONTROL, SPECULATIVE):
        assert len(made[specs.TTFT_BY_ARM[arm]].observed) == counts[arm]
        assert len(made[specs.E2E_BY_ARM[arm]].observed) == counts[arm]
        assert made[specs.TOKENS_PER_SECOND_BY_ARM[arm]].observed[0] == pytest.approx(24 / 2.0)
        assert made[specs.ITL_BY_ARM[arm]].observed
    assert not made[specs.TTFT_BY_ARM[NO_ARM]].observed


def test_every_latency_metric_has_an_arm_label_and_fine_buckets():
    for family in (specs.TTFT_BY_ARM, specs.ITL_BY_ARM, specs.E2E_BY_ARM, specs.TOKENS_PER_SECOND_BY_ARM):
        assert set(family) == set(ARMS)
        for arm, spec in family.items():
            assert dict(spec.labels)["arm"] == arm
            ratios = [b / a for a, b in zip(spec.buckets, spec.buckets[1:])]
            assert max(ratios) < 1.25  # a quantile interpolated in its bucket is within ~12 %
    assert specs.FINE_LATENCY_BUCKETS[0] <= 0.001 and specs.FINE_LATENCY_BUCKETS[-1] >= 60
    assert {dict(s.labels)["arm"] for s in specs.all_specs() if s.name == "specdec_requests_total"} == set(ARMS)
