"""Reading the server's Prometheus metrics port (8002): the soak samples the
engines' KV-pool gauges with it, the tests read counters."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    """The exposition text at ``url`` (e.g. http://127.0.0.1:8002/metrics)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def metric_samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``name`` whose labels include ``labels``."""
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the matching samples; KeyError when the server exports none."""
    samples = metric_samples(text, name, **labels)
    if not samples:
        raise KeyError(f"{name}{labels or ''} is not exported")
    return sum(value for _, value in samples)


def engine_cached_tokens(text: str) -> dict[str, int]:
    """Tokens held by each engine's KV-cache pool (gauge specdec_engine_cached_tokens, by model)."""
    return {found["model"]: int(value) for found, value in metric_samples(text, "specdec_engine_cached_tokens")}


def engine_forward_time(text: str) -> dict[str, tuple[int, float]]:
    """(forwards, seconds) each CPU engine has spent in forward passes so far, by model
    (counters specdec_engine_forwards_total, specdec_engine_forward_seconds_total); empty
    where the engines export none (the trtllm profile)."""
    seconds = {found["model"]: value for found, value in metric_samples(text, "specdec_engine_forward_seconds_total")}
    return {found["model"]: (int(value), seconds.get(found["model"], 0.0))
            for found, value in metric_samples(text, "specdec_engine_forwards_total")}


def engine_running_calls(text: str) -> dict[str, int]:
    """Calls in flight in each CPU engine (gauge specdec_engine_running_calls, by model); empty
    where the engines export none (the trtllm profile)."""
    return {found["model"]: int(value) for found, value in metric_samples(text, "specdec_engine_running_calls")}


def histogram_counts(text: str, name: str, **labels: str) -> dict[float, float]:
    """The histogram ``name``'s cumulative count at each upper bound (``le``; inf for all),
    summed over its series whose labels include ``labels``."""
    counts: dict[float, float] = {}
    for found, value in metric_samples(text, f"{name}_bucket", **labels):
        bound = float(found["le"])
        counts[bound] = counts.get(bound, 0.0) + value
    return counts
