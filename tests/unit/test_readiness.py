"""One readiness wait for everything specdec-serve starts (selfheal/readiness.py)."""

import http.server
import subprocess
import sys
import threading

import pytest

from selfheal import readiness


@pytest.fixture
def ready_url():
    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v2/health/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_server_started_elsewhere_is_waited_for_without_a_process(ready_url):
    readiness.wait_for(None, f"{ready_url}/v2/health/ready", "tritonserver", timeout=5)


def test_a_server_that_never_answers_200_times_out_naming_it(ready_url):
    with pytest.raises(TimeoutError, match="tritonserver was not ready within 1 s"):
        readiness.wait_for(None, f"{ready_url}/missing", "tritonserver", timeout=1)


def test_a_process_that_exits_first_is_reported_with_its_code(ready_url):
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    with pytest.raises(RuntimeError, match="specdec-openai exited with code 3"):
        readiness.wait_for(process, f"{ready_url}/missing", "specdec-openai", timeout=5)


def test_a_wildcard_bind_is_reached_on_loopback():
    assert readiness.local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert readiness.local_url("10.0.0.5", 8000) == "http://10.0.0.5:8000"
