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
