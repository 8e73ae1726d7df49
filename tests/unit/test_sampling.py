import numpy as np
import pytest

from coordinator.sampling.params import SamplingParams
from coordinator.sampling.maths import call_rng, inverse_cdf, processed_probs, select_token
from coordinator.verification.rules import verify_by_matching, verify_by_rejection


def test_greedy_is_argmax_and_top_k_one_is_greedy():
    logits = np.array([0.1, 3.0, 2.0])
    assert select_token(logits, SamplingParams(), call_rng(0)) == 1
    assert select_token(logits, SamplingParams(temperature=5.0, top_k=1, seed=3), call_rng(3)) == 1


def test_top_k_and_top_p_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(probs, [0.625, 0.375, 0, 0])
    # 0.5 + 0.3 reaches 0.79. (Not 0.8 itself: whether exp(log(0.5)) + exp(log(0.3))
    # reaches 0.8 exactly depends on the CPU's exp; on AVX2-only machines it falls short.)
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.79))
    assert np.allclose(probs, [0.625, 0.375, 0, 0])
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert np.allclose(probs, np.array([0.5, 0.3, 0.15, 0]) / 0.95)


def test_a_calls_random_stream_depends_on_its_seed_alone():
    first, again, other = call_rng(7), call_rng(7), call_rng(8)
    values = [first.random() for _ in range(100)]
    assert values == [again.random() for _ in range(100)]
    assert len(set(values)) == 100 and all(0 <= v < 1 for v in values)
    assert values[:5] != [other.random() for _ in range(5)]


def test_inverse_cdf_never_returns_zero_probability_tokens():
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert {inverse_cdf(probs, u) for u in np.linspace(0, 0.999999, 101)} == {1, 3}


def test_seeded_sampling_matches_the_distribution():
    """Chi-square goodness of fit; critical value for df=4 at alpha=1e-4 is 23.5."""
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    params = SamplingParams(temperature=1.0, seed=11)
    n = 20000
    rng = call_rng(11)
    counts = np.bincount([select_token(np.log(p), params, rng) for _ in range(n)], minlength=5)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 23.5


def test_matching_verification_returns_accepted_prefix_plus_one():
    rows = np.eye(5)[[2, 3, 4, 1]] * 10  # target greedy: 2, 3, 4, 1
    assert verify_by_matching(rows, [2, 3, 0], SamplingParams(), call_rng(0)) == [2, 3, 4]
    assert verify_by_matching(rows, [2, 3, 4], SamplingParams(), call_rng(0)) == [2, 3, 4, 1]  # bonus token
    assert verify_by_matching(rows, [0, 3, 4], SamplingParams(), call_rng(0)) == [2]


@pytest.mark.parametrize(
    "q",
    [
        np.array([0.4, 0.25, 0.2, 0.1, 0.05]),  # q == p
        np.array([0.05, 0.1, 0.2, 0.25, 0.4]),  # reversed
        np.array([1.0, 0.0, 0.0, 0.0, 0.0]),  # one-hot
        np.array([0.0, 0.0, 0.0, 0.5, 0.5]),  # q = 0 where p > 0
    ],
)
def test_rejection_sampling_first_token_is_distributed_as_target(q):
    """The first emitted token of a k=1 round must follow p exactly, whatever q is."""
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    rng = np.random.default_rng(0)
    n = 6000
    firsts = []
    for trial in range(n):
        draft_token = int(rng.choice(5, p=q))
        params = SamplingParams(temperature=1.0, seed=trial)
        out = verify_by_rejection(np.log(np.stack([p, p])), q[None], [draft_token], params, call_rng(trial))
        firsts.append(out[0])
    counts = np.bincount(firsts, minlength=5)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 23.5  # df=4, alpha=1e-4
