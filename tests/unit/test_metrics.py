from collections import defaultdict

import pytest

from coordinator.drafters.registry import DRAFT_MODEL, PROMPT_LOOKUP
from coordinator.rounds import PLAIN_REASONS, Round
from coordinator.response.metrics import (ACCEPTED_AT, ACCEPTED_PER_ROUND, ACCEPTED_TOKENS, DRAFTED_AT, all_specs, DRAFT_FAILURES, DRAFT_TOKENS, EMITTED_TOKENS, FALLBACK_ACTIVE, INTER_TOKEN_LATENCY, PLAIN_ROUNDS, PLAIN_TOKENS, REQUESTS, SPECULATIVE_ROUNDS, TIME_TO_FIRST_TOKEN, WINDOW, MetricsRecorder)
from coordinator.policy.costmodel import MovingAverage
from coordinator.policy.speculation import Mode


class Fake:
    def __init__(self):
        self.total = 0.0
        self.value = None
        self.observed = []

    def increment(self, value):
        assert value >= 0, "counters only go up"
        self.total += value

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def recorder():
    made = {}
    clock = Clock()

    def make(spec):
        made[spec] = Fake()
        return made[spec]

    return MetricsRecorder(make, clock), made, clock


def test_names_share_one_prefix_and_label_sets_are_unique():
    assert all(spec.name.startswith("specdec_") for spec in all_specs())
    keys = [(spec.name, spec.labels) for spec in all_specs()]
    assert len(keys) == len(set(keys))
    kinds = defaultdict(set)
    for spec in all_specs():
        kinds[spec.name].add(spec.kind)
    assert all(len(k) == 1 for k in kinds.values()), "one kind per metric name"
    assert all(spec.name.endswith("_total") for spec in all_specs() if spec.kind == "counter")


def test_rounds_update_counters_gauges_and_histograms():
    metrics, made, clock = recorder()
    request = metrics.start_request()
    clock.now += 0.5
    request.round(Round([1, 2, 3], drafted=4, accepted=2, finished=False))
    clock.now += 0.3
    request.round(Round([4], drafted=0, accepted=0, finished=True))
    request.finish("success")
    assert made[DRAFT_TOKENS[DRAFT_MODEL]].total == 4 and made[ACCEPTED_TOKENS[DRAFT_MODEL]].total == 2
    assert made[EMITTED_TOKENS].total == 4
    assert made[SPECULATIVE_ROUNDS].total == 1 and made[PLAIN_ROUNDS].total == 1
    assert made[ACCEPTED_PER_ROUND].observed == [2]
    assert made[WINDOW].value == 0
    assert made[TIME_TO_FIRST_TOKEN].observed == [pytest.approx(0.5)]
    # tokens 2 and 3 arrived with the first; token 4 after 0.3 s
    assert made[INTER_TOKEN_LATENCY].observed == [0.0, 0.0, pytest.approx(0.3)]
    assert made[REQUESTS["success"]].total == 1


def test_acceptance_is_counted_per_drafter_and_per_draft_position():
    metrics, made, _ = recorder()
    request = metrics.start_request()
    request.round(Round([1, 2, 3], drafted=4, accepted=2, finished=False, drafter=DRAFT_MODEL))
    request.round(Round([4, 5, 6, 7, 8, 9], drafted=5, accepted=5, finished=False, drafter=PROMPT_LOOKUP))
    assert made[DRAFT_TOKENS[DRAFT_MODEL]].total == 4 and made[ACCEPTED_TOKENS[DRAFT_MODEL]].total == 2
    assert made[DRAFT_TOKENS[PROMPT_LOOKUP]].total == 5 and made[ACCEPTED_TOKENS[PROMPT_LOOKUP]].total == 5
    assert [made[DRAFTED_AT[i]].total for i in range(6)] == [2, 2, 2, 2, 1, 0]
    assert [made[ACCEPTED_AT[i]].total for i in range(6)] == [2, 2, 1, 1, 1, 0]


def test_fallback_gauge_counts_requests_in_fallback_and_drops_them_when_done():
    metrics, made, _ = recorder()
    a, b = metrics.start_request(), metrics.start_request()
    a.round(Round([1], 0, 0, False, mode=Mode.FALLBACK))
    b.round(Round([1], 0, 0, False, mode=Mode.DRAFT_FAILED))
    b.round(Round([1], 0, 0, False, mode=Mode.DRAFT_FAILED))
    assert made[FALLBACK_ACTIVE].value == 2
    assert made[DRAFT_FAILURES].total == 1  # once per request
    a.finish("cancelled")
    b.finish("error")
    b.finish("error")  # counted once
    assert made[FALLBACK_ACTIVE].value == 0
    assert made[REQUESTS["cancelled"]].total == 1 and made[REQUESTS["error"]].total == 1


def test_unknown_outcome_is_rejected():
    metrics, _, _ = recorder()
    with pytest.raises(ValueError, match="outcome"):
        metrics.start_request().finish("ok")


def test_the_documented_promql_examples_parse_and_use_exported_names():
    import re
    from pathlib import Path

    import promql_parser

    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    block = reference.split("Example PromQL:", 1)[1].split("```", 2)[1]
    queries = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(queries) >= 3
    exported = {spec.name for spec in all_specs()}
    for query in queries:
        promql_parser.parse(query)
        for name in re.findall(r"specdec_[a-z_]+", query):
            assert re.sub(r"_(bucket|count|sum)$", "", name) in exported, name


def test_kubernetes_rules_only_use_exported_or_recorded_metrics():
    import re
    from pathlib import Path

    import yaml

    rules_file = Path(__file__).resolve().parents[2] / "k8s" / "components" / "prometheus" / "prometheusrule.yaml"
    rules = [r for group in yaml.safe_load(rules_file.read_text())["spec"]["groups"] for r in group["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    from selfheal.exposition import METRICS as WATCHDOG_METRICS

    exported = {spec.name for spec in all_specs()} | {name for name, *_ in WATCHDOG_METRICS}
    exported |= {spec.name + suffix for spec in all_specs() if spec.kind == "histogram"
                 for suffix in ("_bucket", "_sum", "_count")}
    used = {name for r in rules for name in re.findall(r"specdec_[a-z_:]+", r["expr"])}
    assert used, "the rules use specdec_* metrics"
    assert used <= exported | recorded, used - exported - recorded


def test_the_batch_forecast_and_the_governors_measurement_are_exported_side_by_side():
    from coordinator.policy.batchcost import BatchForecaster
    from coordinator.policy.governor import PLAIN, SPECULATE, LoadGovernor
    from coordinator.response.metrics import (COORDINATOR_CPU, FORECAST_ERROR, FORECAST_ERROR_EPOCHS,
                                              FORECAST_RATE, FORECAST_STEP, MEASURED_RATE)

    batch = BatchForecaster.empty()
    for rows in (1, 5):
        batch.observe_target(rows, 0.1 + 0.02 * rows)
        batch.observe_draft(rows, 0.02)
    governor = LoadGovernor(forecast=lambda streams: batch.forecast(streams, 0.7, 4))
    governor.rates[(2, PLAIN)] = MovingAverage(9.0, 2)  # load bucket 2: 3-4 streams
    governor.calibration[SPECULATE] = MovingAverage(0.5, 3)  # speculation's epochs served half its forecast
    governor.forecast_error[SPECULATE] = 0.2
    governor.epoch_errors.extend([(SPECULATE, 0.2), (PLAIN, -0.04)])
    made = {}
    metrics = MetricsRecorder(lambda spec: made.setdefault(spec, Fake()), Clock(), governor=governor)
    metrics.costs.streams = 4
    metrics.costs.batch.cpu.add(0.05, 0, 100)  # plain tokens only: 0.5 ms of coordinator CPU each
    metrics.start_request().round(Round([1], drafted=0, accepted=0, finished=False))
    assert made[COORDINATOR_CPU["plain_token"]].value == pytest.approx(0.0005)
    assert COORDINATOR_CPU["speculative_round"] not in made or made[COORDINATOR_CPU["speculative_round"]].value is None
    forecast = batch.forecast(4, 0.7, 4)
    assert made[FORECAST_RATE[PLAIN]].value == pytest.approx(4 / (0.1 + 0.02 * 4)) == forecast.plain
    assert forecast.speculative > 0 and made[FORECAST_RATE[SPECULATE]].value == pytest.approx(0.5 * forecast.speculative)
    assert made[FORECAST_ERROR[SPECULATE]].value == 0.2
    assert made[FORECAST_ERROR_EPOCHS[SPECULATE]].observed == [0.2]  # each epoch once, into a histogram
    assert made[FORECAST_ERROR_EPOCHS[PLAIN]].observed == [-0.04] and not governor.epoch_errors
    assert made[FORECAST_STEP].value == pytest.approx(0.18)
    assert made[MEASURED_RATE[PLAIN]].value == 9.0 and made[MEASURED_RATE[SPECULATE]].value == 0.0


def test_plain_tokens_are_counted_by_why_the_request_did_not_speculate():
    metrics, made, _ = recorder()
    request = metrics.start_request()
    request.round(Round([1, 2, 3], 0, 0, False, plain_reason="load_governor"))
    request.round(Round([4], 0, 0, False, plain_reason="first_round"))
    request.round(Round([5, 6], 2, 1, False, drafter=DRAFT_MODEL))
    assert made[PLAIN_TOKENS["load_governor"]].total == 3
    assert made[PLAIN_TOKENS["first_round"]].total == 1
    assert sum(made[spec].total for spec in PLAIN_TOKENS.values()) == 4
    assert set(PLAIN_TOKENS) == set(PLAIN_REASONS)
