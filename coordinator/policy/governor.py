"""Whether speculation pays at the current load, measured live, server-wide.

A request's cost model compares its own engine calls, which cannot see what
its drafting costs the other requests: with in-flight batching, a stream's
verification rows and the draft's work take forward time and cores from every
other stream. So the server measures its total throughput instead: time is cut
into epochs of ``epoch_seconds`` at one load bucket (requests decoding,
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
yet starts from plain decoding when the nearest lower load that measured both
regimes found plain faster: what speculation gains shrinks as the batch grows
(each added stream makes a plain forward cheaper per token, and its
verification rows and draft calls take compute the others need), so the first
epochs at the higher load are not spent re-learning the loss; that inherited
verdict counts as one lost try, so speculation is first explored there after
twice ``explore_every`` epochs. Before either, a load with nothing measured is
priced by the batch forecast (coordinator/policy/batchcost.py: the engines'
forward costs as functions of rows, fitted at the loads seen so far), so a
burst at a new load starts in the regime predicted faster (fixed when its
first request asks, so its first epoch is booked under the regime it ran); a forecast of
plain counts as a lost try too, and the epochs then correct the forecast: at
this load by measuring it, and at every other by calibrating each regime's
forecast with the ratio its epochs measured against it (``predicted``). An epoch's clock stops while a prompt's
prefill runs (from a request's arrival to its first token): a prefill decodes
nothing whatever the regime, so counted it would decide by which epochs the
arrivals land in. Static schedules such as TensorRT-LLM's
``draft_len_schedule`` fix this per batch size in advance; this one is
measured on the machine it runs on. A request decoding alone has no one to
take from, and its own cost model sees every cost: one stream is not governed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from coordinator.policy.batchcost import Forecast
from coordinator.policy.costmodel import MovingAverage, load_bucket, load_label

log = logging.getLogger(__name__)

SPECULATE, PLAIN = "speculate", "plain"
EPOCH_ERRORS_KEPT = 256  # epochs' forecast errors held for the metrics (a governor without them keeps the last)
MIN_EPOCHS = 2  # epochs a regime is measured before the other can win against it
# What an uncalibrated speculative forecast must beat plain decoding's by: the accuracy
# the calibrated forecast is held to. What the raw model leaves out (batchcost.py) only
# slows speculation.
UNCALIBRATED_MARGIN = 0.15


@dataclass
class LoadGovernor:
    epoch_seconds: float = 10.0
    explore_every: int = 10
    max_explore_every: int = 80
    clock: Callable[[], float] = time.monotonic
    # What a batch of N streams is predicted to serve in each regime (None: not yet priced).
    forecast: Callable[[int], Forecast | None] | None = None
    rates: dict[tuple[int, str], MovingAverage] = field(default_factory=dict)
    regimes: dict[int, str] = field(default_factory=dict)  # the current regime per load bucket
    _since_explore: dict[int, int] = field(default_factory=dict)
    _explore_interval: dict[int, int] = field(default_factory=dict)  # epochs between tries, per load bucket
    _exploring: set[int] = field(default_factory=set)  # load buckets trying the regime measured slower
    _bucket: int | None = None
    _counted: float = 0.0  # seconds of the epoch so far with no prompt prefill running
    _resumed: float | None = None  # when the epoch's clock last (re)started; None while a prefill pauses it
    _cut: float = 0.0  # when the clock last resumed after a pause or a change of load
    _prefills: int = 0  # prompt prefills running
    _tokens: float = 0.0
    # Per regime, what its epochs measured over what the raw forecast predicted for
    # them: the calibration that carries to loads not measured yet (batchcost.py).
    calibration: dict[str, MovingAverage] = field(default_factory=dict)
    # Per regime, the last epoch's calibrated prediction over its measurement, minus 1.
    forecast_error: dict[str, float] = field(default_factory=dict)
    # Every epoch's (regime, error) since the metrics last took them: the error's spread over a run.
    epoch_errors: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=EPOCH_ERRORS_KEPT))

    def speculation_allowed(self, streams: int) -> bool:
        """The regime of the load's epoch under way. A load's first verdict is fixed
        when a request first asks and there is something to price it with: its
        first epoch is then measured under the regime its requests were told.
        Priced again when that epoch ended, a forecast that had moved meanwhile
        (it learns from every round) once booked a plain epoch, all of its
        requests held back, as speculation's, and the next epoch speculated
        at a load where speculation lost."""
        bucket = load_bucket(streams)
        if bucket in self.regimes or streams <= 1:
            return self.regimes.get(bucket, SPECULATE) == SPECULATE
        verdict = self._priced(bucket, streams)
        if verdict is None:  # nothing to price it with yet: speculate, and ask again next time
            return True
        self._start(bucket, verdict)
        return verdict == SPECULATE

    def _start(self, bucket: int, regime: str) -> None:
        """A load's first regime; a plain start (inherited or forecast) counts as a
        lost try of speculation, which then waits for its turn to explore."""
        self.regimes[bucket] = regime
        if regime == PLAIN:
            self._since_explore[bucket] = 0
            self._explore_interval[bucket] = self._longer_interval(bucket)

    def _priced(self, bucket: int, streams: int) -> str | None:
        """A load's first regime: the forecast's verdict, else that of the nearest
        lower load that measured both regimes (one that only inherited its plain
        start has no verdict of its own); None with neither."""
        forecast = self._forecast(streams)
        if forecast is not None:
            return self._forecast_verdict(forecast)
        for lower in range(bucket - 1, -1, -1):
            verdict = self._measured_faster(lower)
            if verdict is not None:
                return verdict
        return None

    def predicted(self, streams: int) -> Forecast | None:
        """The batch forecast at ``streams`` streams, each regime calibrated by its epochs so far."""
        raw = self.forecast(max(1, streams)) if self.forecast is not None else None
        return None if raw is None else self._calibrated(raw)

    def _calibrated(self, raw: Forecast) -> Forecast:
        factor = {regime: self.calibration[regime].value if regime in self.calibration else 1.0
                  for regime in (PLAIN, SPECULATE)}
        return raw.scaled(plain=factor[PLAIN], speculative=factor[SPECULATE])

    def _forecast_verdict(self, forecast: Forecast) -> str:
        """The regime a forecast starts a load in. Until speculation's own epochs have
        calibrated it, its forecast must beat plain decoding's by UNCALIBRATED_MARGIN: the
        raw model leaves out only what slows speculation (streams out of step, engines
        contending for cores), so its error runs one way."""
        if SPECULATE in self.calibration:
            return forecast.faster
        return SPECULATE if forecast.speculative > forecast.plain * (1 + UNCALIBRATED_MARGIN) else PLAIN

    def _forecast(self, streams: int) -> Forecast | None:
        return self.predicted(streams) if streams > 1 else None

    def _calibrate(self, streams: int, regime: str, rate: float) -> None:
        """Score the calibrated forecast against an epoch's measured ``rate``, then learn from it."""
        raw = self.forecast(streams) if self.forecast is not None else None
        if raw is None or rate <= 0 or raw.rate(regime) <= 0:
            return
        self.forecast_error[regime] = self._calibrated(raw).rate(regime) / rate - 1.0
        self.epoch_errors.append((regime, self.forecast_error[regime]))
        self.calibration.setdefault(regime, MovingAverage()).add(rate / raw.rate(regime), weight=0.3)

    def take_epoch_errors(self) -> list[tuple[str, float]]:
        """The (regime, forecast error) of every epoch scored since the last call."""
        taken = list(self.epoch_errors)
        self.epoch_errors.clear()
        return taken

    def _measured_faster(self, bucket: int) -> str | None:
        plain, speculate = self.rates.get((bucket, PLAIN)), self.rates.get((bucket, SPECULATE))
        if plain is None or speculate is None or min(plain.samples, speculate.samples) < MIN_EPOCHS:
            return None
        return PLAIN if plain.value > speculate.value else SPECULATE

    def prefill_started(self) -> None:
        """A request arrived: its prompt's prefill runs until its first token.
        The epoch's clock stops meanwhile (prefill_ended): a prefill serves no
        decoded token for seconds whatever the regime, and which epochs it
        lands in is chance (one 4-stream epoch that began with four prefills
        read 3.5 tokens/s, its neighbours 9.3), so epochs compare the regimes'
        decoding, the draft's catch-up on a prompt included, not the luck of
        the arrivals."""
        self._pause()
        self._prefills += 1

    def prefill_ended(self) -> None:
        """The prefill of a request's prompt ended (its first token, or the request ended first)."""
        self._prefills = max(0, self._prefills - 1)
        if self._prefills == 0 and self._resumed is None:
            self._resumed = self._cut = self.clock()

    @property
    def prompts_prefilling(self) -> int:
        """Requests whose prompt is still prefilling (arrived, no first token yet)."""
        return self._prefills

    def _pause(self) -> None:
        if self._resumed is not None:
            self._counted += self.clock() - self._resumed
            self._resumed = None

    def emitted(self, tokens: int, streams: int, seconds: float = 0.0) -> None:
        """``tokens`` were emitted by one request's decoding step that took ``seconds``,
        while ``streams`` requests were running (a request's first token belongs to
        its prefill: prefill_ended, not here)."""
        now = self.clock()
        bucket = load_bucket(streams) if streams > 1 else None  # one stream: not governed
        if bucket != self._bucket:  # the load changed: a partial epoch measures nothing
            self._bucket, self._counted, self._tokens = bucket, 0.0, 0.0
            self._resumed = self._cut = now if self._prefills == 0 else None
        if bucket is None or self._resumed is None:  # not governed, or a prefill stops the clock
            return
        since_cut = now - self._cut
        # a step that began before the clock resumed counts for its share after
        self._tokens += tokens if seconds <= since_cut else tokens * since_cut / seconds
        elapsed = self._counted + now - self._resumed
        if elapsed < self.epoch_seconds:
            return
        if bucket not in self.regimes:  # nothing priced this load while its requests asked: they speculated
            self._start(bucket, SPECULATE)
        regime = self.regimes[bucket]
        rate = self._tokens / elapsed
        self._calibrate(streams, regime, rate)
        self.rates.setdefault((bucket, regime), MovingAverage()).add(rate, weight=0.3)
        self.regimes[bucket] = self._next(bucket, regime)
        log.log(logging.INFO if self.regimes[bucket] != regime else logging.DEBUG,
                "load %s: a %s epoch served %.2f tokens/s (%s); next epoch: %s", load_label(bucket), regime,
                rate, self._summary(bucket), self.regimes[bucket])
        self._counted, self._resumed, self._tokens = 0.0, now, 0.0

    def _summary(self, bucket: int) -> str:
        averages = ((regime, self.rates.get((bucket, regime))) for regime in (SPECULATE, PLAIN))
        return ", ".join(f"{regime} {average.value:.2f} over {average.samples} epochs"
                         for regime, average in averages if average is not None)

    def disrupted(self) -> None:
        """An engine failed: the epoch in progress measures the outage, not its
        regime (a target down for a 40 s reload once counted as a speculative
        epoch of almost no tokens, and plain decoding won that load until
        speculation was explored again). The next epoch starts afresh."""
        self._bucket, self._counted, self._tokens = None, 0.0, 0.0

    def why_plain(self, streams: int) -> str:
        """What a request held back at ``streams`` streams is told (its fallback_reason)."""
        bucket = load_bucket(streams)
        plain, speculate = self.rate(streams, PLAIN), self.rate(streams, SPECULATE)
        forecast = self._forecast(streams)
        if plain is not None and speculate is not None:
            measured = f"plain decoding measured {plain:.2f} tokens/s against speculation's {speculate:.2f}"
        elif forecast is not None:
            measured = (f"the engines' forward costs and the coordinator's CPU predict plain decoding "
                        f"{forecast.plain:.2f} tokens/s "
                        f"against speculation's {forecast.speculative:.2f} at {forecast.streams} streams "
                        f"(not measured at this load yet)")
            if forecast.speculative >= forecast.plain:  # plain all the same: say why
                measured += ("; the load started plain when it was first priced, and "
                             "speculation is tried in its turn" if bucket in self.regimes else
                             f"; until its epochs have calibrated the forecast, speculation must be predicted "
                             f"{UNCALIBRATED_MARGIN:.0%} faster")
        else:
            measured = "plain decoding measured faster at a lower load"
        return f"the load governor holds speculation back at {load_label(bucket)} streams: {measured}"

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
        if best == regime:
            return self._count_towards_exploring(bucket, regime, other)
        self._since_explore[bucket] = 0  # the other regime leads now: its wait before a try starts afresh
        return best

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
