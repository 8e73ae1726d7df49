"""A cheap deterministic synthetic language model over a real vocabulary size.

Each position's row is a small support of ``SUPPORT`` tokens with descending
logits, every other token at ``BACKGROUND`` (probability 0 in float32 after
softmax): a function of the position and the last three tokens only, so
computing it costs a few hashes. The target's greedy token is its top token.
The draft's row at the same context has the target's top token first with
probability ``agreement`` (independently per position: a hash of the context
decides), else second with probability ``second_choice``, else third; its
logits carry their own noise, so sampled drafting has q != p.

``row(context)`` gives (tokens, logits) of the support; ``full_row`` the
float32 row over the whole vocabulary, as ``generation_logits`` carry it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SUPPORT = 8
BACKGROUND = -1.0e4
# Descending base logits of the support (gaps >= 0.5, noise < 0.4 keeps the order).
_BASE = (3.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5)
_MASK = (1 << 64) - 1
_DRAFT_SALT = 0x9E3779B97F4A7C15
# Tokens the synthetic text uses, for real vocabularies: below the special tokens
# (Qwen2.5's start at 151643), so the text never ends early on an end token.
REAL_VOCAB_TOKENS = 150_000


def _mix(x: int) -> int:
    """splitmix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniform(x: int) -> float:
    return (x >> 11) * (1.0 / (1 << 53))


class SyntheticLM:
    def __init__(self, vocab_size: int, role: str, agreement: float = 0.8, second_choice: float = 0.5,
                 salt: int = 0):
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be at least 3, got {vocab_size}")
        self.vocab_size = vocab_size
        self.tokens = vocab_size if vocab_size < 1000 else min(vocab_size, REAL_VOCAB_TOKENS)
        self.support = min(SUPPORT, self.tokens)
        self.draft = role == "draft"
        self.agreement = agreement
        self.second_choice = second_choice
        self.salt = salt
        self._cache: dict[tuple, tuple[tuple[int, ...], tuple[float, ...]]] = {}

    def _key(self, context: Sequence[int]) -> int:
        n = len(context)
        h = _mix(self.salt ^ n)
        for i in (1, 2, 3):
            h = _mix(h ^ (int(context[n - i]) if n >= i else 0x5151))
        return h

    def row(self, context: Sequence[int]) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The support's tokens and logits after ``context``, highest first."""
        key = self._key(context)
        cached = self._cache.get((key, self.draft))
        if cached is not None:
            return cached
        tokens: list[int] = []
        h = key
        while len(tokens) < self.support:
            h = _mix(h)
            token = h % self.tokens
            if token not in tokens:
                tokens.append(token)
        if self.draft:
            u = _mix(key ^ _DRAFT_SALT)
            if _uniform(u) >= self.agreement:  # the target's top token is not the draft's
                where = 1 if _uniform(_mix(u)) < self.second_choice else 2
                top = tokens.pop(0)
                tokens.insert(min(where, len(tokens)), top)
            h = _mix(key ^ _DRAFT_SALT ^ 0xD1B54A32D192ED03)
        logits = []
        for i in range(self.support):
            h = _mix(h)
            logits.append(_BASE[i] + 0.4 * _uniform(h))
        result = (tuple(tokens), tuple(logits))
        if len(self._cache) > 65536:
            self._cache.clear()
        self._cache[(key, self.draft)] = result
        return result

    def greedy(self, context: Sequence[int]) -> int:
        return self.row(context)[0][0]

    def full_row(self, context: Sequence[int]) -> np.ndarray:
        tokens, logits = self.row(context)
        out = np.full(self.vocab_size, BACKGROUND, dtype=np.float32)
        out[list(tokens)] = logits
        return out
