"""The engine watchdog's decision logic, its /proc reading, its metrics and
its loop, without a server (selfheal/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import launch
from selfheal import decide, exposition, probe, stubs, triton_admin, watchdog
from selfheal.decide import EngineHealth, GiveUp, Reload, Settings


# ------------------------------------------------------------ decisions ----

def test_one_failed_check_is_not_a_crash_two_are():
    health = EngineHealth("target", Settings(failures_to_act=2))
    assert health.checked(False, "slow", 0.0) is None and not health.serving
    assert health.checked(True, "", 1.0) is None and health.serving  # the count restarts
    assert health.checked(False, "gone", 2.0) is None
    assert health.checked(False, "gone", 3.0) == Reload("target", "gone")
    assert health.state == decide.RELOADING and not health.serving


def test_checks_during_a_reload_change_nothing_and_a_reload_brings_it_back():
    health = EngineHealth("draft", Settings(failures_to_act=1))
    assert health.checked(False, "its stub process 7 exited", 10.0) == Reload("draft", "its stub process 7 exited")
    assert health.checked(False, "unknown model", 11.0) is None and health.state == decide.RELOADING
    assert health.reloaded(True, "", 25.5) is None
    assert health.serving and health.recoveries == 1 and health.last_downtime == pytest.approx(15.5)


def test_a_failed_reload_is_retried_then_given_up():
    health = EngineHealth("target", Settings(failures_to_act=1, max_reloads=2, window_seconds=600))
    assert isinstance(health.checked(False, "dead", 0.0), Reload)
    again = health.reloaded(False, "HTTP 400 load failed", 5.0)
    assert again == Reload("target", "reload failed: HTTP 400 load failed")
    final = health.reloaded(False, "HTTP 400 load failed", 9.0)
    assert isinstance(final, GiveUp) and "2 reloads within 600 s" in final.reason
    assert health.state == decide.FAILED
    assert health.checked(True, "", 10.0) is None and not health.serving  # failed for good


def test_an_engine_that_keeps_dying_is_given_up_but_old_crashes_are_forgotten():
    settings = Settings(failures_to_act=1, max_reloads=2, window_seconds=100)
    health = EngineHealth("draft", settings)
    for now in (0.0, 50.0):
        assert isinstance(health.checked(False, "dead", now), Reload)
        assert health.reloaded(True, "", now + 1) is None
    assert isinstance(health.checked(False, "dead", 60.0), GiveUp)

    spaced = EngineHealth("draft", settings)
    for now in (0.0, 150.0, 300.0, 450.0):  # one crash per 150 s: each is reloaded
        assert isinstance(spaced.checked(False, "dead", now), Reload)
        assert spaced.reloaded(True, "", now + 1) is None
    assert spaced.recoveries == 4


def test_a_reload_outcome_without_a_reload_is_a_bug():
    with pytest.raises(RuntimeError, match="never started"):
        EngineHealth("target").reloaded(True, "", 0.0)


@pytest.mark.parametrize("bad", [dict(failures_to_act=0), dict(max_reloads=0), dict(window_seconds=0)])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError):
        Settings(**bad)


# ------------------------------------------------------------- /proc ----

def fake_proc(tmp_path: Path, processes) -> Path:
    """A /proc with (pid, ppid, state, argv) entries."""
    for pid, ppid, state, argv in processes:
        entry = tmp_path / str(pid)
        entry.mkdir()
        (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (entry / "stat").write_text(f"{pid} (triton_python_b) {state} {ppid} 1 1 0 -1\n")
    (tmp_path / "self").mkdir()
    return tmp_path


def stub(name, model_dir="/repo/target/1/model.py"):
    return ["/cache/backends/python/triton_python_backend_stub", model_dir, "triton_python_backend_shm_region_1",
            "1048576", "1048576", "100", "/usr/lib/libpython3.11.so", "140", name, "/repo/target"]


def test_stubs_are_found_by_instance_name_and_parent(tmp_path):
    proc = fake_proc(tmp_path, [
        (201, 100, "S", stub("target_0_0")),
        (202, 100, "S", stub("draft_0_0")),
        (203, 100, "S", stub("target_0_1")),
        (301, 300, "S", stub("target_0_0")),  # another server's
        (204, 100, "Z", stub("target_1_0")),  # killed, not yet reaped
        (205, 100, "S", ["/usr/bin/python3", "target_0_0"]),  # not a stub
    ])
    assert stubs.stub_pids("target", 100, proc) == {201, 203}
    assert stubs.stub_pids("target", None, proc) == {201, 203, 301}
    assert stubs.stub_pids("draft", 100, proc) == {202}
    assert stubs.stub_pids("coordinator", 100, proc) == set()
    assert stubs.alive(201, proc) and not stubs.alive(204, proc) and not stubs.alive(999, proc)


def test_a_stubs_region_is_read_from_its_command_line(tmp_path):
    proc = fake_proc(tmp_path, [(201, 100, "S", stub("target_0_0")), (205, 100, "S", ["/usr/bin/python3", "x"])])
    assert stubs.shm_region(201, proc) == "triton_python_backend_shm_region_1"
    assert stubs.shm_region(205, proc) is None and stubs.shm_region(999, proc) is None


def test_a_servers_stubs_are_found_by_region_prefix_whatever_their_parent(tmp_path):
    def stub_of(region):
        argv = stub("coordinator_0_0")
        argv[2] = region
        return argv
    proc = fake_proc(tmp_path, [
        (201, 1, "S", stub_of("specdec_100_coordinator_0_0")),  # outlived tritonserver: init's now
        (202, 100, "S", stub_of("specdec_100_target_0_0")),
        (203, 1, "Z", stub_of("specdec_100_draft_0_0")),  # exited, not yet reaped
        (301, 300, "S", stub_of("specdec_1000_target_0_0")),  # another server's (its pid starts alike)
        (205, 1, "S", ["/usr/bin/python3", "x", "specdec_100_x"]),  # not a stub
    ])
    assert stubs.server_stub_pids("specdec_100_", proc) == {201, 202}


def test_only_a_region_in_the_shm_directory_is_ever_removed(tmp_path):
    region = tmp_path / "triton_python_backend_shm_region_1"
    region.write_bytes(b"x")
    assert stubs.release_region(region.name, tmp_path) and not region.exists()
    assert not stubs.release_region(region.name, tmp_path)  # already gone
    for bad in ("", "..", "triton_python_backend_shm_region_1/../../etc"):
        with pytest.raises(ValueError, match="not a shared-memory region's name"):
            stubs.release_region(bad, tmp_path)


def test_instance_names():
    assert stubs.instance_model("target_0_0") == "target"
    assert stubs.instance_model("tensorrt_llm_bls_0_3") == "tensorrt_llm_bls"
    assert stubs.instance_model("target") is None and stubs.instance_model("/repo/target_0_0/x") is None


def test_the_real_proc_is_readable():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert stubs.alive(child.pid)
        assert stubs.stub_pids("target", child.pid) == set()
    finally:
        child.kill()
        child.wait()
    assert not stubs.alive(child.pid)


# ------------------------------------------------------------ metrics ----

def test_metrics_text():
    up, down = EngineHealth("target"), EngineHealth("draft", Settings(failures_to_act=1))
    down.checked(False, "dead", 0.0)
    text = exposition.render([up, down])
    assert 'specdec_engine_up{model="target"} 1' in text and 'specdec_engine_up{model="draft"} 0' in text
    assert "# TYPE specdec_engine_recoveries_total counter" in text
    down.reloaded(True, "", 12.0)
    text = exposition.render([up, down])
    assert 'specdec_engine_recoveries_total{model="draft"} 1' in text
    assert 'specdec_engine_last_downtime_seconds{model="draft"} 12' in text
    from prometheus_client.parser import text_string_to_metric_families
    assert {f.name for f in text_string_to_metric_families(text)} == {
        "specdec_engine_up", "specdec_engine_recoveries", "specdec_engine_last_downtime_seconds"}


def test_metrics_are_served():
    from tests.conftest import free_port

    port = free_port()
    server = exposition.serve("127.0.0.1", port, lambda: [EngineHealth("draft")])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert 'specdec_engine_up{model="draft"} 1' in response.read().decode()
    finally:
        server.shutdown()


def test_liveness_fails_when_an_engine_stays_down_past_the_limit_or_was_given_up():
    engine = EngineHealth("target", Settings(failures_to_act=1, max_reloads=1))
    assert decide.engines_alive([engine], 0.0, 60.0) == (True, "ok")
    assert isinstance(engine.checked(False, "probe timed out", 100.0), Reload)
    assert decide.engines_alive([engine], 150.0, 60.0)[0]  # reloading, within the limit
    ok, reason = decide.engines_alive([engine], 161.0, 60.0)  # the reload hangs
    assert not ok and "target" in reason and "61 s" in reason and "limit 60 s" in reason
    assert decide.engines_alive([engine], 10_000.0, 0.0)[0]  # no limit
    engine.reloaded(True, "", 170.0)
    assert decide.engines_alive([engine], 10_000.0, 60.0)[0]  # back up: the clock is gone
    assert isinstance(engine.checked(False, "probe timed out", 200.0), GiveUp)  # one reload per window
    ok, reason = decide.engines_alive([engine], 211.0, 0.0)
    assert not ok and "given up" in reason


def test_livez_is_served_with_the_reason():
    from tests.conftest import free_port

    verdict = [(True, "ok")]
    port = free_port()
    server = exposition.serve("127.0.0.1", port, lambda: [EngineHealth("draft")], lambda: verdict[0])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=10) as response:
            assert response.status == 200
        verdict[0] = (False, "draft has been down for 200 s")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=10)
        assert refused.value.code == 503
        assert "draft has been down" in refused.value.read().decode()
    finally:
        server.shutdown()


def test_livez_asks_tritonserver_first(monkeypatch):
    args = watchdog.parse_args(["--down-limit", "30"])
    watcher = SimpleNamespace(health=EngineHealth("target"))
    live = watchdog.liveness(args, [watcher])
    monkeypatch.setattr(watchdog.readiness, "answers", lambda url, timeout: False)
    assert live() == (False, "tritonserver is not live")
    monkeypatch.setattr(watchdog.readiness, "answers", lambda url, timeout: url.endswith("/v2/health/live"))
    assert live() == (True, "ok")
    with pytest.raises(SystemExit):
        watchdog.parse_args(["--down-limit", "-1"])


def test_the_trtllm_entrypoint_starts_the_watchdog_with_flags_it_accepts():
    """The GPU image's watchdog command line (docker/trtllm-entrypoint.sh), its
    variables filled in, parses; the down limit is passed and checked at start."""
    script = (Path(__file__).resolve().parents[2] / "docker" / "trtllm-entrypoint.sh").read_text()
    line = next(line for line in script.splitlines() if "python3 -m selfheal.watchdog" in line)
    start = script.index(line)
    command = script[start:script.index("&\n", start)].replace("\\\n", " ")
    words = command.split("-m selfheal.watchdog", 1)[1].split()
    filled = [w.replace('"${ENGINE_DOWN_LIMIT}"', "180").replace('"${WATCHDOG_PORT}"', "8003") for w in words]
    args = watchdog.parse_args(filled)
    assert args.down_limit == 180 and args.detect == ["probe"]
    assert 'ENGINE_DOWN_LIMIT="${SPECDEC_ENGINE_DOWN_LIMIT:-180}"' in script
    assert "SPECDEC_ENGINE_DOWN_LIMIT must be a whole number" in script
    assert "export OMPI_MCA_btl_vader_single_copy_mechanism=none" in script


# ------------------------------------------------------ probe and admin ----

def test_the_probe_is_one_greedy_token_in_the_engine_contract():
    from coordinator.engines.contract import ENGINE_INPUTS

    inputs = {t.name(): t for t in probe.probe_inputs()}
    assert set(inputs) <= set(ENGINE_INPUTS) | {"random_seed"}
    assert {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id"} <= set(inputs)
    assert inputs["input_ids"].shape() == [1, 1] and inputs["runtime_top_k"].datatype() == "INT32"
    assert "seed" in {t.name() for t in probe.probe_inputs("seed")}


def test_a_probe_of_a_server_that_is_not_there_fails_quickly():
    from tests.conftest import free_port

    started = time.monotonic()
    ok, reason = probe.probe(f"127.0.0.1:{free_port()}", "target", timeout=5)
    assert not ok and reason and time.monotonic() - started < 10


def test_admin_calls_carry_the_key_and_report_refusals():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the model's config
            seen.append((self.path, self.headers.get(triton_admin.ADMIN_KEY_HEADER), b""))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"name": "draft", "max_batch_size": 8, "parameters": {
                "model_dir": {"string_value": "/m"}}}).encode())

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers.get(triton_admin.ADMIN_KEY_HEADER), body))
            ok = self.headers.get(triton_admin.ADMIN_KEY_HEADER) == "k" * 32
            self.send_response(200 if ok else 403)
            self.end_headers()
            self.wfile.write(b"" if ok else b'{"error":"forbidden"}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        triton_admin.reload(url, "draft", "k" * 32, timeout=10)
        assert [path for path, _, _ in seen] == ["/v2/repository/models/draft/unload",
                                                 "/v2/repository/models/draft/load"]
        assert b'"unload_dependents": false' in seen[0][2]
        with pytest.raises(triton_admin.AdminError, match="HTTP 403.*forbidden"):
            triton_admin.load(url, "draft", "wrong-key-0123456789", timeout=10)
        seen.clear()
        triton_admin.reload_in_place(url, "draft", "k" * 32, timeout=10)
        assert [(path, key) for path, key, _ in seen] == [("/v2/models/draft/config", "k" * 32),
                                                          ("/v2/repository/models/draft/load", "k" * 32)]
        config = json.loads(json.loads(seen[1][2])["parameters"]["config"])
        assert config["name"] == "draft" and config["max_batch_size"] == 8  # the model's own, as served
        assert int(config["parameters"][triton_admin.GENERATION_PARAMETER]["string_value"]) > 0
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(triton_admin.AdminError):
        triton_admin.load(url, "draft", "k" * 32, timeout=5)  # nothing listens any more


# -------------------------------------------------------------- loop ----

def watcher_args(**overrides):
    args = dict(detect=["probe"], in_place=["draft"], server_pid=None, interval=0.01, probe_interval=0.0, probe_timeout=1.0,
                seed_input="random_seed", grpc_url="x:1", http_url="http://x:1", load_timeout=5.0)
    return SimpleNamespace(**(args | overrides))


def test_the_loop_reloads_a_dead_engine_and_watches_it_again(monkeypatch):
    answers = iter([(True, ""), (False, "Stub process 'draft_0_0' is not healthy."),
                    (False, "Stub process 'draft_0_0' is not healthy.")])
    stop = threading.Event()
    reloads = []

    def fake_probe(url, model, timeout, seed_input, api_key):
        assert api_key == "a" * 32  # a probe is an inference call: it carries the API key
        try:
            return next(answers)
        except StopIteration:
            stop.set()
            return True, ""

    monkeypatch.setattr(probe, "probe", fake_probe)
    monkeypatch.setattr(triton_admin, "reload", lambda url, model, key, timeout: reloads.append(("unload", model)))
    monkeypatch.setattr(triton_admin, "reload_in_place",
                        lambda url, model, key, timeout: reloads.append(("in place", model, key)))
    watcher = watchdog.Watcher("draft", watcher_args(), "k" * 32, Settings(failures_to_act=2), stop, "a" * 32)
    watcher.run()
    assert reloads == [("in place", "draft", "k" * 32)]  # the server stays ready without its draft
    assert watcher.health.serving and watcher.health.recoveries == 1 and not watcher.gave_up


def test_the_loop_gives_up_when_reloads_fail(monkeypatch, capsys):
    def failing_reload(url, model, key, timeout):
        raise triton_admin.AdminError("HTTP 400 failed to load 'target'")

    monkeypatch.setattr(probe, "probe", lambda *args: (False, "no answer"))
    monkeypatch.setattr(triton_admin, "reload", failing_reload)  # the target: unloaded first
    stop = threading.Event()
    watcher = watchdog.Watcher("target", watcher_args(), "k" * 32, Settings(failures_to_act=1, max_reloads=2), stop)
    watcher.run()
    assert watcher.gave_up and stop.is_set()
    err = capsys.readouterr().err
    assert err.count("reloading it") == 2 and "target: giving up" in err and "failed to load 'target'" in err


def test_the_stub_check_notices_an_exited_process(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(stubs, "stub_pids", lambda model, parent: {child.pid})
    watcher = watchdog.Watcher("target", watcher_args(detect=["stubs"]), "k" * 32, Settings(), threading.Event())
    watcher.watch_stubs()
    assert watcher.check(0.0) == (True, "")
    child.kill()
    child.wait()
    assert watcher.check(1.0) == (False, f"its stub process {child.pid} exited")


def test_a_reload_removes_the_dead_stubs_region_and_keeps_the_living_ones(monkeypatch, tmp_path, capsys):
    dead, living = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2))
    regions = {dead.pid: "triton_python_backend_shm_region_dead", living.pid: "triton_python_backend_shm_region_live"}
    for name in regions.values():
        (tmp_path / name).write_bytes(b"\0" * 16)
    monkeypatch.setattr(stubs, "SHM_DIR", tmp_path)
    monkeypatch.setattr(stubs, "stub_pids", lambda model, parent: set(regions))
    monkeypatch.setattr(stubs, "shm_region", regions.get)
    monkeypatch.setattr(triton_admin, "reload_in_place", lambda url, model, key, timeout: None)
    try:
        watcher = watchdog.Watcher("draft", watcher_args(detect=["stubs"]), "k" * 32, Settings(failures_to_act=1),
                                   threading.Event())
        watcher.watch_stubs()
        dead.kill()
        dead.wait()
        action = watcher.health.checked(*watcher.check(0.0), 0.0)
        assert isinstance(action, Reload)
        watcher.reload(action)
    finally:
        living.kill()
        living.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["triton_python_backend_shm_region_live"]
    assert "removed the dead stub's shared-memory region triton_python_backend_shm_region_dead" in capsys.readouterr().err


def test_a_stub_that_triton_replaced_is_no_crash(monkeypatch, capsys):
    old, new = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2))
    live = {old.pid}
    monkeypatch.setattr(stubs, "stub_pids", lambda model, parent: {p for p in live if stubs.alive(p)})
    try:
        watcher = watchdog.Watcher("draft", watcher_args(detect=["stubs"]), "k" * 32, Settings(), threading.Event())
        watcher.watch_stubs()
        live.add(new.pid)  # a reload by someone else: Triton starts the new instance's stub,
        old.kill()  # swaps the instances, and the old stub exits
        old.wait()
        assert watcher.check(0.0) == (True, "")
        assert watcher.pids == {new.pid}
        assert f"Triton replaced its stub process {old.pid}" in capsys.readouterr().err
        new.kill()  # then that one crashes: nothing replaces it
        new.wait()
        assert watcher.check(1.0) == (False, f"its stub process {new.pid} exited")
    finally:
        for child in (old, new):
            child.kill()
            child.wait()


def test_the_watchdog_needs_the_admin_key_and_takes_it_out_of_its_environment(monkeypatch, capsys):
    monkeypatch.delenv("SPECDEC_ADMIN_KEY", raising=False)
    assert watchdog.main(["--metrics-port", "0"]) == 2
    assert "SPECDEC_ADMIN_KEY is not set" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        watchdog.parse_args(["--detect", "psychic"])


def test_the_launcher_starts_the_watchdog_with_the_key_and_this_servers_stubs():
    command = launch.engine_watchdog.command("http://127.0.0.1:8000", 4242, "127.0.0.1", 8003)
    assert command[1:3] == ["-m", "selfheal.watchdog"]
    assert "--server-pid" in command and "4242" in command and "stubs" in command
    env = launch.engine_watchdog.environment("k" * 32, launch.ADMIN_KEY_VAR)
    assert env[launch.ADMIN_KEY_VAR] == "k" * 32 and launch.API_KEY_VAR not in env
    env = launch.engine_watchdog.environment("k" * 32, launch.ADMIN_KEY_VAR, "a" * 32)
    assert env[launch.API_KEY_VAR] == "a" * 32  # for its probes, which are inference calls


def test_the_watchdog_takes_the_api_key_out_of_its_environment_and_probes_with_it(monkeypatch):
    monkeypatch.setenv("SPECDEC_ADMIN_KEY", "k" * 32)
    monkeypatch.setenv("SPECDEC_API_KEY", "a" * 32)
    seen = {}

    class Stop(Exception):
        pass

    def first_watcher(model, args, admin_key, settings, stop, api_key=None):
        seen.update(api_key=api_key, env=os.environ.get("SPECDEC_API_KEY"))
        raise Stop

    monkeypatch.setattr(watchdog, "Watcher", first_watcher)
    with pytest.raises(Stop):
        watchdog.main(["--metrics-port", "0", "--detect", "probe"])
    assert seen == {"api_key": "a" * 32, "env": None}


def test_the_launcher_loads_every_model_under_explicit_control(tmp_path):
    command = launch.server_command(launch.ServerOptions(admin_key="k" * 32),
                                    launch.tritonserver.TritonInstall(tmp_path, tmp_path, tmp_path))
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    assert "--strict-readiness=true" in command


def test_the_engines_accept_the_reload_parameter():
    from cpu_engine.engine import KNOWN_PARAMETERS

    assert triton_admin.GENERATION_PARAMETER in KNOWN_PARAMETERS


def test_only_the_draft_is_reloaded_in_place_by_default():
    assert watchdog.parse_args([]).in_place == ["draft"]


def test_a_metrics_port_in_use_is_a_clear_error(monkeypatch, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("SPECDEC_ADMIN_KEY", "k" * 32)
        code = watchdog.main(["--metrics-port", str(taken.getsockname()[1]), "--detect", "probe"])
    assert code == 2
    assert "cannot serve metrics" in capsys.readouterr().err


def test_any_failure_of_a_reload_counts_and_a_broken_watcher_stops_the_watchdog(monkeypatch, capsys):
    def unreadable_config(url, model, key, timeout):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    monkeypatch.setattr(probe, "probe", lambda *args: (False, "no answer"))
    monkeypatch.setattr(triton_admin, "reload_in_place", unreadable_config)
    stop = threading.Event()
    watcher = watchdog.Watcher("draft", watcher_args(), "k" * 32, Settings(failures_to_act=1, max_reloads=1), stop)
    watcher.run()
    assert watcher.gave_up and "reload failed" in capsys.readouterr().err

    monkeypatch.setattr(probe, "probe", lambda *args: 1 / 0)
    stop = threading.Event()
    watcher = watchdog.Watcher("draft", watcher_args(), "k" * 32, Settings(), stop)
    watcher.run()
    assert watcher.gave_up and stop.is_set() and "the watchdog itself failed" in capsys.readouterr().err
