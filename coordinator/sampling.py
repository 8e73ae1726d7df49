"""Token selection maths: logits processing, seeded sampling, speculative
acceptance, and what the coordinator sends so that an engine verifies
losslessly. numpy only, so it is tested in milliseconds and runs unchanged
inside any engine.

Random state follows the tensorrtllm backend: every engine call is a new
request whose random numbers come from that call's seed alone, drawn in
order (TensorRT-LLM seeds curand once per request from ``random_seed``). The
coordinator therefore gives every call its own seed, derived from the
request's seed, the call's absolute position and its role (``call_seed``), so
no two calls of a request share a stream and the same request seed still
gives the same text.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from coordinator.penalties import Penalties

ROLES = ("draft", "target")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings as the engines receive them (tensorrtllm names)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter; 1: greedy
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0
    end_id: int | None = None  # the engine's end token (None: the model's own)
    penalties: Penalties | None = None  # context-dependent processing (coordinator/penalties.py)
    log_probs: bool = False  # the engine reports each generated token's log probability

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


_PLAIN = SamplingParams(temperature=1.0)  # no temperature scaling, no filters


def call_seed(request_seed: int, position: int, role: str) -> int:
    """The seed of one engine call: a 64-bit hash of (request seed, absolute
    position of the call's first new token, role).

    Positions only grow within a request and each role makes one call per
    position, so every call of a request draws from a stream of its own."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    key = struct.pack("<QQ", int(request_seed) % 2**64, int(position)) + role.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"specdec-seed").digest(), "little")


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


def accept_or_correct(p: np.ndarray, q: np.ndarray, token: int, rng: Uniforms) -> int | None:
    """One step of speculative rejection sampling (Leviathan et al.; Chen et al.).

    Accept the draft's ``token`` with probability min(1, p(token)/q(token)):
    returns None. Otherwise returns a sample of normalise(max(0, p - q)), the
    correction. Over the draft's choice (``token`` ~ q) the result is
    distributed exactly as p, whatever q is. One uniform for the test and,
    after a rejection, one for the correction, both fresh from ``rng``.
    """
    if q[token] > 0.0 and rng.random() * q[token] < p[token]:
        return None
    residual = np.maximum(p - q, 0.0)
    if not residual.sum() > 0.0:  # p == q: a rejection cannot happen, but be safe
        residual = p
    return inverse_cdf(residual / residual.sum(), rng.random())


def verify_by_matching(
    target_logits: np.ndarray, draft_tokens: list[int], params: SamplingParams, rng: Uniforms
) -> list[int]:
    """Token-matching verification (no draft distribution given).

    ``target_logits[i]`` predicts the position of ``draft_tokens[i]``. The
    target samples each position; its token is accepted while it equals the
    draft's. Returns the accepted prefix plus one token of the target's own.
    Lossless for any draft: every emitted token is the target's own sample.
    """
    emitted: list[int] = []
    for i in range(len(draft_tokens) + 1):
        token = select_token(target_logits[i], params, rng)
        emitted.append(token)
        if i == len(draft_tokens) or token != draft_tokens[i]:
            break
    return emitted


def verify_by_rejection(
    target_logits: np.ndarray,
    draft_probs: np.ndarray,
    draft_tokens: list[int],
    params: SamplingParams,
    rng: Uniforms,
) -> list[int]:
    """Rejection-sampling verification against the draft's distribution q.

    ``draft_probs[i]`` is q for the position of ``draft_tokens[i]``; p is
    the target's processed distribution. Returns the accepted prefix plus the
    correction after the first rejection, or plus a bonus sample of p when
    all are accepted: distributed exactly as the target's sampler.
    """
    emitted: list[int] = []
    for i, token in enumerate(draft_tokens):
        correction = accept_or_correct(processed_probs(target_logits[i], params), draft_probs[i], int(token), rng)
        if correction is not None:
            emitted.append(correction)
            return emitted
        emitted.append(int(token))
    emitted.append(select_token(target_logits[len(draft_tokens)], params, rng))
    return emitted


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
