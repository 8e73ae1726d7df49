"""The launcher ends its server's Python-backend stubs that outlive tritonserver
(launcher/launch.py ``_kill_stray_stubs``), and only those."""

import os
import shutil
import signal
import subprocess
import time

import pytest

from launcher import launch
from selfheal import stubs

pytestmark = pytest.mark.skipif(shutil.which("tail") is None or not os.path.isdir("/proc"),
                                reason="needs /proc and tail")


def fake_stub(directory, region):
    """A process whose command line reads as a stub's (``<stub> <arg> <region>``)."""
    (directory / region).write_text("")
    return subprocess.Popen(["bash", "-c", f"exec -a /backends/python/{stubs.STUB_BINARY} tail -f {region}"],
                            cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(prefix, pid):
    deadline = time.monotonic() + 10
    while pid not in stubs.server_stub_pids(prefix):
        assert time.monotonic() < deadline, "the fake stub never showed in /proc"
        time.sleep(0.05)


def test_the_launcher_kills_only_its_own_servers_stray_stubs(tmp_path, capsys):
    ours, theirs = f"specdec_9{os.getpid()}_", f"specdec_8{os.getpid()}_"
    mine, other = fake_stub(tmp_path, f"{ours}coordinator_0_0"), fake_stub(tmp_path, f"{theirs}target_0_0")
    try:
        wait_for(ours, mine.pid)
        wait_for(theirs, other.pid)
        launch._kill_stray_stubs(ours)
        assert mine.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
        assert f"pid {mine.pid}" in capsys.readouterr().out
    finally:
        for process in (mine, other):
            if process.poll() is None:
                process.kill()
                process.wait()
