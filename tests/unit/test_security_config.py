"""Offline checks of the server's lock-down: both launch paths (specdec-serve
for the cpu profile, docker/trtllm-entrypoint.sh for the trtllm image)
restrict the same Triton APIs behind the same header (model loading among
them: only the engine watchdog, which holds the key, reloads a model) and keep
the admin key out of the models' environment and out of the images."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from launcher import launch, tritonserver
from tests._config_helpers import ROOT

ENTRYPOINT = ROOT / "docker" / "trtllm-entrypoint.sh"
OPEN_APIS = {"health", "metadata", "inference"}  # Triton's other categories: needed by every client


def fake_install(tmp_path: Path) -> tritonserver.TritonInstall:
    return tritonserver.TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", tmp_path / "lib")


def test_launcher_restricts_every_admin_api_model_control_included(tmp_path):
    options = launch.ServerOptions(admin_key="k" * 32)
    command = launch.server_command(options, fake_install(tmp_path))
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    setting = f"{','.join(launch.RESTRICTED_APIS)}:specdec-admin-key={'k' * 32}"
    assert f"--http-restricted-api={setting}" in command
    assert f"--grpc-restricted-protocol={setting}" in command
    assert set(launch.RESTRICTED_APIS) == {
        "model-repository", "model-config", "shared-memory", "statistics", "trace", "logging"
    }
    assert not set(launch.RESTRICTED_APIS) & OPEN_APIS


def test_each_start_gets_its_own_key_unless_one_is_given(monkeypatch):
    assert launch.ServerOptions().admin_key != launch.ServerOptions().admin_key
    assert len(launch.ServerOptions().admin_key) == 64
    monkeypatch.setenv("SPECDEC_ADMIN_KEY", "my-admin-key-0123456789")
    options = launch._parse_args([])
    assert options.admin_key == "my-admin-key-0123456789" and options.admin_key_from_env
    assert "my-admin-key" not in repr(options)
    monkeypatch.delenv("SPECDEC_ADMIN_KEY")
    assert not launch._parse_args([]).admin_key_from_env


@pytest.mark.parametrize("key", ["short", "has space in it 0123", "a:b=c,d0123456789", "x" * 257])
def test_a_key_that_would_break_the_flag_syntax_is_refused(key):
    with pytest.raises(launch.AdminKeyError, match="SPECDEC_ADMIN_KEY must be 16 to 256 characters"):
        launch.restricted_api_args(key)


def test_the_models_never_see_the_admin_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_ADMIN_KEY", "my-admin-key-0123456789")
    pair = launch.PreparedPair(tmp_path, tmp_path, tmp_path)
    env = launch.server_environment(launch._parse_args([]), pair, fake_install(tmp_path))
    assert "SPECDEC_ADMIN_KEY" not in env
    assert "my-admin-key-0123456789" not in " ".join(env.values())


def test_the_trtllm_entrypoint_restricts_the_same_apis_behind_the_same_header():
    text = ENTRYPOINT.read_text()
    apis = re.search(r'^RESTRICTED_APIS="([^"]*)"', text, re.MULTILINE).group(1)
    assert tuple(apis.split(",")) == launch.RESTRICTED_APIS
    assert re.search(r'^ADMIN_KEY_HEADER="([^"]*)"', text, re.MULTILINE).group(1) == launch.ADMIN_KEY_HEADER
    for flag in ('--model-control-mode=explicit', "--load-model='*'", '--http-restricted-api="${restricted}"',
                 '--grpc-restricted-protocol="${restricted}"'):
        assert flag in text
    assert "unset SPECDEC_ADMIN_KEY" in text


def entrypoint_key_logic() -> str:
    """The entrypoint's key handling, runnable on its own (up to the flag setting)."""
    text = ENTRYPOINT.read_text()
    start = text.index('RESTRICTED_APIS="')
    end = text.index('restricted="${RESTRICTED_APIS}')
    end = text.index("\n", end) + 1
    return 'die() { echo "error: $*" >&2; exit 1; }\n' + text[start:end] + 'echo "${restricted}"\n'


@pytest.mark.parametrize(
    "key,ok",
    [("", True), ("my-admin-key-0123456789", True), ("short", False), ("bad key with spaces!", False)],
)
def test_the_trtllm_entrypoint_key_handling(key, ok):
    env = {"PATH": "/usr/bin:/bin"} | ({"SPECDEC_ADMIN_KEY": key} if key else {})
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", entrypoint_key_logic()], env=env,
                         capture_output=True, text=True, timeout=30)
    assert (run.returncode == 0) is ok, run.stderr
    if ok:
        apis, _, credential = run.stdout.strip().partition(":")
        assert apis == ",".join(launch.RESTRICTED_APIS)
        header, _, value = credential.partition("=")
        assert header == "specdec-admin-key"
        assert value == key if key else re.fullmatch(r"[0-9a-f]{64}", value)


def test_no_secret_is_baked_into_images_or_manifests():
    files = [p for p in (ROOT / "docker").rglob("*") if p.is_file()]
    files += [p for p in (ROOT / "k8s").rglob("*") if p.is_file()]
    for path in files:
        text = path.read_text(errors="replace")
        assert not re.search(r"SPECDEC_ADMIN_KEY\s*[=:]\s*['\"]?[A-Za-z0-9]{8,}", text), path
        assert not re.search(r"^\s*(ENV|ARG)\s+.*(KEY|TOKEN|PASSWORD|SECRET)", text, re.MULTILINE | re.IGNORECASE), path


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.trtllm"])
def test_images_run_as_a_non_root_user(dockerfile):
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "docker" / dockerfile).read_text(), re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_the_documented_threat_model_matches_the_launch_flags():
    """docs/security.md names what the launcher actually restricts."""
    section = (ROOT / "docs" / "security.md").read_text()
    restricted = re.search(r"put (.+?) behind the admin key", " ".join(section.split())).group(1)
    named = {name.strip() for name in re.split(r",| and ", restricted) if name.strip()}
    assert named == set(launch.RESTRICTED_APIS)
    assert f"header `{launch.ADMIN_KEY_HEADER}`" in section
    command = launch.server_command(launch.ServerOptions(), fake_install(Path("/nonexistent")))
    assert "--model-control-mode=explicit" in section and "--model-control-mode=explicit" in command
    assert "--http-restricted-api" in section and "--grpc-restricted-protocol" in section
    assert "127.0.0.1" in section and launch.ServerOptions().address == "127.0.0.1"
    for port in (8000, 8001, 8002):
        assert f"| {port} |" in section


# ------------------------------------------------------- the inference key ----

API_KEY = "the-api-key-0123456789"


def test_with_an_api_key_inference_is_restricted_to_it_and_the_admin_apis_stay_on_theirs(tmp_path):
    options = launch.ServerOptions(admin_key="k" * 32, api_key=API_KEY)
    command = launch.server_command(options, fake_install(tmp_path))
    inference = f"inference:specdec-api-key={API_KEY}"
    assert f"--http-restricted-api={inference}" in command and f"--grpc-restricted-protocol={inference}" in command
    admin = f"{','.join(launch.RESTRICTED_APIS)}:specdec-admin-key={'k' * 32}"
    assert f"--http-restricted-api={admin}" in command  # each category in one flag only: Triton's rule
    assert launch.INFERENCE_APIS == ("inference",) and not set(launch.INFERENCE_APIS) & set(launch.RESTRICTED_APIS)
    assert (launch.API_KEY_HEADER, launch.GRPC_API_KEY_HEADER) == (
        "specdec-api-key", "triton-grpc-protocol-specdec-api-key")
    without = launch.server_command(launch.ServerOptions(admin_key="k" * 32), fake_install(tmp_path))
    assert not [arg for arg in without if "inference:" in arg]


def test_the_api_key_comes_from_the_environment_only_and_is_never_shown(monkeypatch):
    monkeypatch.setenv("SPECDEC_API_KEY", f" {API_KEY} ")
    options = launch._parse_args([])
    assert options.api_key == API_KEY and API_KEY not in repr(options)
    monkeypatch.delenv("SPECDEC_API_KEY")
    assert launch._parse_args([]).api_key is None  # unset: no key (allowed on loopback only)
    with pytest.raises(SystemExit):  # there is no flag that would put it where `ps` shows it
        launch._parse_args(["--api-key", API_KEY])


def test_the_api_key_may_come_from_a_file_as_a_mounted_secret(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    secret = tmp_path / "api-key"
    secret.write_text(API_KEY + "\n")
    monkeypatch.setenv("SPECDEC_API_KEY_FILE", str(secret))
    assert launch._parse_args([]).api_key == API_KEY


@pytest.mark.parametrize("environment, message", [
    ({"SPECDEC_API_KEY": ""}, "SPECDEC_API_KEY is set but empty"),
    ({"SPECDEC_API_KEY": "  "}, "SPECDEC_API_KEY is set but empty"),
    ({"SPECDEC_API_KEY_FILE": "/nonexistent/api-key"}, "SPECDEC_API_KEY_FILE: cannot read /nonexistent/api-key"),
    ({"SPECDEC_API_KEY_FILE": "EMPTY"}, "is empty; it must hold the key"),
    ({"SPECDEC_API_KEY_FILE": ""}, "SPECDEC_API_KEY_FILE is set but empty"),
    ({"SPECDEC_API_KEY": API_KEY, "SPECDEC_API_KEY_FILE": "EMPTY"}, "not both"),
])
def test_a_key_setting_that_cannot_be_used_stops_the_server_at_start_by_name(monkeypatch, tmp_path, capsys,
                                                                             environment, message):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for name in ("SPECDEC_API_KEY", "SPECDEC_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, str(empty) if value == "EMPTY" else value)
    with pytest.raises(SystemExit) as stopped:
        launch._parse_args([])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("key", ["short", "has space in it 0123", "a:b=c,d0123456789"])
def test_an_api_key_that_would_break_the_flag_syntax_is_refused_by_name(key):
    with pytest.raises(launch.AdminKeyError, match="SPECDEC_API_KEY must be 16 to 256 characters"):
        launch.check_access(launch.ServerOptions(api_key=key))


def test_the_api_key_must_differ_from_the_admin_key():
    with pytest.raises(launch.AdminKeyError, match="SPECDEC_API_KEY must differ from SPECDEC_ADMIN_KEY"):
        launch.check_access(launch.ServerOptions(admin_key=API_KEY, api_key=API_KEY))


@pytest.mark.parametrize("address,allowed", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                             ("0.0.0.0", False), ("10.1.2.3", False), ("my-host", False)])
def test_open_inference_beyond_loopback_needs_to_be_asked_for(address, allowed):
    options = launch.ServerOptions(address=address)
    if allowed:
        launch.check_access(options)
    else:
        with pytest.raises(launch.OpenInferenceError, match="without SPECDEC_API_KEY would open inference"):
            launch.check_access(options)
        launch.check_access(launch.ServerOptions(address=address, allow_open_inference=True))
        launch.check_access(launch.ServerOptions(address=address, api_key=API_KEY))


def test_specdec_serve_refuses_to_start_with_inference_open_to_the_network(monkeypatch, capsys):
    for name in ("SPECDEC_API_KEY", "SPECDEC_ALLOW_OPEN_INFERENCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECDEC_ADDRESS", "0.0.0.0")
    monkeypatch.setattr(launch, "prepare", lambda options: pytest.fail("started preparing the models"))
    assert launch.main([]) == 2
    error = capsys.readouterr().err
    assert "SPECDEC_API_KEY" in error and "SPECDEC_ALLOW_OPEN_INFERENCE=1" in error
    monkeypatch.setenv("SPECDEC_ALLOW_OPEN_INFERENCE", "1")
    assert launch._parse_args([]).allow_open_inference
    assert launch._parse_args(["--allow-open-inference"]).allow_open_inference


def test_only_the_frontend_and_the_watchdog_get_the_api_key(tmp_path, monkeypatch):
    from launcher import engine_watchdog, openai_frontend

    monkeypatch.setenv("SPECDEC_API_KEY", API_KEY)
    pair = launch.PreparedPair(tmp_path, tmp_path, tmp_path)
    env = launch.server_environment(launch._parse_args([]), pair, fake_install(tmp_path))
    assert "SPECDEC_API_KEY" not in env and API_KEY not in " ".join(env.values())  # not the models'
    assert openai_frontend.environment(api_key=API_KEY)["SPECDEC_API_KEY"] == API_KEY
    assert "SPECDEC_API_KEY" not in openai_frontend.environment()  # an inherited one is not passed on
    assert engine_watchdog.environment("k" * 32, "SPECDEC_ADMIN_KEY", API_KEY)["SPECDEC_API_KEY"] == API_KEY
    command = openai_frontend.command("127.0.0.1:8001", tmp_path, "127.0.0.1", 9000)
    assert API_KEY not in " ".join(command)


def test_the_trtllm_entrypoint_restricts_inference_as_the_launcher_does():
    text = ENTRYPOINT.read_text()
    apis = re.search(r'^INFERENCE_APIS="([^"]*)"', text, re.MULTILINE).group(1)
    assert tuple(apis.split(",")) == launch.INFERENCE_APIS
    assert re.search(r'^API_KEY_HEADER="([^"]*)"', text, re.MULTILINE).group(1) == launch.API_KEY_HEADER
    assert '"${inference_flags[@]}"' in text and "unset SPECDEC_API_KEY" in text


def entrypoint_api_key_logic() -> str:
    """The entrypoint's key handling, both keys, runnable on its own."""
    text = ENTRYPOINT.read_text()
    start = text.index('RESTRICTED_APIS="')
    end = text.index("\n# Two TensorRT-LLM models")
    return ('die() { echo "error: $*" >&2; exit 1; }\n' + text[start:end]
            + 'echo "${inference_flags[*]}"; echo "${SPECDEC_API_KEY:-unset}"\n')


@pytest.mark.parametrize("env,ok", [
    ({}, False),
    ({"SPECDEC_ALLOW_OPEN_INFERENCE": "1"}, True),
    ({"SPECDEC_API_KEY": API_KEY}, True),
    ({"SPECDEC_API_KEY": "short"}, False),
    ({"SPECDEC_API_KEY": "bad key with spaces!"}, False),
    ({"SPECDEC_API_KEY": API_KEY, "SPECDEC_ADMIN_KEY": API_KEY}, False),
    ({"SPECDEC_API_KEY_FILE": "KEYFILE"}, True),  # the Secret mounted as a file
    ({"SPECDEC_API_KEY": ""}, False),  # set but empty
    ({"SPECDEC_API_KEY_FILE": "/nonexistent/api-key"}, False),
    ({"SPECDEC_API_KEY_FILE": "EMPTYFILE"}, False),
    ({"SPECDEC_API_KEY_FILE": ""}, False),
    ({"SPECDEC_API_KEY": API_KEY, "SPECDEC_API_KEY_FILE": "KEYFILE"}, False),
])
def test_the_trtllm_entrypoint_api_key_handling(tmp_path, env, ok):
    files = {"KEYFILE": tmp_path / "key", "EMPTYFILE": tmp_path / "empty"}
    files["KEYFILE"].write_text(API_KEY + "\n")
    files["EMPTYFILE"].write_text("\n")
    env = {name: str(files.get(value, value)) for name, value in env.items()}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", entrypoint_api_key_logic()],
                         env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)
    assert (run.returncode == 0) is ok, run.stderr
    if not ok:
        assert "SPECDEC_API_KEY" in run.stderr
        return
    flags, exported = run.stdout.rstrip("\n").split("\n")
    assert exported == "unset"  # tritonserver's environment, and so the models', has no key
    if "SPECDEC_API_KEY" in env or "SPECDEC_API_KEY_FILE" in env:
        setting = f"inference:specdec-api-key={API_KEY}"
        assert flags.split() == [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]
    else:
        assert flags == ""


def test_the_documented_inference_key_matches_the_launcher():
    text = " ".join((ROOT / "docs" / "security.md").read_text().split())
    for name in (launch.API_KEY_VAR, launch.ALLOW_OPEN_INFERENCE_VAR, launch.API_KEY_HEADER,
                 launch.GRPC_API_KEY_HEADER, "Authorization: Bearer", "hmac.compare_digest", "/proc/<pid>/cmdline",
                 "shareProcessNamespace", "triton-specdec-api"):
        assert name in text, name
    assert f"Triton's `{launch.INFERENCE_APIS[0]}` category behind it" in text
