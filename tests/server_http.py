"""HTTP calls to the test server (its HTTP and metrics ports), shared by the
real-server test modules."""

from __future__ import annotations

import urllib.error
import urllib.request

from coordinator.scrape import fetch_metrics, metric_value


def http_status(server, path, method="GET", headers=None, body=None) -> tuple[int, str]:
    """(status, body) of an HTTP call; a POST without a body sends ``{}``."""
    if body is None and method == "POST":
        body = b"{}"
    request = urllib.request.Request(f"{server.http_url}{path}", method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def metrics_text(server) -> str:
    return fetch_metrics(f"{server.metrics_url}/metrics")


def metric(body: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels`` (fails if none is exported)."""
    try:
        return metric_value(body, name, **labels)
    except KeyError as missing:
        raise AssertionError(str(missing)) from None
