"""The environment specdec-serve gives tritonserver and the model stubs."""

from __future__ import annotations

import tempfile

import pytest

from cpu_engine.turns import TURNS_VARIABLE
from launcher import launch, tritonserver


def environment(tmp_path, **options):
    pair = launch.PreparedPair(tmp_path, tmp_path, tmp_path)
    install = tritonserver.TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", tmp_path / "lib")
    return launch.server_environment(launch.ServerOptions(**options), pair, install)


@pytest.mark.parametrize("name,default", [("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256"), ("OMP_WAIT_POLICY", "PASSIVE"),
                                          ("SPECDEC_TARGET_GOMP_SPINCOUNT", "100000")])
def test_engine_runtime_defaults_unless_the_environment_sets_them(tmp_path, monkeypatch, name, default):
    monkeypatch.delenv(name, raising=False)
    assert launch.ENGINE_ENV_DEFAULTS[name] == default
    assert environment(tmp_path)[name] == default
    monkeypatch.setenv(name, "from-the-user")
    assert environment(tmp_path)[name] == "from-the-user"
    assert environment(tmp_path, extra_env={name: "from-options"})[name] == "from-options"


def test_the_models_are_pointed_at_the_prepared_pair(tmp_path):
    env = environment(tmp_path)
    assert env["SPECDEC_TARGET_MODEL_DIR"] == env["SPECDEC_DRAFT_MODEL_DIR"] == str(tmp_path)
    assert str(launch.PROJECT_ROOT) in env["SPECDEC_PYTHONPATH"].split(":")


def test_each_server_has_its_own_forward_turns_unless_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.delenv(TURNS_VARIABLE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    one = environment(tmp_path, grpc_port=8001)[TURNS_VARIABLE]
    other = environment(tmp_path, grpc_port=9001)[TURNS_VARIABLE]
    assert one.startswith(str(tmp_path)) and one != other
    monkeypatch.setenv(TURNS_VARIABLE, "")  # off
    assert environment(tmp_path)[TURNS_VARIABLE] == ""
