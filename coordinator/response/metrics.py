"""The coordinator's Prometheus metrics: names, kinds and what updates them.

Pure bookkeeping over an instrument factory, so the same code runs against
Triton's ``pb_utils.MetricFamily`` (exported on the metrics port, 8002) and a
fake in the unit tests. Every name starts with ``specdec_``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from coordinator.settings import MAX_SPECULATION_WINDOW
from coordinator.policy.costmodel import (CONTEXT_BUCKETS, LOAD_BUCKETS, CostModel, context_bucket, context_label, load_bucket, load_label)
from coordinator.drafters import registry
from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.policy.governor import PLAIN, SPECULATE, LoadGovernor
from coordinator.policy.speculation import Mode
from coordinator.rounds import PLAIN_REASONS, Round

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

ACCEPTED_BUCKETS = [float(n) for n in range(0, 17)]
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0]
REQUEST_OUTCOMES = ("success", "error", "cancelled")
# The traffic split's arms (coordinator/request/parse.py): every latency and
# throughput metric carries one, so the arms compare on the same server.
ARMS = ("control", "speculative", "none")


def _geometric(low: float, high: float, ratio: float) -> list[float]:
    """Bucket bounds from low to at least high, each ``ratio`` times the last (3 significant digits)."""
    bounds, bound = [], low
    while bound < high * ratio:
        bounds.append(float(f"{bound:.3g}"))
        bound *= ratio
    return sorted(set(bounds))


# Fine enough for a p50 and a p99 per arm: each bucket 20 % wider than the
# last, 1 ms to 60 s, so a quantile interpolated inside its bucket is within
# ~10 % of the true one (tools/ab_report.py states the bound).
FINE_LATENCY_BUCKETS = _geometric(0.001, 60.0, 1.2)
TOKENS_PER_SECOND_BUCKETS = _geometric(0.25, 5000.0, 1.2)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    description: str
    labels: tuple[tuple[str, str], ...] = ()
    buckets: tuple[float, ...] | None = None


def _spec(name, kind, description, labels=(), buckets=None) -> MetricSpec:
    return MetricSpec(name, kind, description, tuple(labels), None if buckets is None else tuple(buckets))


class PerDrafter:
    """One labelled series per drafter that proposes (coordinator/drafters/registry.py):
    read when the recorder starts, so a drafter added to the registry is counted."""

    def __init__(self, name: str, description: str):
        self.name, self.description = name, description

    def __getitem__(self, drafter: str) -> MetricSpec:
        return _spec(self.name, COUNTER, self.description, [("drafter", drafter)])

    def values(self) -> list[MetricSpec]:
        return [self[drafter] for drafter in registry.proposers()]


DRAFT_TOKENS = PerDrafter("specdec_draft_tokens_total", "Draft tokens proposed to the target, by drafter")
ACCEPTED_TOKENS = PerDrafter("specdec_accepted_draft_tokens_total", "Draft tokens the target accepted, by drafter")
# Per draft position (0 = the first drafted token of a round), as vLLM exposes
# them: where in the window acceptance runs out.
DRAFTED_AT = {
    position: _spec("specdec_drafted_at_position_total", COUNTER, "Rounds that drafted a token at this position",
                    [("position", str(position))])
    for position in range(MAX_SPECULATION_WINDOW)
}
ACCEPTED_AT = {
    position: _spec("specdec_accepted_at_position_total", COUNTER,
                    "Rounds whose drafted token at this position was accepted", [("position", str(position))])
    for position in range(MAX_SPECULATION_WINDOW)
}
EMITTED_TOKENS = _spec("specdec_emitted_tokens_total", COUNTER, "Completion tokens emitted to clients")
SPECULATIVE_ROUNDS = _spec(
    "specdec_rounds_total", COUNTER, "Decoding rounds: a speculative round is one target call, a plain round one plain target step", [("kind", "speculative")]
)
PLAIN_ROUNDS = _spec("specdec_rounds_total", COUNTER, "Decoding rounds: a speculative round is one target call, a plain round one plain target step", [("kind", "plain")])
# Why tokens were decoded without speculation (coordinator/decoding/loop.py plain_reason):
# the share of each among the emitted tokens is what an operator watches in a rollout.
PLAIN_TOKENS = {
    reason: _spec("specdec_plain_tokens_total", COUNTER,
                  "Completion tokens decoded plainly (no draft verified), by why the request did not speculate",
                  [("reason", reason)])
    for reason in PLAIN_REASONS
}
DRAFT_FAILURES = _spec(
    "specdec_draft_failures_total", COUNTER, "Draft engine failures (the request went on with the target alone)"
)
REQUESTS_BY_ARM = {
    (outcome, arm): _spec("specdec_requests_total", COUNTER, "Finished requests by outcome and traffic-split arm",
                          [("outcome", outcome), ("arm", arm)])
    for outcome in REQUEST_OUTCOMES for arm in ARMS
}
REQUESTS = {outcome: REQUESTS_BY_ARM[(outcome, "none")] for outcome in REQUEST_OUTCOMES}  # requests not split
WINDOW = _spec("specdec_speculation_window", GAUGE, "Draft tokens of the most recent round (0: plain step)")
FALLBACK_ACTIVE = _spec(
    "specdec_fallback_active",
    GAUGE,
    "Requests in flight decoding without the draft because acceptance fell below fallback_threshold "
    "or the draft failed",
)
DRAFT_COST = {
    bucket: _spec("specdec_draft_cost_ratio", GAUGE,
                  "Draft model cost per drafted token over one plain target step (c), by context length, at the current load",
                  [("context", context_label(bucket))])
    for bucket in range(len(CONTEXT_BUCKETS) + 1)
}
VERIFY_COST = {
    bucket: _spec("specdec_verify_cost_ratio", GAUGE,
                  "Verify cost over one plain target step at the latest window (v(K)), by context length, "
                  "at the current load", [("context", context_label(bucket))])
    for bucket in range(len(CONTEXT_BUCKETS) + 1)
}
PLAIN_STEP = {
    bucket: _spec("specdec_plain_step_seconds", GAUGE,
                  "Measured seconds of a plain target step, by context length, at the current load",
                  [("context", context_label(bucket))])
    for bucket in range(len(CONTEXT_BUCKETS) + 1)
}
STREAMS = _spec("specdec_decoding_requests", GAUGE, "Requests decoding now (the load the cost model plans for)")
# Admission control (coordinator/request/admission.py): the HorizontalPodAutoscaler
# scales on in-flight / max (k8s/base/hpa.yaml), before requests are refused.
INFLIGHT = _spec("specdec_inflight_requests", GAUGE,
                 "Requests admitted and not yet answered (prefilling, decoding or waiting for an engine)")
MAX_INFLIGHT = _spec("specdec_max_inflight_requests", GAUGE,
                     "The most requests admitted at once (max_inflight_requests)")
REFUSED = _spec("specdec_refused_requests_total", COUNTER,
                "Requests refused at arrival because max_inflight_requests were in flight")
LOAD_REGIME = {
    bucket: _spec("specdec_load_speculating", GAUGE,
                  "1 while adaptive requests speculate at this load, 0 while the server measured plain decoding "
                  "faster there", [("load", load_label(bucket))])
    for bucket in range(len(LOAD_BUCKETS) + 1)
}
# The batch forecast beside what the governor measured, at the current load: a
# wrong forecast shows as a gap between the two (coordinator/policy/batchcost.py).
FORECAST_RATE = {
    regime: _spec("specdec_forecast_tokens_per_second", GAUGE,
                  "Tokens per second the whole batch is predicted to emit at the current load, by regime, "
                  "from the engines' forward costs", [("regime", regime)])
    for regime in (PLAIN, SPECULATE)
}
MEASURED_RATE = {
    regime: _spec("specdec_measured_tokens_per_second", GAUGE,
                  "Tokens per second the whole batch emitted at the current load, by regime, averaged over "
                  "the load governor's epochs (0 until measured there)", [("regime", regime)])
    for regime in (PLAIN, SPECULATE)
}
FORECAST_ERROR = {
    regime: _spec("specdec_forecast_error_ratio", GAUGE,
                  "The load governor's last epoch in this regime: the calibrated forecast of its tokens per "
                  "second over what it measured, minus 1 (0.1: predicted 10 % too many)", [("regime", regime)])
    for regime in (PLAIN, SPECULATE)
}
# Forecast errors of the governor's epochs: +-5, 15, 30, 50 % (the aim: a run's median within 15 %).
FORECAST_ERROR_BUCKETS = (-0.5, -0.3, -0.15, -0.05, 0.05, 0.15, 0.3, 0.5)
FORECAST_ERROR_EPOCHS = {
    regime: _spec("specdec_forecast_epoch_error_ratio", HISTOGRAM,
                  "Every load-governor epoch in this regime: the calibrated forecast of its tokens per second "
                  "over what it measured, minus 1", [("regime", regime)], FORECAST_ERROR_BUCKETS)
    for regime in (PLAIN, SPECULATE)
}
FORECAST_STEP = _spec("specdec_forecast_plain_step_seconds", GAUGE,
                      "Predicted seconds of one plain target forward of the current batch "
                      "(measured: specdec_plain_step_seconds)")
COORDINATOR_CPU = {
    unit: _spec("specdec_coordinator_cpu_seconds", GAUGE,
                "CPU seconds the coordinator's process spends per speculative round or per plain token, "
                "measured while serving; one process emits at most about one CPU second of them a second",
                [("unit", unit)])
    for unit in ("speculative_round", "plain_token")
}
ACCEPTED_PER_ROUND = _spec(
    "specdec_accepted_tokens_per_round",
    HISTOGRAM,
    "Accepted draft tokens per speculative round",
    buckets=ACCEPTED_BUCKETS,
)

def _by_arm(name: str, description: str, buckets: list[float]) -> dict[str, MetricSpec]:
    return {arm: _spec(name, HISTOGRAM, description, [("arm", arm)], buckets) for arm in ARMS}


TTFT_BY_ARM = _by_arm("specdec_time_to_first_token_seconds",
                      "From the request's arrival at the coordinator to its first emitted token, by arm",
                      FINE_LATENCY_BUCKETS)
ITL_BY_ARM = _by_arm("specdec_inter_token_latency_seconds",
                     "Time per emitted token after the first (a round's duration over the tokens it emitted), by arm",
                     FINE_LATENCY_BUCKETS)
E2E_BY_ARM = _by_arm("specdec_request_latency_seconds",
                     "From a successful request's arrival at the coordinator to its last token, by arm",
                     FINE_LATENCY_BUCKETS)
TOKENS_PER_SECOND_BY_ARM = _by_arm("specdec_request_tokens_per_second",
                                   "A successful request's completion tokens over its end-to-end seconds, by arm",
                                   TOKENS_PER_SECOND_BUCKETS)
TIME_TO_FIRST_TOKEN = TTFT_BY_ARM["none"]  # requests not split
INTER_TOKEN_LATENCY = ITL_BY_ARM["none"]

def all_specs() -> tuple[MetricSpec, ...]:
    """Every series the coordinator exports."""
    return (*DRAFT_TOKENS.values(), *ACCEPTED_TOKENS.values(), *FIXED_SPECS)


FIXED_SPECS = (
    *DRAFTED_AT.values(),
    *ACCEPTED_AT.values(),
    EMITTED_TOKENS,
    SPECULATIVE_ROUNDS,
    PLAIN_ROUNDS,
    *PLAIN_TOKENS.values(),
    DRAFT_FAILURES,
    *REQUESTS_BY_ARM.values(),
    WINDOW,
    FALLBACK_ACTIVE,
    *DRAFT_COST.values(),
    *VERIFY_COST.values(),
    *PLAIN_STEP.values(),
    STREAMS,
    INFLIGHT,
    MAX_INFLIGHT,
    REFUSED,
    *LOAD_REGIME.values(),
    *FORECAST_RATE.values(),
    *FORECAST_ERROR.values(),
    *FORECAST_ERROR_EPOCHS.values(),
    *MEASURED_RATE.values(),
    FORECAST_STEP,
    *COORDINATOR_CPU.values(),
    ACCEPTED_PER_ROUND,
    *TTFT_BY_ARM.values(),
    *ITL_BY_ARM.values(),
    *E2E_BY_ARM.values(),
    *TOKENS_PER_SECOND_BY_ARM.values(),
)


class Instrument(Protocol):
    """The subset of ``pb_utils.Metric`` used here."""

    def increment(self, value: float) -> None: ...

    def set(self, value: float) -> None: ...

    def observe(self, value: float) -> None: ...


class MetricsRecorder:
    """Server-wide metrics; one ``RequestMetrics`` per request feeds it."""

    def __init__(self, make: Callable[[MetricSpec], Instrument], clock: Callable[[], float] = time.monotonic,
                 costs: CostModel | None = None, governor: LoadGovernor | None = None):
        """``costs``: the server-wide cost model whose estimates the gauges show;
        ``governor``: the load governor whose forecast and measurements they show."""
        self.instruments = {spec: make(spec) for spec in all_specs()}
        self.clock = clock
        self.costs = costs if costs is not None else CostModel()
        self.governor = governor
        self._fallback: set[int] = set()

    def _get(self, spec: MetricSpec) -> Instrument:
        return self.instruments[spec]

    def admission(self, in_flight: int, limit: int) -> None:
        """The requests in flight now and the bound they are held to."""
        self._get(INFLIGHT).set(in_flight)
        self._get(MAX_INFLIGHT).set(limit)

    def refused(self) -> None:
        """A request refused at arrival (it never started: not in specdec_requests_total)."""
        self._get(REFUSED).increment(1)

    def start_request(self) -> RequestMetrics:
        return RequestMetrics(self, self.clock())

    def _round(self, request: RequestMetrics, round_: Round) -> None:
        get, costs, context = self._get, self.costs, round_.context
        emitted = len(round_.tokens)
        if round_.drafted:
            drafter = round_.drafter or DRAFT_MODEL
            get(DRAFT_TOKENS[drafter]).increment(round_.drafted)
            get(ACCEPTED_TOKENS[drafter]).increment(round_.accepted)
            for position in range(min(round_.drafted, MAX_SPECULATION_WINDOW)):
                get(DRAFTED_AT[position]).increment(1)
                if position < round_.accepted:
                    get(ACCEPTED_AT[position]).increment(1)
            get(SPECULATIVE_ROUNDS).increment(1)
            get(ACCEPTED_PER_ROUND).observe(round_.accepted)
            bucket = context_bucket(context)
            if drafter == DRAFT_MODEL:  # prompt lookup's cost is a search: nothing to watch
                get(DRAFT_COST[bucket]).set(costs.draft_cost(round_.drafted, context))
            get(VERIFY_COST[bucket]).set(costs.verify_cost(round_.drafted, context))
        else:
            get(PLAIN_ROUNDS).increment(1)
            if emitted and round_.plain_reason in PLAIN_TOKENS:
                get(PLAIN_TOKENS[round_.plain_reason]).increment(emitted)
        plain = costs.plain_seconds(context)
        if plain is not None:
            get(PLAIN_STEP[context_bucket(context)]).set(plain)
        get(STREAMS).set(costs.streams)
        if round_.held_back is not None:
            get(LOAD_REGIME[load_bucket(costs.streams)]).set(0 if round_.held_back else 1)
        if self.governor is not None:
            self._load_rates(costs.streams)
        get(WINDOW).set(round_.drafted)
        if emitted:
            get(EMITTED_TOKENS).increment(emitted)
        if round_.mode == Mode.DRAFT_FAILED and not request.draft_failed:
            request.draft_failed = True
            get(DRAFT_FAILURES).increment(1)
        self._set_fallback(request, round_.mode in (Mode.FALLBACK, Mode.DRAFT_FAILED))

    def _load_rates(self, streams: int) -> None:
        """The batch forecast and the governor's measurement at ``streams`` streams."""
        get, governor = self._get, self.governor
        forecast = governor.predicted(streams)
        if forecast is not None:
            get(FORECAST_RATE[PLAIN]).set(forecast.plain)
            get(FORECAST_RATE[SPECULATE]).set(forecast.speculative)
            get(FORECAST_STEP).set(forecast.plain_step)
        for unit, seconds in zip(COORDINATOR_CPU, self.costs.coordinator_cpu()):
            if seconds is not None:
                get(COORDINATOR_CPU[unit]).set(seconds)
        for regime in (PLAIN, SPECULATE):
            get(MEASURED_RATE[regime]).set(governor.rate(streams, regime) or 0.0)
            if regime in governor.forecast_error:
                get(FORECAST_ERROR[regime]).set(governor.forecast_error[regime])
        for regime, error in governor.take_epoch_errors():
            get(FORECAST_ERROR_EPOCHS[regime]).observe(error)

    def _set_fallback(self, request: RequestMetrics, active: bool) -> None:
        (self._fallback.add if active else self._fallback.discard)(id(request))
        self._get(FALLBACK_ACTIVE).set(len(self._fallback))

    def _finish(self, request: RequestMetrics, outcome: str) -> None:
        self._set_fallback(request, False)
        arm = request.arm if request.arm in ARMS else "none"
        self._get(REQUESTS_BY_ARM[(outcome, arm)]).increment(1)
        if outcome == "success":
            seconds = self.clock() - request.started
            self._get(E2E_BY_ARM[arm]).observe(seconds)
            if seconds > 0 and request.tokens:
                self._get(TOKENS_PER_SECOND_BY_ARM[arm]).observe(request.tokens / seconds)


class RequestMetrics:
    def __init__(self, recorder: MetricsRecorder, started: float):
        self.recorder = recorder
        self.started = started
        self.last_emission: float | None = None
        self.draft_failed = False
        self.finished = False
        self.arm = "none"  # the traffic split's arm, once the request is parsed
        self.tokens = 0  # completion tokens emitted

    def round(self, round_: Round) -> None:
        now = self.recorder.clock()
        self.recorder._round(self, round_)
        emitted = len(round_.tokens)
        if not emitted:
            return
        self.tokens += emitted
        get = self.recorder._get
        arm = self.arm if self.arm in ARMS else "none"
        if self.last_emission is None:
            get(TTFT_BY_ARM[arm]).observe(now - self.started)
            emitted -= 1  # the first token's latency is the time to first token
            gap = 0.0
        else:
            gap = now - self.last_emission
        for _ in range(emitted):
            get(ITL_BY_ARM[arm]).observe(gap / max(emitted, 1))
        self.last_emission = now

    def finish(self, outcome: str) -> None:
        """Count the request once, by outcome (success, error or cancelled)."""
        if outcome not in REQUEST_OUTCOMES:
            raise ValueError(f"outcome must be one of {REQUEST_OUTCOMES}, got {outcome!r}")
        if not self.finished:
            self.finished = True
            self.recorder._finish(self, outcome)
