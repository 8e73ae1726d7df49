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


def _scores(logits: np.ndarray) -> np.ndarray:
    """Logits as a float64 vector; NaN (a broken logit) counts as -inf, never sampled."""
    scores = np.asarray(logits, dtype=np.float64).reshape(-1)
    if scores.size == 0:
        raise ValueError("logits are empty")
    nan = np.isnan(scores)
    if nan.any():
        scores = np.where(nan, -np.inf, scores)
    return scores


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


def select_token(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token a (draft or target) sampler emits at ``position``."""
    if params.greedy:
        return int(np.argmax(_scores(logits)))
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


# "Probability 0" as a finite logit: safe in float32 (also after an engine
# divides it by a small temperature), and exp() of it is exactly 0.
NEVER_LOGIT = -1e30


def _filters(params: SamplingParams, vocab: int) -> tuple[int, float]:
    """(top_k, top_p) as they act on a vocabulary of ``vocab`` tokens (0 and 1.0: none)."""
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    top_p = params.top_p if params.top_p < 1.0 else 1.0
    return top_k, top_p


def draft_logits_for_target(
    draft_logits: np.ndarray, draft_params: SamplingParams, target_params: SamplingParams
) -> np.ndarray:
    """Draft logits to send to a target that knows only its own sampling params.

    A target verifying by rejection (TensorRT-LLM's contract, and
    ``verify_by_rejection`` without ``draft_params``) takes the draft's
    distribution to be ``processed_probs(row, target_params)`` of the
    ``draft_logits`` it receives. When the draft sampled with other params
    (say its own temperature), send these float32 rows L' instead: for each
    row ``processed_probs(L'[i], target_params)`` equals
    ``processed_probs(draft_logits[i], draft_params)`` (to 1e-6), so the
    speculation stays lossless.

    - greedy draft: 0 at the draft's token, ``NEVER_LOGIT`` elsewhere;
    - same top-k and top-p: the logits times T_target / T_draft (shifted so
      the maximum is 0): the target's temperature undoes the factor and its
      filters then see exactly the draft's scores;
    - other filters: T_target * log(q) (``NEVER_LOGIT`` where q is 0). The
      target applies its own top-k and top-p to that, so this reproduces q
      only if they keep all of q's support;
    - greedy target: the rows as they are (float32; -inf and NaN as
      ``NEVER_LOGIT``). A greedy target emits its own argmax whatever q is,
      so any draft logits are lossless.

    Raises ValueError when the target's processing cannot reproduce q (e.g.
    its top-k is smaller than the draft's). The caller should then verify by
    token matching (send no draft logits), which is lossless for any draft.
    """
    logits = np.asarray(draft_logits, dtype=np.float64)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"draft_logits must be [k, vocab], got shape {list(logits.shape)}")
    if target_params.greedy:
        return np.maximum(np.where(np.isnan(logits), -np.inf, logits), NEVER_LOGIT).astype(np.float32)
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = rows.shape[-1]
    q = np.stack([processed_probs(row, draft_params) for row in rows]) if rows.size else np.zeros_like(rows)
    if draft_params.greedy:
        out = np.where(q > 0.0, 0.0, NEVER_LOGIT)
    elif _filters(draft_params, vocab) == _filters(target_params, vocab):
        factor = target_params.temperature / draft_params.temperature
        out = np.empty_like(rows)
        for i, row in enumerate(rows):
            scores = _scores(row)
            top = scores.max()
            if np.isfinite(top):
                with np.errstate(over="ignore"):  # beyond float64: -inf, clipped below
                    out[i] = (scores - top) * factor
            else:  # as processed_probs: the tokens at an infinite maximum share the mass
                out[i] = np.where(scores == top, 0.0, -np.inf)
    else:
        with np.errstate(divide="ignore"):
            out = target_params.temperature * np.log(q)
    out = np.maximum(out, NEVER_LOGIT).astype(np.float32)
    for i, row in enumerate(out):
        error = float(np.max(np.abs(processed_probs(row, target_params) - q[i])))
        if not error <= 1e-6:
            raise ValueError(
                f"the target's sampling {target_params} cannot reproduce the draft's distribution "
                f"under {draft_params} (row {i}: off by {error:.3g}); verify by token matching instead"
            )
    return out.reshape(logits.shape)
