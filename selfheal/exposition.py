"""The watchdog's metrics in Prometheus' text format, and a liveness
endpoint, on a port of its own (Triton's metrics port serves only what models
register, and the engines' state must be known even when no request reaches
the coordinator).

Written without prometheus-client: the watchdog also runs in the GPU image,
whose Python packages keep TensorRT-LLM's pins and do not include it, and
three samples per engine need no library (the tests read this output with
prometheus-client's reference parser)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from selfheal.decide import EngineHealth

DEFAULT_PORT = 8003
PORT_VAR = "SPECDEC_WATCHDOG_PORT"

METRICS = (
    ("specdec_engine_up", "gauge",
     "1 while the engine serves (its latest check passed), 0 while it is down or being reloaded",
     lambda h: 1 if h.serving else 0),
    ("specdec_engine_recoveries_total", "counter", "Reloads by the watchdog that brought a dead engine back",
     lambda h: h.recoveries),
    ("specdec_engine_last_downtime_seconds", "gauge",
     "Seconds from the watchdog noticing the engine down to it serving again, at its latest recovery",
     lambda h: h.last_downtime or 0.0),
)


def render(engines: Iterable[EngineHealth]) -> str:
    engines = list(engines)
    lines = []
    for name, kind, description, value in METRICS:
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{model="{h.model}"}} {value(h):g}' for h in engines]
    return "\n".join(lines) + "\n"


def serve(address: str, port: int, engines: Callable[[], Iterable[EngineHealth]],
          live: Callable[[], tuple[bool, str]] | None = None) -> ThreadingHTTPServer:
    """Answer GET /metrics, and GET /livez (200, or 503 with the reason: a
    liveness probe) when ``live`` is given, on ``address``:``port`` from a
    daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if path == "/metrics":
                self.answer(200, render(engines()), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/livez" and live is not None:
                ok, reason = live()
                self.answer(200 if ok else 503, reason + "\n", "text/plain; charset=utf-8")
            else:
                self.send_error(404)

        def answer(self, status: int, text: str, content_type: str) -> None:
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per scrape would drown the server's log
            pass

    server = ThreadingHTTPServer((address, port), Handler)
    threading.Thread(target=server.serve_forever, name="watchdog-metrics", daemon=True).start()
    return server
