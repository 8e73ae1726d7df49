"""The CPU engine on a tiny random Qwen2 model: contract semantics and KV reuse."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from coordinator.cpu_engine.engine import CausalLMEngine, EngineRequest, EngineRequestError, resolve_dtype  # noqa: E402
from coordinator.sampling import SamplingParams  # noqa: E402
from tests.tiny_models import write_tiny_qwen2  # noqa: E402

PROMPT = np.array([3, 14, 15, 9, 26, 5], dtype=np.int32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"))


def engine(model_dir, cached=4, context=128):
    return CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_cached_sequences=cached,
                          max_context_tokens=context)


def test_generation_with_prefix_reuse_equals_generation_from_scratch(model_dir):
    cold, warm = engine(model_dir, cached=0), engine(model_dir)
    sequence = list(PROMPT)
    for _ in range(4):  # rounds of a sequence, each resending the whole context
        expected = cold.run(EngineRequest(np.array(sequence), 3)).tokens
        result = warm.run(EngineRequest(np.array(sequence), 3))
        assert result.tokens == expected
        sequence += expected
    assert result.reused_tokens == len(sequence) - 3 - 1  # everything but the newest tokens came from the cache


def test_verification_returns_accepted_prefix_plus_one_target_token(model_dir):
    e = engine(model_dir)
    greedy = e.run(EngineRequest(PROMPT, 6)).tokens
    all_good = e.run(EngineRequest(PROMPT, 5, draft_tokens=np.array(greedy[:4])))
    assert all_good.tokens == greedy[:5]  # 4 accepted + bonus
    wrong = [greedy[0], greedy[1], (greedy[2] + 1) % 64, greedy[3]]
    partial = e.run(EngineRequest(PROMPT, 5, draft_tokens=np.array(wrong)))
    assert partial.tokens == greedy[:3]  # 2 accepted + the target's own third token
    # the cache after a partial acceptance is still right for the next round
    follow = e.run(EngineRequest(np.concatenate([PROMPT, partial.tokens]), 3)).tokens
    assert follow == greedy[3:6]


def test_generation_logits_and_draft_logits_rejection_path(model_dir):
    e = engine(model_dir)
    sampling = SamplingParams(temperature=1.0, seed=5)
    draft = e.run(EngineRequest(PROMPT, 3, sampling=sampling, return_logits=True))
    assert draft.logits.shape == (3, 64)
    verified = e.run(EngineRequest(PROMPT, 4, sampling=sampling, draft_tokens=np.array(draft.tokens),
                                   draft_logits=draft.logits, return_logits=True))
    # same model as draft and target: p == q, so every draft token is accepted
    assert verified.tokens[:3] == draft.tokens and len(verified.tokens) == 4
    assert verified.logits.shape == (4, 64)


def test_seeded_sampling_is_reproducible(model_dir):
    e = engine(model_dir)
    sampling = SamplingParams(temperature=1.0, seed=11)
    assert e.run(EngineRequest(PROMPT, 8, sampling=sampling)).tokens == e.run(
        EngineRequest(PROMPT, 8, sampling=sampling)).tokens


def test_stops_at_end_id(model_dir):
    e = engine(model_dir)
    greedy = e.run(EngineRequest(PROMPT, 6)).tokens
    assert e.run(EngineRequest(PROMPT, 6, end_id=greedy[2])).tokens == greedy[: greedy.index(greedy[2]) + 1]


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        (dict(input_ids=np.array([], dtype=np.int32), max_new_tokens=1), "input_ids is empty"),
        (dict(input_ids=PROMPT, max_new_tokens=0), "request_output_len must be at least 1"),
        (dict(input_ids=np.array([64]), max_new_tokens=1), "token ids must be in [0, 64)"),
        (dict(input_ids=np.arange(60) % 64, max_new_tokens=10), "exceeds max_context_tokens 64"),
        (dict(input_ids=PROMPT, max_new_tokens=3, draft_tokens=np.array([1, 2]),
              draft_logits=np.zeros((3, 64))), "draft_logits must have shape [2, 64]"),
    ],
)
def test_limits_are_enforced_with_named_fields(model_dir, request_kwargs, message):
    e = engine(model_dir, context=64)
    with pytest.raises(EngineRequestError) as error:
        e.run(EngineRequest(**request_kwargs))
    assert message in str(error.value)


def test_cache_pool_is_bounded(model_dir):
    e = engine(model_dir, cached=2)
    for start in range(5):
        e.run(EngineRequest(np.array([start + 1, 7, 8]), 2))
    assert len(e.pool) == 2


def test_auto_dtype_follows_native_bf16_support():
    assert resolve_dtype("auto", "flags\t: fpu avx2 avx512f amx_bf16 amx_tile") == "bfloat16"
    assert resolve_dtype("auto", "flags\t: fpu avx2 fma") == "float32"
    assert resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("int4")


@pytest.mark.parametrize("rows", [0, 4, 8])
def test_verification_matches_plain_decoding_with_and_without_fixed_rows(model_dir, rows):
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, decode_rows=rows)
    plain = e.run(EngineRequest(PROMPT, 10, return_logits=True))
    # verify the plain tokens 6 at a time (more than 4 rows: two padded blocks)
    verified = e.run(EngineRequest(PROMPT, 7, draft_tokens=np.array(plain.tokens[:6]), return_logits=True))
    assert verified.tokens == plain.tokens[:7]
    if rows:  # fixed-shape forwards: bitwise-equal logits however the tokens were batched
        assert np.array_equal(verified.logits, plain.logits[:7])
