"""The environment specdec-serve gives tritonserver and the model stubs."""

from __future__ import annotations

from coordinator.serving import launch, tritonserver


def environment(tmp_path, **options):
    pair = launch.PreparedPair(tmp_path, tmp_path, tmp_path)
    install = tritonserver.TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", tmp_path / "lib")
    return launch.server_environment(launch.ServerOptions(**options), pair, install)


def test_the_engines_get_a_small_onednn_primitive_cache_unless_one_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert environment(tmp_path)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert environment(tmp_path)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
    env = environment(tmp_path, extra_env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"})
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_the_models_are_pointed_at_the_prepared_pair(tmp_path):
    env = environment(tmp_path)
    assert env["SPECDEC_TARGET_MODEL_DIR"] == env["SPECDEC_DRAFT_MODEL_DIR"] == str(tmp_path)
    assert str(launch.PROJECT_ROOT) in env["SPECDEC_PYTHONPATH"].split(":")
