"""Deterministic toy engines for testing the loop without models or Triton."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from coordinator.loop import EngineOutput
from coordinator.sampling import SamplingParams, select_token, verify_by_matching, verify_by_rejection

VOCAB = 50


def toy_logits(context: Sequence[int], salt: int = 0) -> np.ndarray:
    """A fixed pseudo-random next-token distribution for a context."""
    rng = np.random.default_rng([salt, len(context), *context[-3:]])
    return rng.normal(0.0, 3.0, VOCAB)


class ToyEngine:
    """Implements the loop's Engine protocol with tensorrtllm semantics."""

    def __init__(self, logits_fn: Callable[[Sequence[int]], np.ndarray] = toy_logits, end_id: int | None = None):
        self.logits_fn = logits_fn
        self.end_id = end_id
        self.calls: list[tuple[int, int]] = []  # (max_new_tokens, number of draft tokens)
        self.fail_with: Exception | None = None
        self.received_draft_logits: list[np.ndarray] = []

    async def generate(
        self, input_ids, max_new_tokens, sampling: SamplingParams, draft_tokens=(), draft_logits=None,
        return_logits=False,
    ):
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append((max_new_tokens, len(draft_tokens)))
        context = list(input_ids)
        if draft_tokens:
            rows = np.stack([self.logits_fn(context + list(draft_tokens[:i])) for i in range(len(draft_tokens) + 1)])
            if draft_logits is not None:
                self.received_draft_logits.append(np.asarray(draft_logits))
                tokens = verify_by_rejection(rows, np.asarray(draft_logits), list(draft_tokens), sampling, len(context))
            else:
                tokens = verify_by_matching(rows, list(draft_tokens), sampling, len(context))
            tokens = _cut(tokens[:max_new_tokens], self.end_id)
            return EngineOutput(tokens, rows[: len(tokens)] if return_logits else None)
        out: list[int] = []
        rows = []
        for step in range(max_new_tokens):
            logits = self.logits_fn(context + out)
            rows.append(logits)
            token = select_token(logits, sampling, len(context) + step)
            out.append(token)
            if token == self.end_id:
                break
        return EngineOutput(out, np.stack(rows) if return_logits else None)


def _cut(tokens: list[int], end_id: int | None) -> list[int]:
    if end_id is not None and end_id in tokens:
        return tokens[: tokens.index(end_id) + 1]
    return tokens


def noisy(logits_fn, flip_every: int, salt: int = 7):
    """A draft that agrees with ``logits_fn`` except at every ``flip_every``-th context length."""

    def draft_logits(context):
        if flip_every and len(context) % flip_every == 0:
            return toy_logits(context, salt)
        return logits_fn(context)

    return draft_logits
