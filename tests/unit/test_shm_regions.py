"""specdec-serve's shared-memory regions: named after the launcher, removed
once tritonserver has exited, and those of gone launchers removed at start
(launcher/shm_regions.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from launcher import launch, shm_regions
from tests.unit.test_security_config import fake_install


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _files(tmp_path, *names):
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 16)


def test_the_server_names_its_regions_after_its_launcher(tmp_path):
    options = launch.ServerOptions(admin_key="k" * 32)
    assert options.shm_region_prefix == f"specdec_{os.getpid()}_"
    command = launch.server_command(options, fake_install(tmp_path))
    assert f"--backend-config=python,shm-region-prefix-name=specdec_{os.getpid()}_" in command


def test_a_stopped_server_leaves_no_region_and_touches_no_others(tmp_path):
    _files(tmp_path, "specdec_41_aa", "specdec_41_bb", "specdec_411_cc", "triton_python_backend_shm_region_dd")
    assert sorted(shm_regions.remove("specdec_41_", tmp_path)) == ["specdec_41_aa", "specdec_41_bb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specdec_411_cc", "triton_python_backend_shm_region_dd"]


def test_at_start_the_regions_of_gone_launchers_go_and_live_ones_stay(tmp_path):
    dead, live, own = _dead_pid(), os.getppid(), os.getpid()
    _files(tmp_path, f"specdec_{dead}_a", f"specdec_{live}_b", f"specdec_{own}_c", "specdec_x_d",
           "triton_python_backend_shm_region_e")
    removed = shm_regions.remove_orphans(own, tmp_path)
    assert sorted(removed) == sorted([f"specdec_{dead}_a", f"specdec_{own}_c"])  # own: an earlier process's
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"specdec_{live}_b", "specdec_x_d", "triton_python_backend_shm_region_e"])


def test_the_gpu_entrypoint_removes_exactly_the_regions_its_server_names(tmp_path):
    script = (launch.PROJECT_ROOT / "docker" / "trtllm-entrypoint.sh").read_text()
    (named,) = re.findall(r"shm-region-prefix-name=(\S+)", script)
    (removed,) = re.findall(r"rm -f /dev/shm/(\S+)\*", script)
    assert named == removed == "specdec_trtllm_"
    assert "remove_shm_regions\nexit" in script  # after tritonserver exited, as well as at start
    _files(tmp_path, "specdec_trtllm_a")  # a cpu server's start-up sweep leaves a GPU server's regions alone
    assert shm_regions.remove_orphans(os.getpid(), tmp_path) == []
