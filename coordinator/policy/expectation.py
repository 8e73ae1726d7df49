"""Tokens a speculative round emits: the one formula that every price of
speculation (a request's window, the batch forecast, the ceiling tool) uses."""

from __future__ import annotations


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E(K): tokens a round of K drafts emits (accepted prefix + 1), each
    draft accepted with probability ``alpha`` independently (the i.i.d. model)."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
