"""Token selection maths: logits processing, seeded sampling and the draft
distribution the coordinator sends so that an engine verifies losslessly.
numpy only, so it is tested in milliseconds and runs unchanged inside any
engine (the acceptance rules that use it: coordinator/verification/rules.py).
"""

from __future__ import annotations

import random
from typing import Protocol

import numpy as np

from coordinator.sampling.params import SamplingParams

_PLAIN = SamplingParams(temperature=1.0)  # no temperature scaling, no filters


class Uniforms(Protocol):
    def random(self) -> float:
        """The next uniform in [0, 1)."""
        ...


def call_rng(seed: int) -> Uniforms:
    """The random stream of one engine call, from that call's seed alone
    (a Mersenne Twister: cheap to seed once per call, and calls draw few numbers)."""
    return random.Random(int(seed) % 2**64)


def _scores(logits: np.ndarray) -> np.ndarray:
    """Logits as a float64 vector; NaN (a broken logit) counts as -inf, never sampled."""
    scores = np.asarray(logits, dtype=np.float64).reshape(-1)
    if scores.size == 0:
        raise ValueError("logits are empty")
    nan = np.isnan(scores)
    if nan.any():
        scores = np.where(nan, -np.inf, scores)
    return scores


def softmax(logits: np.ndarray) -> np.ndarray:
    """A plain softmax (float64): how the tensorrtllm backend reads ``draft_logits``.
    It is the sampler's distribution at temperature 1 without filters."""
    return processed_probs(logits, _PLAIN)


def processed_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampler with ``params`` draws from (float64, sums to 1).

    Order as in common engines: temperature, then top-k, then top-p. -inf and
    very negative logits get probability 0 and never produce NaN: scores are
    shifted by their maximum before the temperature divides them. If the
    maximum is infinite (all logits -inf, or some +inf), the mass is shared
    evenly by the tokens at the maximum.
    """
    scores = _scores(logits)
    if params.greedy:
        probs = np.zeros_like(scores)
        probs[int(np.argmax(scores))] = 1.0
        return probs
    top = scores.max()
    if np.isfinite(top):
        with np.errstate(over="ignore"):  # a tiny temperature: very negative scores become -inf
            scores = (scores - top) / params.temperature  # <= 0, the maximum exactly 0
    else:
        scores = np.where(scores == top, 0.0, -np.inf)
    if 0 < params.top_k < scores.size:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores >= kth, scores, -np.inf)
    probs = np.exp(scores)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        keep = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[:keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def token_log_prob(logits: np.ndarray, params: SamplingParams, token: int) -> float:
    """log p(token) as TensorRT-LLM reports it in ``output_log_probs``: the
    softmax of the logits after temperature (and penalties), before top-k and
    top-p truncation (samplingTopKKernels.cu: "NOT normalized (same way as
    OpenAI does)"). Greedy calls run at temperature 1."""
    scores = _scores(logits)
    temperature = 1.0 if params.greedy or params.temperature <= 0.0 else params.temperature
    top = scores.max()
    if not np.isfinite(top):
        return 0.0 if scores[token] == top else float("-inf")
    with np.errstate(over="ignore", divide="ignore"):
        scaled = (scores - top) / temperature
        return float(scaled[token] - np.log(np.exp(scaled).sum()))


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The token whose cumulative-probability interval contains ``u``."""
    cumulative = np.asarray(probs).cumsum()
    if not cumulative[-1] > 0.0:
        raise ValueError("probabilities sum to zero")
    index = int(cumulative.searchsorted(u * cumulative[-1], side="right"))
    index = min(index, probs.size - 1)
    # never return a zero-probability token because of rounding at the edges
    while probs[index] <= 0.0 and index > 0:
        index -= 1
    while probs[index] <= 0.0:
        index += 1
    return index


def select_token(logits: np.ndarray, params: SamplingParams, rng: Uniforms) -> int:
    """The token a sampler emits: argmax when greedy (no random number drawn),
    else one draw from ``rng``."""
    if params.greedy:
        return int(np.argmax(_scores(logits)))
    return inverse_cdf(processed_probs(logits, params), rng.random())


def draft_log_probs(draft_logits: np.ndarray, draft_params: SamplingParams) -> np.ndarray:
    """What the coordinator sends as ``draft_logits``: log q, float32 [k, vocab].

    q is the distribution the draft actually sampled from (its raw logits
    processed with its own temperature, top-k and top-p); -inf where q is 0.
    The tensorrtllm backend takes q as a plain softmax of ``draft_logits``
    (no temperature or filters: those apply to the target's side only), and
    softmax(log q) = q, so verification is lossless whatever the draft's and
    the target's sampling settings are.
    """
    rows = np.asarray(draft_logits)
    if rows.ndim != 2 or rows.shape[-1] == 0:
        raise ValueError(f"draft logits must be [k, vocab], got shape {list(rows.shape)}")
    out = np.empty(rows.shape, dtype=np.float32)
    with np.errstate(divide="ignore"):
        for i, row in enumerate(rows):
            out[i] = np.log(processed_probs(row, draft_params))
    return out
