"""The CPU engine behaves like the tensorrtllm backend where the coordinator
can tell the difference, and the coordinator is lossless on those terms.

The CPU engine is the only stand-in for TensorRT-LLM that the tests run; each
test below names the NVIDIA source (TensorRT-LLM 0.17 / tensorrtllm_backend
v0.17.0) whose behaviour it mirrors. The last tests run the real coordinator
loop over two *different* tiny models and check the distribution of the
emitted tokens against the target's exact distribution.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from coordinator.drafters import draft_model as drafters_module  # noqa: E402
from cpu_engine.engine import CausalLMEngine, EngineRequest  # noqa: E402
from coordinator.decoding.loop import speculative_decode  # noqa: E402
from coordinator.policy.speculation import SpeculationPolicy  # noqa: E402
from coordinator.sampling.params import SamplingParams  # noqa: E402
from coordinator.sampling.maths import processed_probs
from sim_engine.engine import SimEngine  # noqa: E402
from sim_engine.lm import SyntheticLM  # noqa: E402
from sim_engine.presets import StepTime  # noqa: E402
from tests.engine_adapter import LocalEngine  # noqa: E402
from tests.stats import gof_pvalue  # noqa: E402
from tests.tiny_models import write_tiny_qwen2  # noqa: E402

ALPHA = 1e-4
VOCAB = 16
PROMPT = np.array([3, 5, 7, 11], dtype=np.int32)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """Two different tiny models with peaked, context-dependent distributions."""
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_qwen2(root / "target", vocab_size=VOCAB, seed=1, logit_scale=20.0)
    draft = write_tiny_qwen2(root / "draft", vocab_size=VOCAB, seed=2, logit_scale=20.0)
    return target, draft


@pytest.fixture(scope="module", params=["cpu", "sim"])
def engines(request, pair_dirs):
    """The CPU engine over two tiny models, and the sim profile's engine over
    its synthetic LM (sim_engine/, no sleeps): the same semantics tests for both."""
    if request.param == "cpu":
        return (CausalLMEngine(str(pair_dirs[0]), dtype="float32", num_threads=1),
                CausalLMEngine(str(pair_dirs[1]), dtype="float32", num_threads=1))
    step = StepTime(0.0, 0.0)
    return (SimEngine(SyntheticLM(VOCAB, "target"), step, sleep=False),
            SimEngine(SyntheticLM(VOCAB, "draft", agreement=0.6), step, sleep=False))


@pytest.fixture(scope="module")
def target(engines):
    return engines[0]


@pytest.fixture(scope="module")
def draft(engines):
    return engines[1]


def greedy(engine, prompt=PROMPT, n=8):
    return engine.run(EngineRequest(prompt, n)).tokens


# ---------------------------------------------------------------------------
# the end token


def test_the_end_token_is_neither_returned_nor_counted(target):
    """TensorRT-LLM's sampling kernels do not advance the sequence length when
    the end id is drawn (cpp/tensorrt_llm/kernels/samplingTopKKernels.cu,
    topKStage2Sampling, and samplingTopPKernels.cu: "Do not increase seq len
    when EOS is generated"), and the backend builds output_ids and
    sequence_length from the executor's tokens
    (inflight_batcher_llm/src/model_instance_state.cc, fillTritonResponse)."""
    tokens = greedy(target)
    end = tokens[3]
    first = tokens.index(end)
    result = target.run(EngineRequest(PROMPT, 8, end_id=end))
    assert result.tokens == tokens[:first] and end not in result.tokens


def test_a_call_whose_first_new_token_is_the_end_returns_no_token(target):
    """Same kernels: zero new tokens. NVIDIA's BLS loop detects this as "no
    new tokens" (all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py,
    _spec_generate). The KV cache stays usable for the next call."""
    tokens = greedy(target)
    result = target.run(EngineRequest(PROMPT, 5, end_id=tokens[0], return_logits=True))
    assert result.tokens == [] and result.logits.shape == (0, VOCAB)
    assert greedy(target) == tokens


def test_verification_that_meets_the_end_returns_the_tokens_before_it(target):
    """Accepted drafts are forwarded up to the end token, which is not counted
    (cpp/tensorrt_llm/kernels/speculativeDecoding/externalDraftTokensKernels.cu,
    forwardAcceptedTokensKernel: the same "Do not increase seq len" rule)."""
    tokens = greedy(target)
    end = tokens[2]
    cut = tokens.index(end)
    # the target's own (bonus) token is the end: only the accepted drafts come back
    result = target.run(EngineRequest(PROMPT, cut + 1, end_id=end, draft_tokens=np.array(tokens[:cut])))
    assert result.tokens == tokens[:cut]
    # a drafted end token that the target accepts ends the sequence there too
    result = target.run(EngineRequest(PROMPT, 5, end_id=end, draft_tokens=np.array(tokens[:4])))
    assert result.tokens == tokens[:cut]
    assert greedy(target) == tokens  # the cache kept only what was fed


def test_k_drafts_return_the_accepted_prefix_plus_one_and_the_call_ends(target):
    """A target request with draft tokens ends after its one verification step
    (cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp,
    updateRequests: "Terminate if request has finished or if it is speculative
    decoding target model"; the BLS asks for k + 1 tokens, decode.py:
    "Normally target should return 1 more token")."""
    tokens = greedy(target)
    wrong = [tokens[0], (tokens[1] + 1) % VOCAB, tokens[2]]
    assert target.run(EngineRequest(PROMPT, 4, draft_tokens=np.array(wrong))).tokens == tokens[:2]
    assert target.run(EngineRequest(PROMPT, 4, draft_tokens=np.array(tokens[:3]))).tokens == tokens[:4]


# ---------------------------------------------------------------------------
# random state


def test_each_calls_random_numbers_come_from_its_own_seed_alone(target):
    """Every new request seeds its curand state from its random_seed, the same
    way whatever its position (cpp/tensorrt_llm/kernels/decodingCommon.cu,
    curandInitialize: curand_init(randomSeed, 0, 0, ...), called from
    runtime/decodingLayerWorkspace.cpp, initializeDeviceCurandStates). So two
    calls with one seed draw the same numbers: at a temperature so high that
    every token is equally likely, the same seed picks the same tokens after
    different prompts, and different seeds do not."""
    flat = SamplingParams(temperature=1e9)
    other_prompt = np.array([9, 2], dtype=np.int32)
    picks = []
    for seed in range(20):
        params = SamplingParams(temperature=flat.temperature, seed=seed)
        here = target.run(EngineRequest(PROMPT, 3, sampling=params)).tokens
        there = target.run(EngineRequest(other_prompt, 3, sampling=params)).tokens
        assert here == there, seed
        picks.append(tuple(here))
    assert len(set(picks)) > 15


# ---------------------------------------------------------------------------
# draft logits


def test_draft_logits_are_read_by_a_plain_softmax(target):
    """ExternalDraftTokensLayer::acceptDraftTokens turns draft_logits into
    probabilities with a plain softmax (no temperature, top-k or top-p), and
    accepts with targetProb > u * draftProb
    (cpp/tensorrt_llm/layers/externalDraftTokensLayer.cpp,
    kernels/speculativeDecoding/externalDraftTokensKernels.cu,
    acceptDraftTokensKernel). At temperature 0.5 the acceptance rate of one
    draft token must be min(1, p/q) with q = softmax(draft_logits), not with
    the draft logits divided by the temperature."""
    params = SamplingParams(temperature=0.5)
    row = target.run(EngineRequest(PROMPT, 1, return_logits=True)).logits[0]
    p = processed_probs(row, params)
    token = int(np.argsort(-p)[1])  # a likely but not certain token
    q = np.full(VOCAB, 0.0)
    q[token] = min(0.95, 2.0 * p[token])
    others = [t for t in range(VOCAB) if t != token]
    q[others] = (1.0 - q[token]) / len(others)
    with np.errstate(divide="ignore"):
        draft_logits = np.log(q).astype(np.float32)[None, :]
    expected = min(1.0, p[token] / q[token])
    misread_q = processed_probs(draft_logits[0], params)  # had the temperature been applied to them
    misread = min(1.0, p[token] / misread_q[token])
    n = 1500
    bound = math.sqrt(math.log(2 / ALPHA) / (2 * n))  # Hoeffding, false alarms at ALPHA
    assert abs(expected - misread) > 2 * bound, "the test must tell the two readings apart"
    accepted = 0
    for seed in range(n):
        result = target.run(EngineRequest(PROMPT, 2, sampling=SamplingParams(temperature=0.5, seed=seed),
                                          draft_tokens=np.array([token]), draft_logits=draft_logits))
        accepted += len(result.tokens) == 2 and result.tokens[0] == token
    assert abs(accepted / n - expected) < bound


# ---------------------------------------------------------------------------
# the coordinator over two different models: lossless on these terms


def exact_first_two(engine, params):
    """The target's exact distribution of the first two tokens after PROMPT, [VOCAB, VOCAB]."""
    first = processed_probs(engine.run(EngineRequest(PROMPT, 1, return_logits=True)).logits[0], params)
    joint = np.zeros((VOCAB, VOCAB))
    for token in np.flatnonzero(first):
        row = engine.run(EngineRequest(np.append(PROMPT, token), 1, return_logits=True)).logits[0]
        joint[token] = first[token] * processed_probs(row, params)
    return joint


def sample_first_two(target, draft, params, window, n, seed0=0):
    async def one(seed):
        policy = SpeculationPolicy(window, 0.0, adaptive=False, first_round_plain=False)
        tokens, drafted = [], 0
        async for round_ in speculative_decode(
            PROMPT, 2 if window == 0 else 4, draft=LocalEngine(draft), target=LocalEngine(target), policy=policy,
            sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed), end_ids=(),
        ):
            tokens += round_.tokens
            drafted += round_.drafted
        return tokens[:2], drafted

    async def run_all():
        return [await one(seed0 + i) for i in range(n)]

    results = asyncio.run(run_all())
    samples = np.array([tokens for tokens, _ in results])
    return samples, sum(d for _, d in results)


def pvalues(samples, joint):
    first = gof_pvalue(np.bincount(samples[:, 0], minlength=VOCAB), joint.sum(axis=1))
    both = gof_pvalue(np.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB), joint)
    return first, both


N_PAIR = 1200


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0)],
                         ids=["temperature_0.7_top_k_5", "temperature_1"])
def test_speculative_and_plain_sampling_follow_the_targets_distribution(target, draft, params):
    """Two different models, the draft proposing 3 tokens from the first token
    on: the first two emitted tokens follow the target's exact distribution,
    with and without speculation, and the same seed gives the same tokens."""
    joint = exact_first_two(target, params)
    speculative, drafted = sample_first_two(target, draft, params, window=3, n=N_PAIR)
    assert drafted >= N_PAIR * 3  # every request drafted
    plain, _ = sample_first_two(target, draft, params, window=0, n=N_PAIR)
    assert min(pvalues(speculative, joint)) >= ALPHA, pvalues(speculative, joint)
    assert min(pvalues(plain, joint)) >= ALPHA, pvalues(plain, joint)
    again, _ = sample_first_two(target, draft, params, window=3, n=20)
    assert np.array_equal(again, speculative[:20])


def test_power_raw_draft_logits_under_a_temperature_are_detected(target, draft, monkeypatch):
    """What the coordinator sent before: the draft's raw logits, which the
    backend reads with a plain softmax, so at temperature 0.7 its q is not
    what the draft sampled from. The same check must reject that."""
    params = SamplingParams(temperature=0.7, top_k=5)
    monkeypatch.setattr(drafters_module, "draft_log_probs", lambda logits, draft_params: np.asarray(logits, np.float32))
    joint = exact_first_two(target, params)
    speculative, _ = sample_first_two(target, draft, params, window=3, n=N_PAIR)
    assert min(pvalues(speculative, joint)) < ALPHA
