"""specdec-ab-report: the traffic split's verdict from live traffic.

Per arm (``control``: speculation off, ``speculative``: the server's
defaults; settings.speculation_ab_fraction): requests, the median and p99 of
time to first token, inter-token latency and end-to-end latency, and mean
tokens/s per request, each with a 95 % confidence interval, and one line:
speculation helps, hurts, or not yet decided.

Input: two scrapes of the coordinator's /metrics (``--before``, ``--after``:
files or URLs; the report covers the requests between them; ``--before``
omitted: since the server started), or Prometheus' HTTP API
(``--prometheus URL --window 1h``: ``increase()`` over the window, summed over
pods).

Method (histograms hold bucket counts, not requests, so no bootstrap over
requests is possible):

* quantiles: interpolated linearly inside their bucket, as PromQL's
  histogram_quantile does. Their interval is distribution-free: the ranks
  n*q +- z*sqrt(n*q*(1-q)) (normal approximation to the binomial count of
  observations below the true quantile), each rank's value interpolated in
  its bucket. That assumes observations spread evenly inside a bucket; the
  bucket holding each estimate is reported beside it (the resolution: each
  bucket 20 % wider than the last, coordinator/response/metrics.py, so an
  interpolated quantile is within ~10 % of the truth).
* tokens/s: the mean of the per-request histogram (exact, from _sum/_count),
  its interval the normal approximation mean +- z*s/sqrt(n), with s estimated
  from the bucket midpoints.
* a difference (speculative - control): for a quantile, the per-arm intervals
  at 97.5 % combined as [lo_s - hi_c, hi_s - lo_c] (>= 95 % by Bonferroni);
  for tokens/s, Welch's normal interval. No difference and no verdict
  until each arm has MIN_REQUESTS (30) requests. The verdict: "helps" when the
  tokens/s difference's interval is above 0 and the end-to-end p99's is not
  above 0; "hurts" when the tokens/s interval is below 0 or the end-to-end
  p99's is above 0; "not yet decided" otherwise.

Inter-token latencies are per token, not per request: tokens of one request
are not independent, so their intervals are narrower than the truth; the
verdict does not use them. The verdict is about requests sharing one server at
this traffic mix (control requests decode in the same batches).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

ARMS = ("control", "speculative")
LATENCIES = {
    "ttft": "specdec_time_to_first_token_seconds",
    "itl": "specdec_inter_token_latency_seconds",
    "e2e": "specdec_request_latency_seconds",
}
TOKENS_PER_SECOND = "specdec_request_tokens_per_second"
REQUESTS = "specdec_requests_total"
Z95, Z975 = 1.959964, 2.241403
# Fewer requests in an arm than this: no difference and no verdict (the
# normal approximations need them).
MIN_REQUESTS = 30

# A scrape: (sample name, sorted label pairs) -> value.
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_exposition(text: str) -> Scrape:
    """Every sample of a Prometheus text exposition."""
    samples: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def difference(after: Scrape, before: Scrape | None) -> Scrape:
    """What the counters gained between two scrapes (a counter that went down was reset: its value)."""
    if before is None:
        return dict(after)
    return {key: value - before.get(key, 0.0) if value >= before.get(key, 0.0) else value
            for key, value in after.items()}


def read_source(source: str) -> str:
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=30) as response:
            return response.read().decode()
    with open(source, encoding="utf-8") as handle:
        return handle.read()


def prometheus_scrape(url: str, window: str, get: Callable[[str], str] | None = None) -> Scrape:
    """The same samples as a scrape difference, from Prometheus' HTTP API: each
    series' increase() over ``window``, summed over pods."""
    get = get or read_source
    queries = [f"sum by (arm, le) (increase({name}_bucket[{window}]))" for name in
               (*LATENCIES.values(), TOKENS_PER_SECOND)]
    queries += [f"sum by (arm) (increase({name}_{part}[{window}]))" for name in
                (*LATENCIES.values(), TOKENS_PER_SECOND) for part in ("sum", "count")]
    queries.append(f"sum by (arm, outcome) (increase({REQUESTS}[{window}]))")
    samples: Scrape = {}
    for query in queries:
        name = query.split("(increase(")[1].split("[")[0]
        answer = json.loads(get(url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})))
        if answer.get("status") != "success":
            raise ValueError(f"Prometheus refused {query!r}: {answer.get('error', answer)}")
        for series in answer["data"]["result"]:
            labels = tuple(sorted(series["metric"].items()))
            samples[(name, labels)] = float(series["value"][1])
    return samples


def _series(samples: Scrape, name: str, arm: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for (sample, pairs), value in samples.items():
        found_labels = dict(pairs)
        if sample == name and found_labels.get("arm") == arm and all(found_labels.get(k) == v
                                                                      for k, v in labels.items()):
            found.append((found_labels, value))
    return found


def buckets(samples: Scrape, name: str, arm: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one arm's histogram, summed over other labels, +Inf last."""
    by_bound: dict[float, float] = defaultdict(float)
    for labels, value in _series(samples, f"{name}_bucket", arm):
        by_bound[float(labels["le"])] += value
    return sorted(by_bound.items())


def total(samples: Scrape, name: str, arm: str, **labels: str) -> float:
    return sum(value for _, value in _series(samples, name, arm, **labels))


def _rank_value(cumulative: list[tuple[float, float]], rank: float) -> tuple[float, float, float]:
    """(interpolated value, bucket lower edge, bucket upper edge) at ``rank`` observations."""
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        upper = bound if math.isfinite(bound) else lower  # the +Inf bucket: its lower edge, as PromQL does
        if count >= rank and count > below:
            return lower + (upper - lower) * (rank - below) / (count - below), lower, upper
        lower, below = upper, count
    return lower, lower, lower


@dataclass
class Estimate:
    value: float
    low: float
    high: float
    bucket: tuple[float, float] | None = None  # a quantile's bucket: the estimate's resolution


def quantile(cumulative: list[tuple[float, float]], q: float, z: float = Z95) -> Estimate | None:
    """The q-quantile with its distribution-free interval."""
    n = cumulative[-1][1] if cumulative else 0.0
    if n < 1:
        return None
    value, lower, upper = _rank_value(cumulative, q * n)
    spread = z * math.sqrt(n * q * (1 - q))
    low = _rank_value(cumulative, max(q * n - spread, 1e-9))[0]
    high = _rank_value(cumulative, min(q * n + spread, n))[0]
    return Estimate(value, min(low, value), max(high, value), (lower, upper))


def mean(cumulative: list[tuple[float, float]], total_sum: float, z: float = Z95) -> tuple[Estimate, float] | None:
    """The mean (exact from _sum/_count) with a normal interval; and its variance estimate / n."""
    n = cumulative[-1][1] if cumulative else 0.0
    if n < 1:
        return None
    average = total_sum / n
    lower, below, squares = 0.0, 0.0, 0.0
    for bound, count in cumulative:
        upper = bound if math.isfinite(bound) else lower
        middle = (lower + upper) / 2
        squares += (count - below) * (middle - average) ** 2
        lower, below = upper, count
    variance = squares / max(n - 1, 1)
    error = math.sqrt(variance / n)
    return Estimate(average, average - z * error, average + z * error), variance / n


def analyse(samples: Scrape) -> dict:
    """The report as a dict (the JSON output)."""
    arms: dict[str, dict] = {}
    for arm in ARMS:
        report = {
            "requests": total(samples, REQUESTS, arm, outcome="success"),
            "errors": total(samples, REQUESTS, arm, outcome="error"),
        }
        for key, name in LATENCIES.items():
            cumulative = buckets(samples, name, arm)
            for label, q in (("p50", 0.5), ("p99", 0.99)):
                estimate = quantile(cumulative, q)
                report[f"{key}_{label}"] = None if estimate is None else asdict(estimate)
        cumulative = buckets(samples, TOKENS_PER_SECOND, arm)
        estimate = mean(cumulative, total(samples, f"{TOKENS_PER_SECOND}_sum", arm))
        report["tokens_per_second"] = None if estimate is None else asdict(estimate[0])
        arms[arm] = report
    differences: dict[str, dict | None] = {}
    for key, name in LATENCIES.items():
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            spec = quantile(buckets(samples, name, "speculative"), q, Z975)
            spec_n, control_n = (arms[arm]["requests"] for arm in ("speculative", "control"))
            control = quantile(buckets(samples, name, "control"), q, Z975)
            decided = spec is not None and control is not None and min(spec_n, control_n) >= MIN_REQUESTS
            differences[f"{key}_{label}"] = None if not decided else asdict(Estimate(
                spec.value - control.value, spec.low - control.high, spec.high - control.low))
    rates = [mean(buckets(samples, TOKENS_PER_SECOND, arm), total(samples, f"{TOKENS_PER_SECOND}_sum", arm))
             for arm in ("speculative", "control")]
    if None in rates or min(arms[arm]["requests"] for arm in ARMS) < MIN_REQUESTS:
        differences["tokens_per_second"] = None
    else:
        (spec, spec_var), (control, control_var) = rates
        gap, error = spec.value - control.value, math.sqrt(spec_var + control_var)
        differences["tokens_per_second"] = asdict(Estimate(gap, gap - Z95 * error, gap + Z95 * error))
    return {"arms": arms, "difference": differences, "verdict": verdict(differences),
            "method": "quantiles: bucket-interpolated (buckets 20 % apart), 95 % interval from the binomial "
                      "rank; tokens/s: mean per request, normal interval; differences: "
                      "speculative - control, Bonferroni-combined 97.5 % quantile intervals, Welch for tokens/s"}


def verdict(differences: Mapping[str, dict | None]) -> str:
    rate, tail = differences.get("tokens_per_second"), differences.get("e2e_p99")
    if rate is None:
        return (f"not yet decided: an arm has fewer than {MIN_REQUESTS} requests "
                f"(is speculation_ab_fraction strictly between 0 and 1?)")
    tail_worse = tail is not None and tail["low"] > 0
    if rate["high"] < 0 or tail_worse:
        why = (f"tokens/s {rate['value']:+.2f} [{rate['low']:+.2f}, {rate['high']:+.2f}]" if rate["high"] < 0
               else f"end-to-end p99 {tail['value']:+.3f} s [{tail['low']:+.3f}, {tail['high']:+.3f}]")
        return f"speculation hurts: {why} (speculative - control, 95 %)"
    if rate["low"] > 0:
        return (f"speculation helps: tokens/s {rate['value']:+.2f} [{rate['low']:+.2f}, {rate['high']:+.2f}] "
                f"(speculative - control, 95 %), end-to-end p99 not worse")
    return (f"not yet decided: tokens/s {rate['value']:+.2f} [{rate['low']:+.2f}, {rate['high']:+.2f}] "
            f"includes 0; collect more requests")


def _cell(estimate: dict | None, scale: float = 1.0, unit: str = "") -> str:
    if estimate is None:
        return "-"
    def number(x: float) -> str:
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return (f"{number(estimate['value'] * scale)}{unit} [{number(estimate['low'] * scale)}, "
            f"{number(estimate['high'] * scale)}]")


def text_report(report: dict) -> str:
    rows = [("requests", lambda a: f"{a['requests']:.0f} ({a['errors']:.0f} errors)")]
    for key, title in (("ttft", "time to first token"), ("itl", "inter-token latency"),
                       ("e2e", "end-to-end latency")):
        for label in ("p50", "p99"):
            rows.append((f"{title} {label} (ms)", lambda a, k=f"{key}_{label}": _cell(a[k], 1000)))
    rows.append(("tokens/s per request (mean)", lambda a: _cell(a["tokens_per_second"])))
    width = max(len(title) for title, _ in rows)
    lines = [f"{'':{width}}  {'control':32}  {'speculative':32}  speculative - control"]
    for (title, show), key in zip(rows, [None, *[f"{k}_{q}" for k in LATENCIES for q in ("p50", "p99")],
                                         "tokens_per_second"]):
        scale = 1.0 if key == "tokens_per_second" else 1000
        gap = "" if key is None else _cell(report["difference"].get(key), scale)
        lines.append(f"{title:{width}}  {show(report['arms']['control']):32}  "
                     f"{show(report['arms']['speculative']):32}  {gap}")
    lines.append("95 % intervals in brackets; " + report["method"])
    lines.append(report["verdict"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-ab-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", help="the later /metrics scrape: a file or a URL (e.g. http://HOST:8002/metrics)")
    parser.add_argument("--before", help="the earlier scrape (omitted: since the server started)")
    parser.add_argument("--prometheus", help="Prometheus' base URL, instead of scrapes")
    parser.add_argument("--window", default="1h", help="with --prometheus: the range of increase() (default 1h)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.prometheus:
        samples = prometheus_scrape(args.prometheus, args.window)
    elif args.after:
        before = parse_exposition(read_source(args.before)) if args.before else None
        samples = difference(parse_exposition(read_source(args.after)), before)
    else:
        parser.error("give --after (and --before) scrapes, or --prometheus")
    report = analyse(samples)
    print(json.dumps(report, indent=2) if args.json else text_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
