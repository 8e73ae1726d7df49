"""Token selection maths shared by the engines: logits processing, seeded
sampling and speculative acceptance. numpy only, so it is tested in
milliseconds and runs unchanged inside any engine.

Randomness is keyed by (seed, absolute position): the draft and the target
draw the same uniform for the same position. With token-matching
verification this couples the two samplers (a draft close to the target then
proposes the token the target will sample) while every emitted token is still
the target's own sample, so speculation stays lossless and, for a fixed seed,
gives exactly the output of plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Sub-streams of the per-position random numbers.
_STREAM_SAMPLE = 0
_STREAM_ACCEPT = 1
_STREAM_RESIDUAL = 2


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings as the engines receive them (tensorrtllm names)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter; 1: greedy
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def position_uniform(seed: int, position: int, stream: int = _STREAM_SAMPLE) -> float:
    """A uniform in [0, 1) that depends only on (seed, position, stream)."""
    return float(np.random.default_rng([int(seed), int(position), stream]).random())


def processed_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampler with ``params`` draws from (float64, sums to 1).

    Order as in common engines: temperature, then top-k, then top-p.
    """
    scores = np.asarray(logits, dtype=np.float64).reshape(-1)
    if params.greedy:
        probs = np.zeros_like(scores)
        probs[int(np.argmax(scores))] = 1.0
        return probs
    scores = scores / params.temperature
    if 0 < params.top_k < scores.size:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores >= kth, scores, -np.inf)
    scores = scores - np.max(scores)
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


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The token whose cumulative-probability interval contains ``u``."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    index = min(index, probs.size - 1)
    # never return a zero-probability token because of rounding at the edges
    while probs[index] <= 0.0 and index > 0:
        index -= 1
    while probs[index] <= 0.0:
        index += 1
    return index


def select_token(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token a (draft or target) sampler emits at ``position``."""
    if params.greedy:
        return int(np.argmax(logits))
    return inverse_cdf(processed_probs(logits, params), position_uniform(params.seed, position))


def verify_by_matching(
    target_logits: np.ndarray, draft_tokens: list[int], params: SamplingParams, first_position: int
) -> list[int]:
    """Token-matching verification (no draft distribution available).

    ``target_logits[i]`` predicts position ``first_position + i``. Returns the
    accepted draft prefix plus one token of the target's own: the target's
    sample at each position, accepted while it equals the draft token.
    """
    emitted: list[int] = []
    for i in range(len(draft_tokens) + 1):
        token = select_token(target_logits[i], params, first_position + i)
        emitted.append(token)
        if i == len(draft_tokens) or token != draft_tokens[i]:
            break
    return emitted


def verify_by_rejection(
    target_logits: np.ndarray,
    draft_logits: np.ndarray,
    draft_tokens: list[int],
    params: SamplingParams,
    first_position: int,
    draft_params: SamplingParams | None = None,
) -> list[int]:
    """Speculative rejection sampling (Leviathan et al.; Chen et al.).

    Accept draft token x with probability min(1, p(x)/q(x)); on the first
    rejection emit a sample of normalise(max(0, p - q)); if all are accepted
    emit a bonus sample of p. The emitted tokens are distributed exactly as
    the target's sampler, whatever q is. ``draft_params`` is how the draft
    sampled (it may use another temperature); defaults to ``params``.
    """
    draft_params = draft_params or params
    emitted: list[int] = []
    for i, token in enumerate(draft_tokens):
        position = first_position + i
        p = processed_probs(target_logits[i], params)
        q = processed_probs(draft_logits[i], draft_params)
        u = position_uniform(params.seed, position, _STREAM_ACCEPT)
        if q[token] > 0.0 and u * q[token] < p[token]:
            emitted.append(int(token))
            continue
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0.0:  # p == q: a rejection cannot happen, but be safe
            residual = p
        emitted.append(inverse_cdf(residual / residual.sum(), position_uniform(params.seed, position, _STREAM_RESIDUAL)))
        return emitted
    n = len(draft_tokens)
    emitted.append(select_token(target_logits[n], params, first_position + n))
    return emitted
