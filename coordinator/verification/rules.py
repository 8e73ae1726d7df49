"""The acceptance rules a target engine applies to a chain of draft tokens.

This is the rule, not the coordinator's side of it: the coordinator sends the
draft tokens (and log q, coordinator/sampling/maths.py ``draft_log_probs``) and
reads back the accepted prefix plus one token (coordinator/verification/outcome.py).
Who runs which implementation:

* ``trtllm`` profile: TensorRT-LLM applies its own (``draft_tokens_external``:
  token matching, or rejection sampling when ``draft_logits`` are given; its
  ``ExternalDraftTokensLayer``). Changing this module changes nothing there.
* ``cpu`` profile and the tests' engines: trtllm_emulation/calls.py runs these
  functions, so they are the executable statement of the rule that the
  lossless tests (tests/unit/test_rejection_sampling.py) check exactly.

Chain rules only: one candidate per position. The rules over several
candidates (token trees, sampled with or without replacement, or matched) are in
coordinator/verification/tree.py, which reduces to these on a chain; their exact
distributions are checked by tests/unit/test_tree_verification.py.
"""

from __future__ import annotations

import numpy as np

from coordinator.sampling import maths
from coordinator.sampling.params import SamplingParams


def accept_or_correct(p: np.ndarray, q: np.ndarray, token: int, rng: maths.Uniforms) -> int | None:
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
    return maths.inverse_cdf(residual / residual.sum(), rng.random())


def verify_by_matching(
    target_logits: np.ndarray, draft_tokens: list[int], params: SamplingParams, rng: maths.Uniforms
) -> list[int]:
    """Token-matching verification (no draft distribution given).

    ``target_logits[i]`` predicts the position of ``draft_tokens[i]``. The
    target samples each position; its token is accepted while it equals the
    draft's. Returns the accepted prefix plus one token of the target's own.
    Lossless for any draft: every emitted token is the target's own sample.
    """
    emitted: list[int] = []
    for i in range(len(draft_tokens) + 1):
        token = maths.select_token(target_logits[i], params, rng)
        emitted.append(token)
        if i == len(draft_tokens) or token != draft_tokens[i]:
            break
    return emitted


def verify_by_rejection(
    target_logits: np.ndarray,
    draft_probs: np.ndarray,
    draft_tokens: list[int],
    params: SamplingParams,
    rng: maths.Uniforms,
) -> list[int]:
    """Rejection-sampling verification against the draft's distribution q.

    ``draft_probs[i]`` is q for the position of ``draft_tokens[i]``; p is
    the target's processed distribution. Returns the accepted prefix plus the
    correction after the first rejection, or plus a bonus sample of p when
    all are accepted: distributed exactly as the target's sampler.
    """
    emitted: list[int] = []
    for i, token in enumerate(draft_tokens):
        correction = accept_or_correct(maths.processed_probs(target_logits[i], params), draft_probs[i], int(token), rng)
        if correction is not None:
            emitted.append(correction)
            return emitted
        emitted.append(int(token))
    emitted.append(maths.select_token(target_logits[len(draft_tokens)], params, rng))
    return emitted
