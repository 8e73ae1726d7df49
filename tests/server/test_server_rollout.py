"""Rolling speculation out, on the session's real server: the traffic split
through Triton's generate endpoint (arms by key, in the responses and the
metrics, greedy texts equal across arms), the dashboard's metrics against a
real scrape, and one traced request's rounds and engine calls as spans. The pure parts: tests/unit/test_ab_split.py, test_dashboard.py,
test_tracing.py."""

from __future__ import annotations

import copy
import json
import math
import re
import threading
import time
from collections import Counter

import pytest

from coordinator.request.parse import CONTROL, SPECULATIVE, ab_arm
from selfheal import triton_admin
from tests.server_client import http_status, metric, metrics_text
from tools.scrape import fetch_metrics
from tests.unit.test_dashboard import expressions, selectors

pytestmark = pytest.mark.slow

KEYS = 32
TOKENS = 8
# Short prompts, so 40 requests cost little; several keys share each prompt, so
# the same prompt is decoded in both arms.
PROMPTS = ("def add(a, b):\n", "def is_even(n):\n", "def reverse(s):\n", "def square(x):\n")
HALF = 0.5


def generate(server, prompt: str, key: str) -> dict:
    body = json.dumps({"text_input": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ab_key": key}).encode()
    status, text = http_status(server, "/v2/models/coordinator/generate", "POST", body=body)
    assert status == 200, (status, text)
    return json.loads(text)


@pytest.fixture
def split_server(triton_server):
    """The session's server with speculation_ab_fraction 0.5 (a config load), restored after."""
    server = triton_server
    original = triton_admin.config(server.http_url, "coordinator", server.admin_key, timeout=60)
    split = copy.deepcopy(original)
    split["parameters"]["speculation_ab_fraction"] = {"string_value": str(HALF)}
    triton_admin.load_config(server.http_url, "coordinator", split, server.admin_key, timeout=300)
    try:
        yield server
    finally:
        triton_admin.load_config(server.http_url, "coordinator", original, server.admin_key, timeout=300)


def test_a_half_split_sends_each_key_to_its_arm_and_both_arms_write_the_same_text(split_server):
    server = split_server
    keys = [f"user-{i}" for i in range(KEYS)]
    requests = [(key, PROMPTS[i % len(PROMPTS)]) for i, key in enumerate(keys)]
    requests += requests[:8]  # the same keys again
    answers: list[tuple[str, str, dict]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def worker(share):
        try:
            for key, prompt in share:
                answer = generate(server, prompt, key)
                with lock:
                    answers.append((key, prompt, answer))
        except BaseException as error:  # reported below
            failures.append(error)

    before = metrics_text(server)
    threads = [threading.Thread(target=worker, args=(requests[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert not failures, failures
    after = metrics_text(server)
    assert len(answers) == len(requests)

    # Every response names the arm its key hashes to, on every request of that key.
    arms: dict[str, set[str]] = {}
    for key, _, answer in answers:
        assert answer["speculation_arm"] == ab_arm(key.encode(), HALF), (key, answer)
        arms.setdefault(key, set()).add(answer["speculation_arm"])
    assert all(len(seen) == 1 for seen in arms.values())
    split = Counter(next(iter(seen)) for seen in arms.values())
    # 32 keys, each arm with probability 1/2: within three standard deviations of 16
    assert abs(split[CONTROL] - KEYS * HALF) <= 3 * math.sqrt(KEYS * HALF * HALF), split
    assert split[CONTROL] and split[SPECULATIVE]

    # The metrics count each arm's requests (repeats included).
    served = Counter(answer["speculation_arm"] for _, _, answer in answers)
    for arm in (CONTROL, SPECULATIVE):
        counted = (metric(after, "specdec_requests_total", outcome="success", arm=arm)
                   - metric(before, "specdec_requests_total", outcome="success", arm=arm))
        assert counted == served[arm], (arm, counted, served)
    # The control arm's tokens are counted as decoded plainly because none was asked for.
    control_tokens = sum(answer["completion_tokens"] for _, _, answer in answers
                         if answer["speculation_arm"] == CONTROL)
    plain = (metric(after, "specdec_plain_tokens_total", reason="not_requested")
             - metric(before, "specdec_plain_tokens_total", reason="not_requested"))
    assert plain >= control_tokens > 0, (plain, control_tokens)

    # Greedy texts are the same in both arms (speculation is lossless).
    texts: dict[str, dict[str, set[str]]] = {}
    for _, prompt, answer in answers:
        texts.setdefault(prompt, {}).setdefault(answer["speculation_arm"], set()).add(answer["text_output"])
    both = [prompt for prompt, by_arm in texts.items() if len(by_arm) == 2]
    assert len(both) >= 2, texts
    for prompt in texts:
        assert len(set().union(*texts[prompt].values())) == 1, (prompt, texts[prompt])


def test_every_metric_the_dashboard_names_is_in_a_scrape_of_the_server(triton_server):
    """The dashboard's names against what the running server and its engine
    watchdog really export (families are listed before any sample is observed)."""
    server = triton_server
    scraped = metrics_text(server) + fetch_metrics(server.watchdog_url)
    families = set(re.findall(r"^# TYPE (\S+) (\w+)", scraped, re.MULTILINE))
    names = {name for name, _ in families}
    names |= {f"{name}{suffix}" for name, kind in families if kind == "histogram"
              for suffix in ("_bucket", "_sum", "_count")}
    import promql_parser

    missing = {}
    for title, expr in expressions():
        for name in selectors(promql_parser.parse(expr.replace("$__rate_interval", "5m"))):
            if name not in names:
                missing.setdefault(title, []).append(name)
    assert not missing, f"panels name metrics the server does not export: {missing}"


@pytest.fixture
def traced_server(triton_server, tmp_path):
    """The session's server with the coordinator tracing to a file (a config load), restored after."""
    server = triton_server
    path = tmp_path / "spans.jsonl"
    original = triton_admin.config(server.http_url, "coordinator", server.admin_key, timeout=60)
    traced = copy.deepcopy(original)
    traced["parameters"]["trace_file"] = {"string_value": str(path)}
    triton_admin.load_config(server.http_url, "coordinator", traced, server.admin_key, timeout=300)
    try:
        yield server, path
    finally:
        triton_admin.load_config(server.http_url, "coordinator", original, server.admin_key, timeout=300)


def test_a_traced_request_shows_its_rounds_and_engine_calls_as_spans(traced_server):
    server, path = traced_server
    body = json.dumps({"text_input": "def add(a, b):\n", "max_tokens": 16, "temperature": 0.0,
                       "speculation_window": 4}).encode()
    status, text = http_status(server, "/v2/models/coordinator/generate", "POST", body=body)
    assert status == 200, (status, text)
    answer = json.loads(text)
    deadline = time.monotonic() + 30
    spans: list[dict] = []
    while time.monotonic() < deadline:  # the request's span ends just after its final response
        spans = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if any(span["name"] == "specdec request" for span in spans):
            break
        time.sleep(0.2)
    requests = [span for span in spans if span["name"] == "specdec request"]
    assert len(requests) == 1, [span["name"] for span in spans]
    request = requests[0]
    assert request["attributes"]["specdec.completion_tokens"] == answer["completion_tokens"]
    assert request["attributes"]["specdec.outcome"] == "success"
    children = [span for span in spans if span["parent_id"] == request["context"]["span_id"]]
    names = Counter(span["name"] for span in children)
    rounds = [span for span in children if span["name"] == "round"]
    # every round, and the engine calls: plain stretches streamed from the target,
    # speculative rounds as a draft call and a target call
    assert len(rounds) == answer["speculative_rounds"] + answer["plain_rounds"], names
    assert sum(span["attributes"]["specdec.emitted"] for span in rounds) == answer["completion_tokens"]
    assert names["target stream"] >= 1 and names["draft call"] >= 1 and names["target call"] >= 1, names
    drafted = sum(span["attributes"]["specdec.drafted"] for span in rounds)
    assert drafted == answer["total_draft_tokens"]
