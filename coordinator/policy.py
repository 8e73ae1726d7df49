"""How many tokens to draft next: the per-request speculation policy.

Rule: draft ``max_window`` tokens per round (the request's cap, itself capped
by the server's ``speculation_window``) while the rolling acceptance rate over
the most recent drafted tokens stays at or above ``fallback_threshold``; once
it falls below (after at least ``min_evidence`` drafted tokens) the request
decodes with the target alone. A draft engine failure also switches the
request to plain decoding, so the request still completes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpeculationPolicy:
    max_window: int
    fallback_threshold: float
    history_tokens: int = 16  # rolling window of drafted tokens the rate is taken over
    min_evidence: int = 8
    fallen_back: bool = False
    reason: str = ""
    _history: deque = field(default_factory=deque, repr=False)

    def window(self) -> int:
        return 0 if self.fallen_back else self.max_window

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self._history.append((drafted, accepted))
        while sum(d for d, _ in self._history) - self._history[0][0] >= self.history_tokens:
            self._history.popleft()
        if self.fallen_back:
            return
        rate = self.recent_acceptance()
        if rate is not None and rate < self.fallback_threshold:
            self.fallen_back = True
            self.reason = f"recent acceptance {rate:.2f} below fallback_threshold {self.fallback_threshold:g}"

    def recent_acceptance(self) -> float | None:
        drafted = sum(d for d, _ in self._history)
        if drafted < self.min_evidence:
            return None
        return sum(a for _, a in self._history) / drafted

    def draft_failed(self, error: BaseException) -> None:
        self.fallen_back = True
        self.reason = f"draft model failed: {error}"
