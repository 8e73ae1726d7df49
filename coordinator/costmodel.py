"""When speculation pays, and with which window: the cost model.

A round that drafts K tokens costs the draft call d(K) plus the target's
verify call v(K); it emits on average E(K) tokens. Plain decoding emits one
token per target step of cost t. Measured in plain steps (c = draft cost per
drafted token, v(K) = verify cost relative to one plain step):

    E(K) = (1 - a^(K+1)) / (1 - a)          (a: per-token acceptance, i.i.d. model)
    speed-up(K) = E(K) / (K c + v(K))

The coordinator keeps moving averages of d(K), v(K) and t from the engine
calls it times (server-wide), and picks the K in 1..max_window with the best
predicted speed-up, or plain decoding when none beats 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# Before anything is measured: a draft step costs this fraction of a target
# step and verifying K tokens costs one target step (memory-bound engines).
PRIOR_DRAFT_COST = 0.3
PRIOR_VERIFY_COST = 1.0
EWMA_WEIGHT = 0.1  # weight of a new sample in the moving averages (~10 recent calls)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E(K): tokens a round of K drafts emits (accepted prefix + 1)."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """E(K) / (K c + v(K)); costs in units of one plain target step."""
    if k <= 0:
        return 1.0
    return expected_tokens_per_round(alpha, k) / (k * draft_cost + verify_cost)


def acceptance_from_rounds(accepted: int, rejections: int) -> float | None:
    """Maximum-likelihood per-token acceptance a from rounds.

    Each draft token is tried until the first rejection, so a round of K
    drafts with j accepted is j successes and (j < K) one failure; tokens
    after a rejection were never tried and do not count.
    """
    trials = accepted + rejections
    return accepted / trials if trials else None


@dataclass
class MovingAverage:
    value: float | None = None
    samples: int = 0

    def add(self, sample: float, weight: float = EWMA_WEIGHT) -> None:
        self.samples += 1
        # the first samples count fully, so a cold start converges quickly
        w = max(weight, 1.0 / self.samples)
        self.value = sample if self.value is None else (1 - w) * self.value + w * sample


@dataclass
class CostModel:
    """Server-wide engine timings (seconds), shared by all requests."""

    plain_step: MovingAverage = field(default_factory=MovingAverage)
    draft: dict[int, MovingAverage] = field(default_factory=dict)  # draft call seconds per K
    verify: dict[int, MovingAverage] = field(default_factory=dict)  # verify call seconds per K
    # Server-wide acceptance: moving averages of accepted drafts and of trials
    # (accepted + rejections) per round; the prior of every new request.
    accepted: MovingAverage = field(default_factory=MovingAverage)
    trials: MovingAverage = field(default_factory=MovingAverage)

    def observe_acceptance(self, accepted: int, rejected: bool) -> None:
        self.accepted.add(accepted)
        self.trials.add(accepted + int(rejected))

    def server_acceptance(self, default: float) -> float:
        if not self.trials.value:
            return default
        return self.accepted.value / self.trials.value

    def observe_plain(self, seconds: float) -> None:
        self.plain_step.add(seconds)

    def observe_draft(self, drafted: int, seconds: float) -> None:
        if drafted > 0:
            self.draft.setdefault(drafted, MovingAverage()).add(seconds)

    def observe_verify(self, drafted: int, seconds: float) -> None:
        if drafted > 0:
            self.verify.setdefault(drafted, MovingAverage()).add(seconds)

    def _plain_seconds(self) -> float | None:
        if self.plain_step.value is not None:
            return self.plain_step.value
        # Never decoded plainly yet: the cheapest verify is the closest stand-in.
        measured = [m.value for m in self.verify.values() if m.value is not None]
        return min(measured) if measured else None

    def draft_cost(self, k: int) -> float:
        """c at window K: draft call seconds per drafted token over one plain step.

        The draft call has a fixed part (catching up on the tokens accepted in
        the previous round), so c is kept per K; an unmeasured K borrows the
        per-token cost of the nearest measured one.
        """
        plain = self._plain_seconds()
        measured = _values(self.draft)
        if plain is None or not measured:
            return PRIOR_DRAFT_COST
        nearest = _nearest(measured, k)
        return measured[nearest] / nearest / plain

    def verify_cost(self, k: int) -> float:
        """v(K): verify seconds over one plain step (nearest measured K when K is not)."""
        plain = self._plain_seconds()
        measured = _values(self.verify)
        if plain is None or not measured:
            return PRIOR_VERIFY_COST
        return max(measured[_nearest(measured, k)] / plain, 1e-3)

    def best_window(self, alpha: float, max_window: int) -> tuple[int, float]:
        """(K, predicted speed-up) of the best window in 1..max_window; (0, 1.0) if none beats 1."""
        best_k, best = 0, 1.0
        for k in range(1, max_window + 1):
            speedup = predicted_speedup(alpha, k, self.draft_cost(k), self.verify_cost(k))
            if speedup > best + 1e-9:
                best_k, best = k, speedup
        return best_k, best

    def snapshot(self, windows: Iterable[int]) -> dict[str, float]:
        """Current c and v(K) (for metrics and logs)."""
        out: dict[str, float] = {}
        for k in windows:
            out[f"draft_cost_{k}"] = self.draft_cost(k)
            out[f"verify_cost_{k}"] = self.verify_cost(k)
        return out


def _values(averages: dict[int, MovingAverage]) -> dict[int, float]:
    return {k: m.value for k, m in averages.items() if m.value is not None}


def _nearest(measured: dict[int, float], k: int) -> int:
    return min(measured, key=lambda n: (abs(n - k), n))

