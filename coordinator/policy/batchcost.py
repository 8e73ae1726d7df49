"""What the whole batch serves at a load, predicted from the engines' forward costs.

A request's cost model (costmodel.py) prices its own rounds, and the load
governor (governor.py) measures what the batch serves by trying each regime.
Neither can price a load that has not been seen: a burst, a new level of
traffic, a restarted or freshly scaled replica. This forecast can. It models
each engine's forward as

    seconds(rows) = fixed + per_row * rows

fitted by least squares to the forwards timed so far at every load (``rows``:
the rows the batch carried, the streams times the rows each one sent), and
prices a batch of N streams at per-token acceptance a, for the best window K:

    plain:        N / T(N)                                        tokens per second
    speculative:  N E(a, K) / (G (K D(N/G) + T(N/G (K + 1))))     G = 2 groups (1 alone)

where T is the target's forward, D the draft's, and E(a, K) the tokens a
round emits (expectation.py). The engines take turns on the same cores (the
same GPU), so a round costs the draft's K forwards plus the target's one.
Speculating streams do not stay in step: each request drives its own rounds,
so while some draft the others verify, and each engine's forward carries
about half the batch. The forecast takes the batch as two such groups, each
paying its forwards' fixed costs, which is where batching's gain goes.
Priced as one batch in step instead, the forecast ran far above what the
engines served: on a 2-vCPU Intel Xeon with AMX it read 9.5 tokens/s at 2
streams where epochs measured 5.8-6.2 (two groups: the one-stream rate, 6.6
measured on the same machine); in the sim profile (preset h100-8b-1b, same
machine) fixed windows of 4 at 8 streams served 0.90-0.97x the default
requests (nearly all plain) where one batch in step priced them 1.7x plain
decoding (two groups: 0.91x). Memory-bound forwards have a small ``per_row`` and
speculation's extra rows ride along; compute-bound ones (a CPU, a large
batch on a GPU) pay for every row, and the forecast says when that makes
plain decoding the faster regime.

What the model still leaves out (how far out of step a batch really runs;
engines that overlap where they do not share a device, as the sim's sleeping
ones do) the governor learns: it calibrates each regime's forecast by what
its epochs measured against it (governor.py), and the calibrated figure
prices the loads not measured yet.
The draft's fit needs two row counts; with one, its forward is taken to
grow with rows as the target's does. A forecast is a prediction: the
metrics show it beside what the governor measures, and the governor's
trial epochs correct it.

The engines are not the only bound. The coordinator is one Python process
whose rounds run under one interpreter lock: it emits at most
CPU_CAPACITY / (CPU per speculative round) rounds per second, and plain
tokens at most CPU_CAPACITY / (CPU per plain token), whatever the engines
could serve. Where forwards take milliseconds (a GPU) and a round costs the
coordinator a few milliseconds of CPU, that bound comes first at a load of
a few tens of streams, and it comes sooner for speculation (two engine calls
and a verification's bookkeeping a round) than for plain decoding (one
streamed response a token). ``CpuFit`` measures both costs while serving
(the process's CPU time against the rounds and plain tokens of each
interval) and each regime's forecast is capped by its bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from coordinator.policy.expectation import expected_tokens_per_round

# Weight that every earlier sample keeps when a new one arrives: the fit follows
# the last few hundred forwards, so it tracks a machine whose speed changes.
DECAY = 0.995
# Row counts closer than this (in weighted spread) cannot tell a slope from noise.
MIN_ROW_SPREAD = 0.25
# CPU seconds per second the coordinator's process can spend on rounds: its Python
# runs under one interpreter lock, so about one core whatever the host has.
CPU_CAPACITY = 1.0
# Speculating streams run in this many groups out of step (some draft while the others verify).
OUT_OF_STEP_GROUPS = 2
# Below this (relative) determinant the intervals' mixes of speculative rounds and
# plain tokens are too alike to tell their costs apart.
MIN_MIX_SPREAD = 0.05


@dataclass
class ForwardFit:
    """seconds = fixed + per_row * rows, by recency-weighted least squares."""

    weight: float = 0.0
    rows: float = 0.0
    seconds: float = 0.0
    rows_squared: float = 0.0
    rows_seconds: float = 0.0
    samples: int = 0
    # The per-row cost of the last fit whose row counts were spread enough. Serving
    # one load for a while (one stream decoding plainly: 1 row a forward, hundreds
    # of times) decays the other row counts away, start-up profile's included, and
    # without it the forecast went blank until a verification was timed again.
    slope: float | None = None

    def add(self, rows: float, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        d = DECAY
        self.weight = d * self.weight + 1.0
        self.rows = d * self.rows + rows
        self.seconds = d * self.seconds + seconds
        self.rows_squared = d * self.rows_squared + rows * rows
        self.rows_seconds = d * self.rows_seconds + rows * seconds
        self.samples += 1
        fitted = self._least_squares()
        if fitted is not None:
            self.slope = fitted[1]

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_row); None before two row counts far enough apart were seen.
        Where the recent samples share one row count, the last spread fit's slope
        through their mean: the level follows the machine, the slope is the last known."""
        fitted = self._least_squares()
        if fitted is not None or self.slope is None:
            return fitted
        mean_rows, mean_seconds = self.mean()
        return max(mean_seconds - self.slope * mean_rows, 0.0), self.slope

    def _least_squares(self) -> tuple[float, float] | None:
        if self.weight <= 0:
            return None
        mean_rows = self.rows / self.weight
        mean_seconds = self.seconds / self.weight
        spread = self.rows_squared / self.weight - mean_rows * mean_rows
        if spread < MIN_ROW_SPREAD:
            return None
        per_row = (self.rows_seconds / self.weight - mean_rows * mean_seconds) / spread
        per_row = max(per_row, 0.0)  # more rows never make a forward faster; noise can say so
        fixed = mean_seconds - per_row * mean_rows
        if fixed < 0:  # through the origin instead: all the time is per row
            fixed, per_row = 0.0, self.rows_seconds / self.rows_squared
        return fixed, per_row

    def mean(self) -> tuple[float, float] | None:
        """(rows, seconds) averaged over the samples; None before any."""
        if self.weight <= 0:
            return None
        return self.rows / self.weight, self.seconds / self.weight

    def predict(self, rows: float) -> float | None:
        line = self.line()
        return None if line is None else line[0] + line[1] * rows


@dataclass
class CpuFit:
    """cpu = per_round * speculative_rounds + per_token * plain_tokens over intervals of
    serving, by recency-weighted least squares (no intercept: an idle coordinator costs
    next to nothing)."""

    rr: float = 0.0  # sums of rounds^2, rounds*tokens, tokens^2, rounds*cpu, tokens*cpu
    rt: float = 0.0
    tt: float = 0.0
    rc: float = 0.0
    tc: float = 0.0
    samples: int = 0

    def add(self, cpu_seconds: float, rounds: int, plain_tokens: int) -> None:
        if cpu_seconds < 0 or rounds + plain_tokens <= 0:
            return
        d = DECAY
        self.rr = d * self.rr + rounds * rounds
        self.rt = d * self.rt + rounds * plain_tokens
        self.tt = d * self.tt + plain_tokens * plain_tokens
        self.rc = d * self.rc + rounds * cpu_seconds
        self.tc = d * self.tc + plain_tokens * cpu_seconds
        self.samples += 1

    def costs(self) -> tuple[float | None, float | None]:
        """(CPU seconds per speculative round, per plain token); None where the
        intervals seen cannot tell it (a regime not run, or always run in one mix)."""
        determinant = self.rr * self.tt - self.rt * self.rt
        if self.rr > 0 and self.tt > 0 and determinant > MIN_MIX_SPREAD * self.rr * self.tt:
            per_round = (self.tt * self.rc - self.rt * self.tc) / determinant
            per_token = (self.rr * self.tc - self.rt * self.rc) / determinant
            return (per_round if per_round > 0 else None), (per_token if per_token > 0 else None)
        # one regime alone: its cost is known only where the other never ran
        if self.rr > 0 and self.tt == 0:
            return self.rc / self.rr, None
        if self.tt > 0 and self.rr == 0:
            return None, self.tc / self.tt
        return None, None


@dataclass(frozen=True)
class Forecast:
    """Predicted tokens per second the whole batch emits in each regime."""

    streams: int
    plain: float
    speculative: float
    window: int  # the window the speculative figure drafts (0: none beats plain)
    plain_step: float  # predicted seconds of one plain forward of the batch

    @property
    def faster(self) -> str:
        return "speculate" if self.speculative > self.plain else "plain"

    def rate(self, regime: str) -> float:
        return self.speculative if regime == "speculate" else self.plain

    def scaled(self, plain: float, speculative: float) -> Forecast:
        """This forecast with each regime's rate multiplied by its factor (the governor's calibration)."""
        return replace(self, plain=self.plain * plain, speculative=self.speculative * speculative)


@dataclass
class BatchForecaster:
    """The engines' forward fits, fed by the cost model, and the batch forecast."""

    target: ForwardFit
    draft: ForwardFit
    cpu: CpuFit = field(default_factory=CpuFit)

    @classmethod
    def empty(cls) -> BatchForecaster:
        return cls(ForwardFit(), ForwardFit())

    def observe_target(self, rows: float, seconds: float) -> None:
        self.target.add(rows, seconds)

    def observe_draft(self, rows: float, seconds: float) -> None:
        self.draft.add(rows, seconds)

    def draft_seconds(self, rows: float) -> float | None:
        predicted = self.draft.predict(rows)
        if predicted is not None:
            return predicted
        measured = self.draft.mean()
        if measured is None:
            return None
        # One row count measured: grow it with rows as the target's forward grows.
        at_measured, at_rows = self.target.predict(measured[0]), self.target.predict(rows)
        if at_measured is None or at_rows is None or at_measured <= 0:
            return None
        return measured[1] * at_rows / at_measured

    def forecast(self, streams: int, acceptance: float, max_window: int) -> Forecast | None:
        """The batch of ``streams`` streams at per-token ``acceptance``, windows 1..max_window;
        None while either engine's forward cost is unknown."""
        streams = max(1, streams)
        groups = OUT_OF_STEP_GROUPS if streams > 1 else 1
        in_step = streams / groups  # the streams each forward carries
        plain_step = self.target.predict(streams)
        draft_step = self.draft_seconds(in_step)
        if plain_step is None or draft_step is None or plain_step <= 0:
            return None
        per_round, per_token = self.cpu.costs()
        best_window, best = 0, 0.0
        for k in range(1, max_window + 1):
            verify = self.target.predict(in_step * (k + 1))
            emitted = expected_tokens_per_round(acceptance, k)
            rate = streams * emitted / (groups * (k * draft_step + verify))
            if per_round:
                rate = min(rate, CPU_CAPACITY * emitted / per_round)
            if rate > best:
                best_window, best = k, rate
        plain = streams / plain_step
        if per_token:
            plain = min(plain, CPU_CAPACITY / per_token)
        return Forecast(streams, plain, best, best_window, plain_step)
