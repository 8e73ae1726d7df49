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

Engine costs depend on the context length (attention reads every cached key)
and on the load (with in-flight batching a verification's k + 1 rows share
forwards with the other streams' rows: nearly free while forwards are
memory-bound, not once they are compute-bound). So the timings are kept per
cell of (context bucket, load bucket), load being the requests decoding at
the time; a decision reads the cell of the request's own context and the
current load, and a cell with nothing measured starts from the priors, never
from another cell's numbers: what ran before (2,000-token prompts, a burst of
load) cannot make a short request under light load decide otherwise. Only
the draft's catch-up price borrows, and only a floor: a shorter context's or
a lower load's.

Each drafter (coordinator/drafters/) is priced by its own measured cost c
and its own server-wide acceptance: prompt lookup drafts for almost nothing,
the draft model for a forward per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from coordinator.drafters import registry
from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.policy.batchcost import BatchForecaster, Forecast
from coordinator.policy.expectation import expected_tokens_per_round
from coordinator.policy.startup_profile import DRAFT as DRAFT_ENGINE, ForwardSample
from coordinator.rounds import Round

# Before anything is measured: a draft step costs its drafter's prior
# (coordinator/drafters/registry.py; the draft model's below) and verifying K
# tokens costs one target step (memory-bound engines).
PRIOR_DRAFT_COST = registry.prior_cost(DRAFT_MODEL)
PRIOR_VERIFY_COST = 1.0
EWMA_WEIGHT = 0.1  # weight of a new sample in the moving averages (~10 recent calls)
# The draft's prompt catch-up is priced once this many have been timed in a
# cell (a first call pays one-time costs), and a cell that keeps refusing it
# lets every PREFILL_EXPLORE_EVERY-th request catch up anyway, so an estimate
# that stops the draft model is measured again instead of ruling for good.
PREFILL_MIN_SAMPLES = 3
PREFILL_EXPLORE_EVERY = 8
# Upper bounds of the context buckets (tokens); the last bucket is open.
CONTEXT_BUCKETS = (512, 1024, 2048)
# Upper bounds of the load buckets (requests decoding at once); the last is open.
LOAD_BUCKETS = (1, 2, 4, 8)
# Seconds of serving per sample of the coordinator's CPU time (batchcost.CpuFit).
CPU_SAMPLE_SECONDS = 1.0


def context_bucket(tokens: int) -> int:
    return next((i for i, bound in enumerate(CONTEXT_BUCKETS) if tokens < bound), len(CONTEXT_BUCKETS))


def load_bucket(streams: int) -> int:
    return next((i for i, bound in enumerate(LOAD_BUCKETS) if streams <= bound), len(LOAD_BUCKETS))


def context_label(bucket: int) -> str:
    """The bucket as a metric label, e.g. ``512-1023`` or ``2048+``."""
    low = 0 if bucket == 0 else CONTEXT_BUCKETS[bucket - 1]
    return f"{low}+" if bucket == len(CONTEXT_BUCKETS) else f"{low}-{CONTEXT_BUCKETS[bucket] - 1}"


def load_label(bucket: int) -> str:
    low = 1 if bucket == 0 else LOAD_BUCKETS[bucket - 1] + 1
    if bucket == len(LOAD_BUCKETS):
        return f"{low}+"
    high = LOAD_BUCKETS[bucket]
    return str(high) if low == high else f"{low}-{high}"


def predicted_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """E(K) / (K c + v(K)); costs in units of one plain target step."""
    if k <= 0:
        return 1.0
    return expected_tokens_per_round(alpha, k) / (k * draft_cost + verify_cost)


def best_of(predictions: list[float]) -> tuple[int, float]:
    """(K, speed-up) of the best window given the predicted speed-up of windows
    1..len (index K - 1); (0, 1.0) when none beats plain decoding."""
    best_k, best = 0, 1.0
    for k, speedup in enumerate(predictions, start=1):
        if speedup > best + 1e-9:
            best_k, best = k, speedup
    return best_k, best


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
class Timings:
    """Engine call timings (seconds) of one (context, load) cell."""

    plain_step: MovingAverage = field(default_factory=MovingAverage)
    # what the draft's background prefill of a prompt cost the request, seconds per prompt token
    draft_prefill: MovingAverage = field(default_factory=MovingAverage)
    prefill_refusals: int = 0  # catch-ups the pricing refused in a row
    draft: dict[str, dict[int, MovingAverage]] = field(default_factory=dict)  # seconds per drafter, per K
    verify: dict[int, MovingAverage] = field(default_factory=dict)  # verify call seconds per K

    def plain_seconds(self) -> float | None:
        if self.plain_step.value is not None:
            return self.plain_step.value
        # Never decoded plainly in this cell yet: the cheapest verify is the closest stand-in.
        measured = [m.value for m in self.verify.values() if m.value is not None]
        return min(measured) if measured else None

    def draft_cost(self, k: int, drafter: str = DRAFT_MODEL) -> float:
        """c at window K: draft call seconds per drafted token over one plain step.

        The draft call has a fixed part (catching up on the tokens accepted in
        the previous round), so c is kept per K; an unmeasured K borrows the
        per-token cost of the nearest measured one.
        """
        plain = self.plain_seconds()
        measured = _values(self.draft.get(drafter, {}))
        if plain is None or not measured:
            return registry.prior_cost(drafter)
        nearest = _nearest(measured, k)
        return measured[nearest] / nearest / plain

    def verify_cost(self, k: int) -> float:
        """v(K): verify seconds over one plain step (nearest measured K when K is not)."""
        plain = self.plain_seconds()
        measured = _values(self.verify)
        if plain is None or not measured:
            return PRIOR_VERIFY_COST
        return max(measured[_nearest(measured, k)] / plain, 1e-3)


@dataclass
class CostModel:
    """Server-wide engine timings per (context, load) cell, and the acceptance, shared by all requests.

    ``context`` (tokens in the sequence) and ``streams`` (requests decoding
    at once, the current ``streams`` by default) select the cell."""

    cells: dict[tuple[int, int], Timings] = field(default_factory=dict)
    # Server-wide acceptance per drafter: moving averages of accepted drafts and
    # of trials (accepted + rejections) per round; the prior of every new request.
    accepted: dict[str, MovingAverage] = field(default_factory=dict)
    trials: dict[str, MovingAverage] = field(default_factory=dict)
    streams: int = 0  # requests decoding now (the coordinator counts them)
    # The engines' forward costs as functions of rows, across loads: what prices a
    # load that has not been measured (coordinator/policy/batchcost.py).
    batch: BatchForecaster = field(default_factory=BatchForecaster.empty)
    # The coordinator process's CPU seconds so far (time.process_time), sampled every
    # CPU_SAMPLE_SECONDS against the rounds observed meanwhile; None: not measured.
    cpu_clock: Callable[[], float] | None = None
    wall_clock: Callable[[], float] = time.monotonic
    speculative_rounds: int = 0  # observed so far
    plain_tokens: int = 0
    _cpu_mark: tuple[float, float, int, int] | None = None  # (wall, cpu, rounds, plain tokens) at the last sample

    def cell(self, context: int = 0, streams: int | None = None) -> Timings:
        key = (context_bucket(context), load_bucket(self.streams if streams is None else streams))
        if key not in self.cells:
            self.cells[key] = Timings()
        return self.cells[key]

    def observe(self, round_: Round) -> None:
        """Learn from one round's report: its cost samples (in the cell of its
        context and the current load) and, for a speculative round, its drafter's acceptance."""
        streams = max(1, self.streams)
        if round_.speculative:
            if round_.draft_sample is not None:
                self.observe_draft(round_.drafted, round_.draft_sample, round_.context, drafter=round_.drafter)
                if round_.drafter == DRAFT_MODEL:  # one draft forward per drafted token, a row per stream
                    self.batch.observe_draft(streams, round_.draft_sample / round_.drafted)
            if round_.target_sample is not None:
                self.observe_verify(round_.drafted, round_.target_sample, round_.context)
                self.batch.observe_target(streams * (round_.drafted + 1), round_.target_sample)
            self.observe_acceptance(round_.accepted, round_.rejected, round_.drafter)
            for drafter, accepted, rejected in round_.alternatives:
                if accepted or rejected:
                    self.observe_acceptance(accepted, rejected, drafter)
        elif round_.target_sample is not None and round_.tokens:
            self.observe_plain(round_.target_sample / len(round_.tokens), round_.context)
            self.batch.observe_target(streams, round_.target_sample / len(round_.tokens))
        if round_.speculative:
            self.speculative_rounds += 1
        else:
            self.plain_tokens += len(round_.tokens)
        self._sample_cpu()

    def observe_profile(self, samples: Iterable[ForwardSample]) -> None:
        """The engines' forward costs timed at start-up (startup_profile.py): the batch
        forecast's first samples, so a load not served yet is priced from the start."""
        for sample in samples:
            observe = self.batch.observe_draft if sample.engine == DRAFT_ENGINE else self.batch.observe_target
            observe(sample.rows, sample.seconds)

    def _sample_cpu(self) -> None:
        """Feed the CPU fit the coordinator's CPU time of the interval since the last sample."""
        if self.cpu_clock is None:
            return
        now, mark = self.wall_clock(), self._cpu_mark
        if mark is not None and now - mark[0] < CPU_SAMPLE_SECONDS:
            return
        cpu = self.cpu_clock()
        if mark is not None:
            self.batch.cpu.add(cpu - mark[1], self.speculative_rounds - mark[2], self.plain_tokens - mark[3])
        self._cpu_mark = (now, cpu, self.speculative_rounds, self.plain_tokens)

    def coordinator_cpu(self) -> tuple[float | None, float | None]:
        """The coordinator's CPU seconds per speculative round and per plain token, as measured."""
        return self.batch.cpu.costs()

    def forecast(self, streams: int, prior_acceptance: float, max_window: int) -> Forecast | None:
        """What a batch of ``streams`` streams would serve plain and drafting with the draft
        model at its server-wide acceptance (``prior_acceptance`` before any is measured)."""
        return self.batch.forecast(streams, self.server_acceptance(prior_acceptance), max_window)

    def observe_acceptance(self, accepted: int, rejected: bool, drafter: str = DRAFT_MODEL) -> None:
        self.accepted.setdefault(drafter, MovingAverage()).add(accepted)
        self.trials.setdefault(drafter, MovingAverage()).add(accepted + int(rejected))

    def acceptance_rounds(self, drafter: str = DRAFT_MODEL) -> int:
        """Rounds the server-wide acceptance of ``drafter`` rests on."""
        trials = self.trials.get(drafter)
        return 0 if trials is None else trials.samples

    def server_acceptance(self, default: float, drafter: str = DRAFT_MODEL) -> float:
        trials = self.trials.get(drafter)
        if trials is None or not trials.value:
            return default
        return self.accepted[drafter].value / trials.value

    def observe_plain(self, seconds: float, context: int = 0, streams: int | None = None) -> None:
        self.cell(context, streams).plain_step.add(seconds)

    def observe_draft_prefill(self, tokens: int, seconds: float, context: int = 0,
                              streams: int | None = None) -> None:
        """The draft model's catch-up on ``tokens`` tokens (a prompt's prefill) cost ``seconds``."""
        if tokens > 0:
            timings = self.cell(context, streams)
            timings.draft_prefill.add(seconds / tokens)
            timings.prefill_refusals = 0

    def draft_prefill_seconds(self, context: int, streams: int | None = None) -> float | None:
        """Seconds per token of the draft's catch-up at ``context`` tokens: this cell's, else the
        nearest shorter context's at this load (attention grows with context, so that is a floor),
        else the same at the nearest lower load (more streams share the cores: a floor too, so
        the first catch-ups at a new load are priced instead of paid for blind);
        None when nothing is measured."""
        for load in range(load_bucket(self.streams if streams is None else streams), -1, -1):
            for bucket in range(context_bucket(context), -1, -1):
                timings = self.cells.get((bucket, load))
                if timings is not None and timings.draft_prefill.samples >= PREFILL_MIN_SAMPLES:
                    return timings.draft_prefill.value
        return None

    def explore_prefill(self, context: int, streams: int | None = None) -> bool:
        """Whether a catch-up the pricing refuses should run anyway (every PREFILL_EXPLORE_EVERY-th)."""
        timings = self.cell(context, streams)
        timings.prefill_refusals += 1
        return timings.prefill_refusals % PREFILL_EXPLORE_EVERY == 0

    def observe_draft(self, drafted: int, seconds: float, context: int = 0, streams: int | None = None,
                      drafter: str = DRAFT_MODEL) -> None:
        if drafted > 0:
            self.cell(context, streams).draft.setdefault(drafter, {}).setdefault(drafted, MovingAverage()).add(seconds)

    def observe_verify(self, drafted: int, seconds: float, context: int = 0, streams: int | None = None) -> None:
        if drafted > 0:
            self.cell(context, streams).verify.setdefault(drafted, MovingAverage()).add(seconds)

    def draft_cost(self, k: int, context: int = 0, streams: int | None = None, drafter: str = DRAFT_MODEL) -> float:
        return self.cell(context, streams).draft_cost(k, drafter)

    def verify_cost(self, k: int, context: int = 0, streams: int | None = None) -> float:
        return self.cell(context, streams).verify_cost(k)

    def plain_seconds(self, context: int = 0, streams: int | None = None) -> float | None:
        return self.cell(context, streams).plain_seconds()

    def predictions(self, alpha: float, max_window: int, context: int = 0,
                    streams: int | None = None, drafter: str = DRAFT_MODEL) -> list[float]:
        """Predicted speed-up of every window 1..max_window (index K - 1) with ``drafter``."""
        timings = self.cell(context, streams)
        return [predicted_speedup(alpha, k, timings.draft_cost(k, drafter), timings.verify_cost(k))
                for k in range(1, max_window + 1)]

    def best_window(self, alpha: float, max_window: int, context: int = 0,
                    streams: int | None = None, drafter: str = DRAFT_MODEL) -> tuple[int, float]:
        """(K, predicted speed-up) of the best window in 1..max_window; (0, 1.0) if none beats 1."""
        return best_of(self.predictions(alpha, max_window, context, streams, drafter))

    def likeliest_window(self, alpha: float, max_window: int, context: int = 0, streams: int | None = None,
                         drafter: str = DRAFT_MODEL) -> int:
        """The window predicted to do best even when none beats plain decoding (what a probe should measure)."""
        predictions = self.predictions(alpha, max_window, context, streams, drafter)
        return 1 + max(range(len(predictions)), key=lambda i: (predictions[i], -i)) if predictions else 0


def _values(averages: dict[int, MovingAverage]) -> dict[int, float]:
    return {k: m.value for k, m in averages.items() if m.value is not None}


def _nearest(measured: dict[int, float], k: int) -> int:
    return min(measured, key=lambda n: (abs(n - k), n))
