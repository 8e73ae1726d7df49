"""HTTP calls to the test server, shared by the real-server test modules."""

from __future__ import annotations

import urllib.error
import urllib.request


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
