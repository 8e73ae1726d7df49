"""What a tensorrtllm-backend engine does with one request, given its model's
logits: the CPU engine and the tests' toy engines share this, so the only
engines the tests run behave as TensorRT-LLM does where the coordinator can
tell the difference.

* The end token is neither returned nor counted in ``sequence_length``
  (TensorRT-LLM's sampling kernels do not advance the sequence length when
  the end id is drawn): a call whose first new token is the end returns no
  token at all.
* Random numbers come from the call's own seed, drawn in order (one curand
  state initialised from ``random_seed`` per request).
* ``draft_logits`` are read as q = softmax(draft_logits), with no
  temperature or top-k/top-p; those process the target's logits only.
* With k draft tokens the call returns the accepted prefix plus one token of
  the target's own (the correction or the bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.sampling import SamplingParams, call_rng, select_token, softmax, verify_by_matching, verify_by_rejection


@dataclass(frozen=True)
class CallResult:
    tokens: list[int]  # what output_ids/sequence_length carry: the end token excluded
    logits: list[np.ndarray]  # one row per returned token
    fed: int  # how many of ``tokens`` went through the model (their KV is in the cache)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def before_end(tokens: Sequence[int], end_ids: Collection[int]) -> list[int]:
    """``tokens`` up to (not including) the first end token."""
    out = []
    for token in tokens:
        if token in end_ids:
            break
        out.append(int(token))
    return out


def generate(
    step: Callable[[int], np.ndarray],
    last_input: int,
    max_new_tokens: int,
    params: SamplingParams,
    end_id: int | None,
) -> CallResult:
    """Plain decoding: ``step(token)`` feeds one token and returns the logits
    of the next position; the first call feeds the prompt's last token."""
    rng = call_rng(params.seed)
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    feed = int(last_input)
    for _ in range(max_new_tokens):
        logits = step(feed)
        token = select_token(logits, params, rng)
        if token == end_id:
            return CallResult(tokens, rows, fed=len(tokens))
        tokens.append(token)
        rows.append(logits)
        feed = token
    return CallResult(tokens, rows, fed=len(tokens) - 1)


def verify(
    target_logits: np.ndarray,
    draft_tokens: Sequence[int],
    draft_logits: np.ndarray | None,
    max_new_tokens: int,
    params: SamplingParams,
    end_id: int | None,
) -> CallResult:
    """Verification of k draft tokens from the target's logits [k + 1, vocab]
    (row i predicts the position of draft token i; row k the bonus)."""
    rng = call_rng(params.seed)
    drafts = [int(t) for t in draft_tokens]
    if draft_logits is None:
        emitted = verify_by_matching(target_logits, drafts, params, rng)
    else:
        q = np.stack([softmax(row) for row in np.asarray(draft_logits)])
        emitted = verify_by_rejection(target_logits, q, drafts, params, rng)
    tokens = before_end(emitted[:max_new_tokens], () if end_id is None else (end_id,))
    fed = common_prefix_length(tokens, drafts)  # accepted drafts went through the forward pass
    return CallResult(tokens, [np.asarray(row) for row in target_logits[: len(tokens)]], fed)
