"""Speculative sampling is lossless: statistical tests of the whole pipeline.

The pipeline per round is the production code end to end: the draft engine
samples k tokens (``calls.generate``, with its call's seed
``call_seed(seed, position, "draft")``), the coordinator turns the draft's
raw logits into log q (``draft_log_probs``: q processed with the draft's own
sampling settings), and the target engine verifies
(``calls.verify``: q = softmax(draft_logits), as TensorRT-LLM's
ExternalDraftTokensLayer reads them; its own call seed). Rounds repeat until
enough tokens are out. Draft and target are small first-order Markov
"models" (the logits of a position depend on the previous token), so the
target's distribution over the first m emitted tokens is known exactly.

Two sets of checks:

* breadth (N = 2,000 requests, first two tokens): many target/draft pairs,
  window sizes and sampling settings;
* power (N_POWER = 100,000 requests, k = 4, first four tokens, so tokens
  beyond the second come from inside one verification): each position's
  marginal and each adjacent pair against the exact distribution. At this N
  the chi-square check rejects a total-variation error of 0.01 (shown by
  ``test_the_power_check_detects_a_total_variation_error_of_0_01``), and
  three subtly wrong verifiers are each rejected (named power tests).

A check rejects when its p-value < ALPHA = 1e-4 (false-alarm rate per check).
Request seeds are fixed (request i uses seed i), so every test is
deterministic: a pass stays a pass and the suite is never flaky.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from trtllm_emulation import calls
from coordinator.sampling import maths as sampling
from coordinator.sampling.params import SamplingParams, call_seed
from coordinator.sampling.maths import call_rng, draft_log_probs, inverse_cdf, processed_probs, select_token, softmax
from coordinator.verification.rules import verify_by_rejection
from tests.stats import chi2_sf, gof_pvalue, total_variation

ALPHA = 1e-4
PROMPT = 7  # absolute position of the first generated token
N = 2000  # requests per breadth test
N_POWER = 100_000  # requests per power test


def test_chi2_sf_matches_tabulated_critical_values():
    for x, df, alpha in [(3.841, 1, 0.05), (6.635, 1, 0.01), (23.513, 4, 1e-4), (11.070, 5, 0.05),
                         (18.307, 10, 0.05), (59.703, 30, 1e-3), (24.322, 7, 1e-3)]:
        assert chi2_sf(x, df) == pytest.approx(alpha, rel=2e-3)


def test_gof_pvalue_accepts_exact_samples_and_rejects_a_shifted_distribution():
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    assert gof_pvalue(np.bincount(rng.choice(5, 5000, p=p), minlength=5), p) > ALPHA
    shifted = np.array([0.45, 0.33, 0.16, 0.06, 0.0])
    assert gof_pvalue(np.bincount(rng.choice(5, 5000, p=shifted), minlength=5), p) < ALPHA
    assert gof_pvalue(np.array([10, 0, 0, 0, 1]), p) == 0.0  # impossible token
    # small cells are pooled: here [0.05] joins the next smallest [0.15] (expected 2 + 6 = 8)
    tiny = np.array([0.5, 0.3, 0.15, 0.05])
    assert gof_pvalue(np.array([20, 12, 8, 0]), tiny) == pytest.approx(1.0)
    assert gof_pvalue(np.array([20, 12, 0, 8]), tiny) == pytest.approx(1.0)


# ---------------------------------------------------------------------------
# the pipeline


@pytest.fixture(scope="module", autouse=True)
def _memoised_probabilities():
    """Speed only: cache processed_probs (it ignores the seed) and softmax of the
    Markov models' few rows.

    Both are pure, so the cached values are exactly what the real functions
    return; the production functions look them up as module globals and run
    otherwise unchanged. Random numbers are not cached: every call draws from
    its own generator as in production.
    """
    real_probs, real_softmax = sampling.processed_probs, sampling.softmax
    cache: dict = {}

    def cached(kind, compute, logits, *args):
        array = np.asarray(logits)
        key = (kind, array.tobytes(), array.dtype.str, *args)
        value = cache.get(key)
        if value is None:
            value = compute(array, *args)
            value.flags.writeable = False  # a caller that writes into it would fail loudly
            cache[key] = value
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "processed_probs", lambda logits, params: cached(
            "p", lambda array, *settings: real_probs(array, SamplingParams(*settings)), logits,
            params.temperature, params.top_k, params.top_p))
        patch.setattr(sampling, "softmax", lambda logits: cached("s", real_softmax, logits))
        yield


class Model:
    """First-order Markov logits: row ``v`` predicts the token after ``v``; row ``vocab`` the first one."""

    def __init__(self, probs: np.ndarray):
        probs = np.asarray(probs, dtype=np.float64)
        self.vocab = probs.shape[1]
        assert probs.shape == (self.vocab + 1, self.vocab)
        with np.errstate(divide="ignore"):
            self.logits = np.where(probs > 0, np.log(probs), -np.inf)

    @property
    def start(self) -> int:
        return self.vocab

    def probs(self, params: SamplingParams) -> np.ndarray:
        return np.stack([processed_probs(row, params) for row in self.logits])

    def step(self, token: int) -> np.ndarray:
        return self.logits[token]


def speculate(target: Model, draft: Model, params: SamplingParams, k: int, *, n: int = N, tokens: int = 2,
              draft_params: SamplingParams | None = None, verify=calls.verify) -> np.ndarray:
    """The first ``tokens`` emitted tokens of requests with seeds 0..n-1, shape [n, tokens]."""
    draft_params = draft_params or params
    out = np.empty((n, tokens), dtype=np.int64)
    for seed in range(n):
        context: list[int] = []
        while len(context) < tokens:
            position = PROMPT + len(context)
            last = context[-1] if context else target.start
            drafted = calls.generate(
                draft.step, last, k, replace(draft_params, seed=call_seed(seed, position, "draft")), None
            )
            drafts = drafted.tokens
            log_q = draft_log_probs(np.stack(drafted.logits), draft_params)
            rows = target.logits[[last, *drafts]]
            call = verify(rows, drafts, log_q, k + 1, replace(params, seed=call_seed(seed, position, "target")), None)
            emitted = call.tokens
            assert 1 <= len(emitted) <= k + 1 and list(emitted[:-1]) == drafts[: len(emitted) - 1]
            context += list(emitted)
        out[seed] = context[:tokens]
    return out


def exact_joint(target: Model, params: SamplingParams, tokens: int) -> np.ndarray:
    """p(x1 | start) p(x2 | x1) ... as an array of shape [vocab] * tokens."""
    table = target.probs(params)
    joint = table[target.start]
    for _ in range(tokens - 1):
        joint = np.einsum("...a,ab->...ab", joint, table[: target.vocab])
    return joint


def checks(samples: np.ndarray, target: Model, params: SamplingParams) -> dict[str, tuple[float, float]]:
    """(p-value, TV) of each position's marginal and each adjacent pair against the exact distribution."""
    v, m = target.vocab, samples.shape[1]
    joint = exact_joint(target, params, m)
    results = {}
    for i in range(m):
        exact = joint.sum(axis=tuple(j for j in range(m) if j != i))
        counts = np.bincount(samples[:, i], minlength=v)
        results[f"token {i + 1}"] = (gof_pvalue(counts, exact), total_variation(counts, exact))
    for i in range(m - 1):
        exact = joint.sum(axis=tuple(j for j in range(m) if j not in (i, i + 1)))
        counts = np.bincount(samples[:, i] * v + samples[:, i + 1], minlength=v * v)
        results[f"tokens {i + 1}-{i + 2}"] = (gof_pvalue(counts, exact), total_variation(counts, exact))
    return results


def failed(results: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    return {name: r for name, r in results.items() if r[0] < ALPHA}


def assert_lossless(samples, target, params):
    bad = failed(checks(samples, target, params))
    assert not bad, f"not distributed as the target: {bad}"


def dirichlet_rows(rng, vocab: int, supports=None, concentration: float = 0.8) -> np.ndarray:
    """vocab + 1 random rows; ``supports(r)`` (a list of tokens) limits row r."""
    rows = np.zeros((vocab + 1, vocab))
    for r in range(vocab + 1):
        support = list(range(vocab)) if supports is None else list(supports(r))
        rows[r, support] = rng.dirichlet(np.full(len(support), concentration))
    return rows


def one_hot_rows(vocab: int, token_of_row) -> np.ndarray:
    return np.eye(vocab)[[token_of_row(r) for r in range(vocab + 1)]]


def _cases():
    rng = np.random.default_rng(20240601)
    v = 5
    random_target = dirichlet_rows(rng, v)
    return {
        "p_equals_q": (Model(random_target), Model(random_target)),
        "disjoint_supports": (Model(dirichlet_rows(rng, v, lambda r: [0, 1, 2])),
                              Model(dirichlet_rows(rng, v, lambda r: [3, 4]))),
        "one_hot_q": (Model(dirichlet_rows(rng, v)), Model(one_hot_rows(v, lambda r: (2 * r) % v))),
        # q = 0 where p > 0 (and q > 0 where p = 0)
        "q_zero_where_p_positive": (Model(dirichlet_rows(rng, v, lambda r: [1, 2, 3, 4])),
                                    Model(dirichlet_rows(rng, v, lambda r: [0, 1, 2]))),
        "one_hot_p": (Model(one_hot_rows(v, lambda r: (r + 1) % v)), Model(dirichlet_rows(rng, v))),
        "random": (Model(dirichlet_rows(rng, v, concentration=0.5)), Model(dirichlet_rows(rng, v, concentration=0.5))),
    }


CASES = _cases()
SAMPLED = SamplingParams(temperature=1.0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_first_and_first_two_tokens_follow_the_target(case, k):
    target, draft = CASES[case]
    assert_lossless(speculate(target, draft, SAMPLED, k), target, SAMPLED)


# (target params, draft params or None for the same)
PARAM_CASES = {
    "temperature_0.6": (SamplingParams(temperature=0.6), None),
    "temperature_0.7_top_k_3": (SamplingParams(temperature=0.7, top_k=3), None),
    "temperature_1.5_top_k_3": (SamplingParams(temperature=1.5, top_k=3), None),
    "top_p_0.75": (SamplingParams(temperature=1.0, top_p=0.75), None),
    "temperature_0.8_top_k_4_top_p_0.9": (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), None),
    "greedy_temperature_0": (SamplingParams(temperature=0.0), None),
    "greedy_top_k_1": (SamplingParams(temperature=1.3, top_k=1), None),
    # a separate draft sampling: q is what the draft really sampled from
    "draft_temperature_0.6": (SamplingParams(temperature=1.0), SamplingParams(temperature=0.6)),
    "draft_temperature_1.4_same_filters": (SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
                                           SamplingParams(temperature=1.4, top_k=4, top_p=0.9)),
    "draft_other_filters": (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=2)),
    "greedy_draft": (SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)),
    "greedy_target_sampled_draft": (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)),
}
_rng6 = np.random.default_rng(6)
TARGET6, DRAFT6 = Model(dirichlet_rows(_rng6, 6)), Model(dirichlet_rows(_rng6, 6))


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_sampling_params_stay_lossless(case):
    params, draft_params = PARAM_CASES[case]
    samples = speculate(TARGET6, DRAFT6, params, 3, draft_params=draft_params)
    assert_lossless(samples, TARGET6, params)


def test_vocabularies_of_4_and_8():
    rng = np.random.default_rng(48)
    for v in (4, 8):
        target, draft = Model(dirichlet_rows(rng, v)), Model(dirichlet_rows(rng, v))
        assert_lossless(speculate(target, draft, SAMPLED, 2), target, SAMPLED)


# ---------------------------------------------------------------------------
# power: N_POWER requests, k = 4, the first four tokens


POWER_K, POWER_TOKENS = 4, 4
_rng_power = np.random.default_rng(2024_11_30)
POWER_TARGET = Model(dirichlet_rows(_rng_power, 4, concentration=1.0))
POWER_DRAFT = Model(dirichlet_rows(_rng_power, 4, concentration=1.0))
POWER_PARAMS = {
    "temperature_1": (SamplingParams(temperature=1.0), None),
    "temperature_0.7_top_k_3_draft_temperature_1": (SamplingParams(temperature=0.7, top_k=3),
                                                    SamplingParams(temperature=1.0)),
}


def power_samples(verify=calls.verify, case="temperature_1"):
    params, draft_params = POWER_PARAMS[case]
    samples = speculate(POWER_TARGET, POWER_DRAFT, params, POWER_K, n=N_POWER, tokens=POWER_TOKENS,
                        draft_params=draft_params, verify=verify)
    return checks(samples, POWER_TARGET, params)


@pytest.mark.parametrize("case", list(POWER_PARAMS))
def test_the_first_four_tokens_follow_the_target_at_high_power(case):
    """The correct pipeline passes every check at N_POWER, its TV error within sampling noise."""
    results = power_samples(case=case)
    assert not failed(results), results
    assert max(tv for _, tv in results.values()) < 0.01


def test_the_power_check_detects_a_total_variation_error_of_0_01():
    """At N_POWER, moving 0.01 of probability between the two likeliest cells of
    any checked distribution (a TV error of exactly 0.01) is rejected, for
    every marginal and every adjacent pair of the power case, in each of 20
    independent multinomial draws."""
    params = POWER_PARAMS["temperature_1"][0]
    m, v = POWER_TOKENS, POWER_TARGET.vocab
    joint = exact_joint(POWER_TARGET, params, m)
    exact = [joint.sum(axis=tuple(j for j in range(m) if j != i)) for i in range(m)]
    exact += [joint.sum(axis=tuple(j for j in range(m) if j not in (i, i + 1))).reshape(-1) for i in range(m - 1)]
    rng = np.random.default_rng(7)
    for probs in exact:
        first, second = np.argsort(-probs)[:2]
        shifted = probs.copy()
        shifted[first] -= 0.01
        shifted[second] += 0.01
        assert total_variation(shifted, probs) == pytest.approx(0.01)
        for _ in range(20):
            counts = rng.multinomial(N_POWER, shifted)
            assert gof_pvalue(counts, probs) < ALPHA
    assert v ** 2 == len(exact[-1])


def wrong_verifier(name, doc, *, accept_scale=1.0, one_uniform=False, residual_q=1.0):
    """calls.verify with one subtle change: acceptance when
    u * q < accept_scale * p; one acceptance uniform for the whole round; or
    the correction drawn from max(p - residual_q * q, 0)."""

    def verify(target_logits, draft_tokens, draft_logits, max_new_tokens, params, end_id):
        rng = call_rng(params.seed)
        q_rows = [softmax(row) for row in draft_logits]
        shared = rng.random() if one_uniform else None
        emitted = []
        for i, token in enumerate(draft_tokens):
            p, q = processed_probs(target_logits[i], params), q_rows[i]
            u = shared if one_uniform else rng.random()
            if q[token] > 0 and u * q[token] < accept_scale * p[token]:
                emitted.append(int(token))
                continue
            residual = np.maximum(p - residual_q * q, 0.0)
            emitted.append(inverse_cdf(residual / residual.sum(), rng.random()))
            return calls.CallResult(emitted, [], len(emitted) - 1)
        emitted.append(select_token(target_logits[len(draft_tokens)], params, rng))
        return calls.CallResult(emitted, [], len(draft_tokens))

    verify.__name__, verify.__doc__ = name, doc
    return verify


verify_accepting_5_percent_too_often = wrong_verifier(
    "verify_accepting_5_percent_too_often", "Wrong: accepts with probability min(1, 1.05 p/q).", accept_scale=1.05)
verify_with_one_uniform_per_round = wrong_verifier(
    "verify_with_one_uniform_per_round",
    "Wrong: one acceptance uniform for the whole round (as when every call re-seeds the same stream).",
    one_uniform=True)
verify_with_residual_p_minus_0_9_q = wrong_verifier(
    "verify_with_residual_p_minus_0_9_q", "Wrong: the correction is sampled from max(p - 0.9 q, 0).",
    residual_q=0.9)


@pytest.mark.parametrize("wrong", [verify_accepting_5_percent_too_often, verify_with_one_uniform_per_round,
                                   verify_with_residual_p_minus_0_9_q])
def test_power_a_subtly_wrong_verifier_is_rejected(wrong):
    """Each of these biased verifiers passes casual testing; the power check must reject it."""
    results = power_samples(verify=wrong)
    assert failed(results), f"{wrong.__name__} was not detected: {results}"


# ---------------------------------------------------------------------------
# acceptance


def _one_round(target, draft, params, k, n):
    """(draft tokens, emitted tokens) of the first round for seeds 0..n-1."""
    rounds = []
    for seed in range(n):
        drafted = calls.generate(
            draft.step, target.start, k, replace(params, seed=call_seed(seed, PROMPT, "draft")), None
        )
        rows = target.logits[[target.start, *drafted.tokens]]
        log_q = draft_log_probs(np.stack(drafted.logits), params)
        call = calls.verify(rows, drafted.tokens, log_q, k + 1,
                                       replace(params, seed=call_seed(seed, PROMPT, "target")), None)
        rounds.append((drafted.tokens, call.tokens))
    return rounds


def test_equal_distributions_accept_every_draft():
    target, draft = CASES["p_equals_q"]
    for drafts, emitted in _one_round(target, draft, SAMPLED, 4, 500):
        assert emitted[:4] == drafts and len(emitted) == 5


def test_disjoint_supports_accept_no_draft():
    target, draft = CASES["disjoint_supports"]
    for drafts, emitted in _one_round(target, draft, SAMPLED, 4, 500):
        assert len(emitted) == 1 and emitted[0] != drafts[0] and emitted[0] in (0, 1, 2)


@pytest.mark.parametrize("case", ["random", "one_hot_q", "q_zero_where_p_positive"])
def test_acceptance_rate_is_one_minus_total_variation(case):
    target, draft = CASES[case]
    p = target.probs(SAMPLED)[target.start]
    q = draft.probs(SAMPLED)[draft.start]
    expected = float(np.minimum(p, q).sum())  # = 1 - TV(p, q)
    n = N
    rate = np.mean([len(emitted) == 2 for _, emitted in _one_round(target, draft, SAMPLED, 1, n)])
    # Hoeffding: P(|rate - expected| >= t) <= 2 exp(-2 n t^2) = ALPHA
    assert abs(rate - expected) < math.sqrt(math.log(2 / ALPHA) / (2 * n))


# ---------------------------------------------------------------------------
# what the coordinator sends: log q, read back by a plain softmax


@pytest.mark.parametrize(
    "draft_params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.6, top_k=5),
        SamplingParams(temperature=0.3, top_k=6, top_p=0.8),
        SamplingParams(temperature=0.05, top_p=0.95),
        SamplingParams(temperature=0.0),  # greedy draft: one-hot q
        SamplingParams(temperature=2.0, top_k=1),
    ],
)
def test_a_plain_softmax_of_the_sent_log_probs_is_the_drafts_distribution(draft_params):
    """TensorRT-LLM's ExternalDraftTokensLayer applies no temperature or filter to
    draft_logits: softmax(what the coordinator sends) must be q itself."""
    rng = np.random.default_rng(3)
    for vocab in (4, 8, 50, 151_936):
        logits = rng.normal(0.0, 3.0, size=(3, vocab)).astype(np.float32)
        logits[0, 1] = -np.inf
        sent = draft_log_probs(logits, draft_params)
        assert sent.dtype == np.float32 and sent.shape == logits.shape
        for row, draft_row in zip(sent, logits):
            q = processed_probs(draft_row, draft_params)
            assert np.all(np.isneginf(row[q == 0.0])) and np.isfinite(row[q > 0.0]).all()
            assert np.allclose(softmax(row), q, atol=1e-6, rtol=0)


def test_token_log_prob_is_the_full_softmax_after_temperature():
    """samplingTopKKernels.cu: output_log_probs are not renormalized over the top-k."""
    from coordinator.sampling.maths import token_log_prob

    logits = np.array([1.0, 3.0, -2.0, 0.5])
    params = SamplingParams(temperature=0.5, top_k=2)
    scaled = logits / 0.5
    expected = scaled - np.log(np.exp(scaled).sum())
    assert [token_log_prob(logits, params, t) for t in range(4)] == pytest.approx(list(expected))
    greedy = logits - np.log(np.exp(logits).sum())
    assert token_log_prob(logits, SamplingParams(), 1) == pytest.approx(greedy[1])


def test_draft_log_probs_refuses_a_wrong_shape():
    with pytest.raises(ValueError, match=r"\[k, vocab\]"):
        draft_log_probs(np.zeros(5), SAMPLED)


# ---------------------------------------------------------------------------
# -inf, very negative, +inf and NaN logits (each of these gave NaN before)


def test_processed_probs_of_all_minus_inf_is_uniform_not_nan():
    probs = processed_probs(np.full(4, -np.inf), SamplingParams(temperature=0.7, top_k=2))
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    assert np.isfinite(softmax(np.full(4, -np.inf))).all()


def test_processed_probs_plus_inf_takes_all_the_mass():
    assert processed_probs(np.array([0.0, np.inf, 1.0, np.inf]), SAMPLED).tolist() == [0.0, 0.5, 0.0, 0.5]
    assert softmax(np.array([0.0, np.inf, 1.0, np.inf])).tolist() == [0.0, 0.5, 0.0, 0.5]


def test_processed_probs_very_negative_logits_and_tiny_temperatures():
    params = SamplingParams(temperature=1e-300)
    assert processed_probs(np.array([3e38, 0.0, -3e38]), params).tolist() == [1.0, 0.0, 0.0]
    probs = processed_probs(np.array([-1e30, 0.0, -np.inf, np.finfo(np.float32).min], np.float32),
                            SamplingParams(temperature=1e-3, top_k=3))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    huge = 2.0**100  # the two finite logits differ by exactly the temperature
    probs = processed_probs(np.array([-huge, -huge + 2.0**60, -np.inf]), SamplingParams(temperature=2.0**60))
    assert np.allclose(probs, [1 / (1 + math.e), math.e / (1 + math.e), 0.0], rtol=0, atol=1e-12)


def test_nan_logits_are_never_selected():
    logits = np.array([0.0, np.nan, 1.0])
    assert select_token(logits, SamplingParams(), call_rng(0)) == 2
    assert processed_probs(logits, SAMPLED)[1] == 0.0
    assert processed_probs(logits, SamplingParams())[2] == 1.0


def test_verify_by_rejection_with_zero_probability_rows_emits_only_possible_tokens():
    with np.errstate(divide="ignore"):
        target = np.log(np.array([[0.5, 0.5, 0.0], [0.3, 0.3, 0.4]]))
    for q in (np.full(3, 1 / 3), np.array([0.0, 0.0, 1.0])):
        for seed in range(50):
            emitted = verify_by_rejection(target, q[None], [2], SamplingParams(temperature=1.0), call_rng(seed))
            assert emitted[0] in (0, 1)


def test_inverse_cdf_refuses_all_zero_probabilities():
    with pytest.raises(ValueError):
        inverse_cdf(np.zeros(3), 0.5)
