"""Whether speculation pays at the current load, measured live, server-wide.

A request's cost model compares its own engine calls, which cannot see what
its drafting costs the other requests: with in-flight batching, a stream's
verification rows and the draft's work take forward time and cores from every
other stream. So the server measures its total throughput instead: time is
cut into epochs of ``epoch_seconds`` at one load bucket (requests decoding,
costmodel.load_bucket), each epoch runs one regime for all requests
(speculate, or decode plainly), and the tokens per second every request
emitted together are averaged per (load bucket, regime). The regime of the
next epoch at a load is the one measured faster; the other is tried again
after ``explore_every`` epochs (or while it has fewer than two epochs
measured), so a change of workload is noticed. Each try that loses again
doubles the wait before the next, up to ``max_explore_every`` epochs, and a
try that wins resets it: a tried regime that loses costs its epoch's
throughput (speculating at a load where it serves half the tokens, one epoch
in eleven costs about 5 %, one in 81 under 1 %). A load with nothing measured
yet starts from plain decoding when a lower load has measured plain faster:
what speculation gains shrinks as the batch grows (each added stream makes a
plain forward cheaper per token, and its verification rows and draft calls
take compute the others need), so the first epochs at the higher load are
not spent re-learning the loss; that inherited verdict counts as one lost
try, so speculation is first explored there after twice ``explore_every``
epochs. Static schedules such as
TensorRT-LLM's ``draft_len_schedule`` fix this per batch size in advance;
this one is measured on the machine it runs on. A request decoding alone has
no one to take from, and its own cost model sees every cost: one stream is
not governed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.costmodel import MovingAverage, load_bucket

SPECULATE, PLAIN = "speculate", "plain"
MIN_EPOCHS = 2  # epochs a regime is measured before the other can win against it


@dataclass
class LoadGovernor:
    epoch_seconds: float = 10.0
    explore_every: int = 10
    max_explore_every: int = 80
    clock: Callable[[], float] = time.monotonic
    rates: dict[tuple[int, str], MovingAverage] = field(default_factory=dict)
    regimes: dict[int, str] = field(default_factory=dict)  # the current regime per load bucket
    _since_explore: dict[int, int] = field(default_factory=dict)
    _explore_interval: dict[int, int] = field(default_factory=dict)  # epochs between tries, per load bucket
    _exploring: set[int] = field(default_factory=set)  # load buckets trying the regime measured slower
    _bucket: int | None = None
    _started: float = 0.0
    _tokens: int = 0

    def speculation_allowed(self, streams: int) -> bool:
        return self._regime(load_bucket(streams)) == SPECULATE

    def _regime(self, bucket: int) -> str:
        if bucket in self.regimes:
            return self.regimes[bucket]
        lower = [b for b in self.regimes if b < bucket]
        return PLAIN if lower and self.regimes[max(lower)] == PLAIN and self._measured_plain(max(lower)) else SPECULATE

    def _measured_plain(self, bucket: int) -> bool:
        plain, speculate = self.rates.get((bucket, PLAIN)), self.rates.get((bucket, SPECULATE))
        return (plain is not None and speculate is not None and min(plain.samples, speculate.samples) >= MIN_EPOCHS
                and plain.value > speculate.value)

    def emitted(self, tokens: int, streams: int) -> None:
        """``tokens`` were emitted by one request while ``streams`` requests were decoding."""
        now = self.clock()
        bucket = load_bucket(streams) if streams > 1 else None  # one stream: not governed
        if bucket != self._bucket:  # the load changed: a partial epoch measures nothing
            self._bucket, self._started, self._tokens = bucket, now, 0
        if bucket is None:
            return
        self._tokens += tokens
        elapsed = now - self._started
        if elapsed < self.epoch_seconds:
            return
        if bucket not in self.regimes:
            self.regimes[bucket] = self._regime(bucket)
            if self.regimes[bucket] == PLAIN:  # inherited: speculation waits for its turn to explore
                self._since_explore[bucket] = 0
                self._explore_interval[bucket] = self._longer_interval(bucket)
        regime = self.regimes[bucket]
        self.rates.setdefault((bucket, regime), MovingAverage()).add(self._tokens / elapsed, weight=0.3)
        self.regimes[bucket] = self._next(bucket, regime)
        self._started, self._tokens = now, 0

    def disrupted(self) -> None:
        """An engine failed: the epoch in progress measures the outage, not its
        regime (a target down for a 40 s reload once counted as a speculative
        epoch of almost no tokens, and plain decoding won that load until
        speculation was explored again). The next epoch starts afresh."""
        self._bucket, self._tokens = None, 0

    def rate(self, streams: int, regime: str) -> float | None:
        average = self.rates.get((load_bucket(streams), regime))
        return None if average is None else average.value

    def _next(self, bucket: int, regime: str) -> str:
        other = PLAIN if regime == SPECULATE else SPECULATE
        mine, theirs = self.rates.get((bucket, regime)), self.rates.get((bucket, other))
        if mine is None or mine.samples < MIN_EPOCHS:
            return regime
        if theirs is None and regime == PLAIN and self._since_explore.get(bucket) is not None:
            return self._count_towards_exploring(bucket, regime, other)  # inherited plain
        if theirs is None or theirs.samples < MIN_EPOCHS:
            return other
        best = regime if mine.value >= theirs.value else other
        if bucket in self._exploring:  # this epoch tried the regime that was slower
            self._exploring.discard(bucket)
            self._explore_interval[bucket] = (self._longer_interval(bucket) if best == other
                                              else self.explore_every)
        return self._count_towards_exploring(bucket, regime, other) if best == regime else best

    def _longer_interval(self, bucket: int) -> int:
        return min(2 * self._explore_interval.get(bucket, self.explore_every), self.max_explore_every)

    def _count_towards_exploring(self, bucket: int, regime: str, other: str) -> str:
        explored = self._since_explore.get(bucket, 0) + 1
        self._since_explore[bucket] = explored
        if explored >= self._explore_interval.get(bucket, self.explore_every):
            self._since_explore[bucket] = 0
            self._exploring.add(bucket)
            return other
        return regime
