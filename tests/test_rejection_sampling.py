"""Speculative rejection sampling is lossless: statistical tests of the whole pipeline.

The pipeline, per round: the draft samples k tokens with
``select_token(draft_logits, draft_params, position)`` at positions
first..first+k-1 (stream 0 of the request's seed), the target verifies them
with ``verify_by_rejection`` and the round's emitted tokens extend the
context; rounds repeat until enough tokens are out. Draft and target are
small first-order Markov "models" (the logits for a position depend on the
previous token), so the target's sampler distribution is known exactly: the
first emitted token must follow p(. | start) and the first two together
p(x1 | start) p(x2 | x1), whatever the draft does, for every k. The joint
exercises the accept-then-next-token path, the bonus token (k = 1) and the
next round after a rejection.

Statistic: Pearson's chi-square goodness of fit of the emitted-token counts
against the exact target distribution (cells with expected count < 5 pooled;
any token of probability 0 fails outright), p-value from the exact
chi-square survival function (closed form for integer degrees of freedom).
A test rejects when p < ALPHA = 1e-4: the false-alarm rate of each test over
random seeds. The seeds are fixed (sample i uses seed i), so the tests are
deterministic: a pass stays a pass and the suite is never flaky.
Power: deliberately wrong verifiers must be rejected by the same statistic.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import coordinator.sampling as sampling
from coordinator.sampling import (
    NEVER_LOGIT,
    SamplingParams,
    draft_logits_for_target,
    inverse_cdf,
    position_uniform,
    processed_probs,
    select_token,
    verify_by_rejection,
)

ALPHA = 1e-4
PROMPT = 7  # absolute position of the first generated token
N = 2000  # samples (seeds 0..N-1) per distribution test


# ---------------------------------------------------------------------------
# statistics (numpy and math only)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), df a positive integer (exact closed forms)."""
    if x <= 0.0:
        return 1.0
    if df % 2 == 0:  # exp(-x/2) sum_{i < df/2} (x/2)^i / i!
        term = total = 1.0
        for i in range(1, df // 2):
            term *= x / 2 / i
            total += term
        return math.exp(-x / 2) * total
    # 2 Q(sqrt x) + 2 phi(sqrt x) sum_{r=1}^{(df-1)/2} x^{(2r-1)/2} / (1*3*...*(2r-1))
    root = math.sqrt(x)
    total = math.erfc(root / math.sqrt(2))
    term = math.sqrt(2 / math.pi) * math.exp(-x / 2) * root
    for r in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * r + 1)
    return total


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (same shape)."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    assert abs(probs.sum() - 1.0) < 1e-9
    if counts[probs <= 0.0].sum() > 0:  # a token the target can never emit
        return 0.0
    n = counts.sum()
    observed, expected = counts[probs > 0.0], n * probs[probs > 0.0]
    order = np.argsort(expected)
    observed, expected = list(observed[order]), list(expected[order])
    # pool the smallest cells until every cell expects at least 5
    while len(expected) > 1 and expected[0] < 5.0:
        smallest_observed, smallest_expected = observed.pop(0), expected.pop(0)
        observed[0] += smallest_observed
        expected[0] += smallest_expected
        resort = np.argsort(expected)
        observed, expected = [observed[i] for i in resort], [expected[i] for i in resort]
    if len(expected) < 2:
        return 1.0  # one possible outcome, and every sample is it
    observed_a, expected_a = np.array(observed), np.array(expected)
    stat = float(((observed_a - expected_a) ** 2 / expected_a).sum())
    return chi2_sf(stat, len(expected) - 1)


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
def _memoised_sampling_primitives():
    """Speed only: cache processed_probs (it ignores the seed) and position_uniform.

    Both are pure, so the cached values are exactly what the real functions
    return; verify_by_rejection and select_token look them up as module
    globals and run otherwise unchanged.
    """
    real_probs, real_uniform = sampling.processed_probs, sampling.position_uniform
    probs_cache: dict = {}
    uniform_cache: dict = {}

    def cached_probs(logits, params):
        array = np.asarray(logits)
        key = (array.tobytes(), array.dtype.str, params.temperature, params.top_k, params.top_p)
        probs = probs_cache.get(key)
        if probs is None:
            probs = real_probs(array, params)
            probs.flags.writeable = False  # a caller that writes into it would fail loudly
            probs_cache[key] = probs
        return probs

    def cached_uniform(seed, position, stream=0):
        key = (seed, position, stream)
        value = uniform_cache.get(key)
        if value is None:
            value = uniform_cache[key] = real_uniform(seed, position, stream)
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "processed_probs", cached_probs)
        patch.setattr(sampling, "position_uniform", cached_uniform)
        yield


class Model:
    """First-order Markov logits: row ``v`` predicts the token after ``v``; row ``vocab`` the first one."""

    def __init__(self, probs: np.ndarray, zero: float = -np.inf):
        probs = np.asarray(probs, dtype=np.float64)
        self.vocab = probs.shape[1]
        assert probs.shape == (self.vocab + 1, self.vocab)
        with np.errstate(divide="ignore"):
            self.logits = np.where(probs > 0, np.log(probs), zero)

    @property
    def start(self) -> int:
        return self.vocab

    def probs(self, params: SamplingParams) -> np.ndarray:
        return np.stack([processed_probs(row, params) for row in self.logits])


def speculate(target: Model, draft: Model, params: SamplingParams, k: int, *, n: int = N, tokens: int = 2,
              draft_params: SamplingParams | None = None, verifier=verify_by_rejection,
              tell_draft_params: bool = True, transform: bool = False) -> np.ndarray:
    """The first ``tokens`` emitted tokens for seeds 0..n-1, shape [n, tokens].

    ``tell_draft_params``: pass ``draft_params`` to the verifier; ``transform``:
    instead send ``draft_logits_for_target`` rows and only the target's params
    (the TensorRT-LLM contract).
    """
    draft_params = draft_params or params
    out = np.empty((n, tokens), dtype=np.int64)
    for seed in range(n):
        tp, dp = replace(params, seed=seed), replace(draft_params, seed=seed)
        context: list[int] = []
        while len(context) < tokens:
            first = PROMPT + len(context)
            prevs = [context[-1] if context else target.start]
            for i in range(k):
                prevs.append(select_token(draft.logits[prevs[-1]], dp, first + i))
            drafts = prevs[1:]
            draft_rows = draft.logits[prevs[:-1]]
            if transform:
                emitted = verifier(target.logits[prevs], draft_logits_for_target(draft_rows, dp, tp), drafts, tp, first)
            else:
                told = dp if tell_draft_params else None
                emitted = verifier(target.logits[prevs], draft_rows, drafts, tp, first, told)
            assert 1 <= len(emitted) <= k + 1 and list(emitted[:-1]) == drafts[: len(emitted) - 1]
            context += list(emitted)
        out[seed] = context[:tokens]
    return out


def first_pvalue(samples: np.ndarray, target: Model, params: SamplingParams) -> float:
    p = target.probs(params)[target.start]
    return gof_pvalue(np.bincount(samples[:, 0], minlength=target.vocab), p)


def joint_pvalue(samples: np.ndarray, target: Model, params: SamplingParams) -> float:
    """The first two tokens against p(x1 | start) p(x2 | x1)."""
    v = target.vocab
    table = target.probs(params)
    joint = table[target.start][:, None] * table[:v]
    return gof_pvalue(np.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v), joint)


def assert_lossless(samples, target, params):
    first, joint = first_pvalue(samples, target, params), joint_pvalue(samples, target, params)
    assert first >= ALPHA and joint >= ALPHA, f"first-token p={first:.3g}, first-two-tokens p={joint:.3g}"


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
        # q one-hot (zeros as a very negative finite logit, as engines send them)
        "one_hot_q": (Model(dirichlet_rows(rng, v)), Model(one_hot_rows(v, lambda r: (2 * r) % v), zero=NEVER_LOGIT)),
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
    "temperature_1.5_top_k_3": (SamplingParams(temperature=1.5, top_k=3), None),
    "top_p_0.75": (SamplingParams(temperature=1.0, top_p=0.75), None),
    "temperature_0.8_top_k_4_top_p_0.9": (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), None),
    "greedy_temperature_0": (SamplingParams(temperature=0.0), None),
    "greedy_top_k_1": (SamplingParams(temperature=1.3, top_k=1), None),
    # a separate draft sampling (told to the verifier)
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
# a draft temperature through the TensorRT-LLM contract (target knows only its params)


@pytest.mark.parametrize(
    "params, draft_params",
    [
        (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)),
        (SamplingParams(temperature=0.9, top_k=4, top_p=0.85), SamplingParams(temperature=0.5, top_k=4, top_p=0.85)),
        (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)),  # log q path
        (SamplingParams(temperature=1.2), SamplingParams(temperature=0.0)),  # greedy draft
    ],
)
def test_draft_temperature_through_transformed_logits_is_lossless(params, draft_params):
    samples = speculate(TARGET6, DRAFT6, params, 2, draft_params=draft_params, transform=True)
    assert_lossless(samples, TARGET6, params)


def test_untransformed_logits_with_another_draft_temperature_are_detected():
    """Power: the engine taking raw draft logits at its own temperature 1.0 while the draft sampled at 0.5."""
    params, draft_params = SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)
    samples = speculate(TARGET6, DRAFT6, params, 2, draft_params=draft_params, tell_draft_params=False)
    assert first_pvalue(samples, TARGET6, params) < ALPHA


# ---------------------------------------------------------------------------
# power: wrong verifiers fail the same statistic


def always_accept(target_logits, draft_logits, draft_tokens, params, first_position, draft_params=None):
    n = len(draft_tokens)
    return [*draft_tokens, select_token(target_logits[n], params, first_position + n)]


def resample_from_p(target_logits, draft_logits, draft_tokens, params, first_position, draft_params=None):
    """Right acceptance test, but a rejection resamples from p instead of the residual."""
    draft_params = draft_params or params
    emitted = []
    for i, token in enumerate(draft_tokens):
        p = processed_probs(target_logits[i], params)
        q = processed_probs(draft_logits[i], draft_params)
        if position_uniform(params.seed, first_position + i, 1) * q[token] < p[token]:
            emitted.append(token)
            continue
        return [*emitted, inverse_cdf(p, position_uniform(params.seed, first_position + i, 2))]
    n = len(draft_tokens)
    return [*emitted, select_token(target_logits[n], params, first_position + n)]


def accept_with_draft_uniform(target_logits, draft_logits, draft_tokens, params, first_position, draft_params=None):
    """Right maths, but the acceptance reuses the uniform the draft sampled with (stream 0)."""
    real = sampling.position_uniform

    def colliding(seed, position, stream=0):
        return real(seed, position, 0 if stream == 1 else stream)

    sampling.position_uniform = colliding
    try:
        return verify_by_rejection(target_logits, draft_logits, draft_tokens, params, first_position, draft_params)
    finally:
        sampling.position_uniform = real


def residual_with_draft_uniform(target_logits, draft_logits, draft_tokens, params, first_position, draft_params=None):
    """Right maths, but the residual sample reuses the uniform the draft sampled with (stream 0)."""
    real = sampling.position_uniform

    def colliding(seed, position, stream=0):
        return real(seed, position, 0 if stream == 2 else stream)

    sampling.position_uniform = colliding
    try:
        return verify_by_rejection(target_logits, draft_logits, draft_tokens, params, first_position, draft_params)
    finally:
        sampling.position_uniform = real


POWER_CASE = CASES["random"]


@pytest.mark.parametrize(
    "wrong", [always_accept, resample_from_p, accept_with_draft_uniform, residual_with_draft_uniform]
)
def test_wrong_verifiers_are_rejected(wrong):
    target, draft = POWER_CASE
    samples = speculate(target, draft, SAMPLED, 2, verifier=wrong)
    assert min(first_pvalue(samples, target, SAMPLED), joint_pvalue(samples, target, SAMPLED)) < ALPHA


# ---------------------------------------------------------------------------
# acceptance


def _one_round(target, draft, params, k, n):
    """(draft tokens, emitted tokens) of the first round for seeds 0..n-1."""
    rounds = []
    for seed in range(n):
        tp = replace(params, seed=seed)
        prevs = [target.start]
        for i in range(k):
            prevs.append(select_token(draft.logits[prevs[-1]], tp, PROMPT + i))
        drafts = prevs[1:]
        rounds.append((drafts, verify_by_rejection(target.logits[prevs], draft.logits[prevs[:-1]], drafts, tp, PROMPT)))
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
# draft_logits_for_target


def _random_logits(rng, k, vocab):
    logits = rng.normal(0.0, 3.0, size=(k, vocab)).astype(np.float32)
    logits[0, 1] = -np.inf
    logits[1, :2] = NEVER_LOGIT
    return logits


@pytest.mark.parametrize(
    "draft_params, target_params",
    [
        (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)),
        (SamplingParams(temperature=1.6, top_k=5), SamplingParams(temperature=0.4, top_k=5)),
        (SamplingParams(temperature=0.3, top_k=6, top_p=0.8), SamplingParams(temperature=2.0, top_k=6, top_p=0.8)),
        (SamplingParams(temperature=0.05, top_p=0.95), SamplingParams(temperature=0.01, top_p=0.95)),
        (SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0)),  # other filters: log q
        (SamplingParams(temperature=0.7, top_p=0.6), SamplingParams(temperature=0.5, top_k=8)),
        (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=2, top_p=0.5)),  # greedy draft
        (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1e-3)),  # greedy draft (top-k 1)
    ],
)
def test_draft_logits_for_target_reproduces_the_draft_distribution(draft_params, target_params):
    rng = np.random.default_rng(3)
    for vocab in (4, 8, 50):
        logits = _random_logits(rng, 4, vocab)
        sent = draft_logits_for_target(logits, draft_params, target_params)
        assert sent.dtype == np.float32 and sent.shape == logits.shape and np.isfinite(sent).all()
        for row, draft_row in zip(sent, logits):
            expected = processed_probs(draft_row, draft_params)
            assert np.allclose(processed_probs(row, target_params), expected, atol=1e-6, rtol=0)


def test_draft_logits_for_target_same_params_keep_the_distribution():
    logits = _random_logits(np.random.default_rng(4), 3, 10)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    sent = draft_logits_for_target(logits, params, params)
    for row, draft_row in zip(sent, logits):
        assert np.allclose(processed_probs(row, params), processed_probs(draft_row, params), atol=1e-7, rtol=0)


def test_draft_logits_for_target_greedy_draft_is_one_hot():
    logits = np.array([[0.5, 2.0, -1.0, 2.0]], dtype=np.float32)
    sent = draft_logits_for_target(logits, SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))
    never = np.float32(NEVER_LOGIT)
    assert sent.dtype == np.float32 and sent.tolist() == [[never, 0.0, never, never]]  # the first maximum


def test_draft_logits_for_target_rejects_what_the_target_cannot_reproduce():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]]))
    with pytest.raises(ValueError, match="token matching"):  # the target's top-k cuts q's support
        draft_logits_for_target(logits, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2))
    with pytest.raises(ValueError, match="token matching"):  # its top-p on q would cut q again
        draft_logits_for_target(logits, SamplingParams(temperature=0.5, top_k=3),
                                SamplingParams(temperature=1.0, top_p=0.8))


def test_draft_logits_for_target_greedy_target_passes_rows_through_finite():
    logits = np.array([[0.5, -np.inf, np.nan, 2.0]])
    sent = draft_logits_for_target(logits, SamplingParams(temperature=0.7), SamplingParams(temperature=0.0))
    assert sent.dtype == np.float32 and np.isfinite(sent).all() and sent[0, 3] == 2.0
    assert sent[0, 1] == sent[0, 2] == np.float32(NEVER_LOGIT)


# ---------------------------------------------------------------------------
# -inf, very negative, +inf and NaN logits (each of these gave NaN before)


def test_processed_probs_of_all_minus_inf_is_uniform_not_nan():
    probs = processed_probs(np.full(4, -np.inf), SamplingParams(temperature=0.7, top_k=2))
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)


def test_processed_probs_plus_inf_takes_all_the_mass():
    assert processed_probs(np.array([0.0, np.inf, 1.0, np.inf]), SAMPLED).tolist() == [0.0, 0.5, 0.0, 0.5]


def test_processed_probs_very_negative_logits_and_tiny_temperatures():
    params = SamplingParams(temperature=1e-300)
    assert processed_probs(np.array([3e38, 0.0, -3e38]), params).tolist() == [1.0, 0.0, 0.0]
    probs = processed_probs(np.array([NEVER_LOGIT, 0.0, -np.inf, np.finfo(np.float32).min], np.float32),
                            SamplingParams(temperature=1e-3, top_k=3))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    huge = 2.0**100  # the two finite logits differ by exactly the temperature
    probs = processed_probs(np.array([-huge, -huge + 2.0**60, -np.inf]), SamplingParams(temperature=2.0**60))
    assert np.allclose(probs, [1 / (1 + math.e), math.e / (1 + math.e), 0.0], rtol=0, atol=1e-12)


def test_nan_logits_are_never_selected():
    logits = np.array([0.0, np.nan, 1.0])
    assert select_token(logits, SamplingParams(), 0) == 2
    assert processed_probs(logits, SAMPLED)[1] == 0.0
    assert processed_probs(logits, SamplingParams())[2] == 1.0


def test_verify_by_rejection_with_minus_inf_rows_emits_only_possible_tokens():
    with np.errstate(divide="ignore"):
        target = np.log(np.array([[0.5, 0.5, 0.0], [0.3, 0.3, 0.4]]))
    draft_rows = (np.full(3, -np.inf), np.array([-np.inf, -np.inf, 0.0]), np.array([NEVER_LOGIT, 0.0, NEVER_LOGIT]))
    for draft_row in draft_rows:
        for seed in range(50):
            emitted = verify_by_rejection(target, draft_row[None], [2], SamplingParams(temperature=1.0, seed=seed), 0)
            assert emitted[0] in (0, 1)


def test_inverse_cdf_refuses_all_zero_probabilities():
    with pytest.raises(ValueError):
        inverse_cdf(np.zeros(3), 0.5)
