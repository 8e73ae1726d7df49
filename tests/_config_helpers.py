"""Shared helpers of the offline config checks: load model configs through
Triton's own ``ModelConfig`` protobuf (shipped with ``tritonclient``) and read
the engine build script's defaults."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = ROOT / "model_repository"
BUILD_SCRIPT = ROOT / "docker" / "build_engines.sh"
COORDINATOR = "coordinator"


def config_paths() -> list[Path]:
    """Every ``<model>/configs/<profile>.pbtxt`` in the model repository."""
    return sorted(MODEL_REPOSITORY.glob("*/configs/*.pbtxt"))


def profiles() -> list[str]:
    """Profiles are named by the coordinator's configs (cpu, trtllm, ...)."""
    return sorted(p.stem for p in (MODEL_REPOSITORY / COORDINATOR / "configs").glob("*.pbtxt"))


def load_config(path: Path) -> model_config_pb2.ModelConfig:
    """Parse a config.pbtxt; unknown fields or bad values raise ParseError."""
    config = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), config, allow_unknown_field=False)
    return config


def model_config(model: str, profile: str) -> model_config_pb2.ModelConfig:
    return load_config(MODEL_REPOSITORY / model / "configs" / f"{profile}.pbtxt")


def parameter(config: model_config_pb2.ModelConfig, key: str) -> str:
    assert key in config.parameters, f"{config.name}: no parameter {key!r}"
    return config.parameters[key].string_value


def engine_names(profile: str) -> dict[str, str]:
    """Role -> Triton model name of the engines the coordinator calls."""
    coordinator = model_config(COORDINATOR, profile)
    return {
        "target": parameter(coordinator, "target_model_name"),
        "draft": parameter(coordinator, "draft_model_name"),
    }


def data_type_name(value: int) -> str:
    return model_config_pb2.DataType.Name(value)


def script_default(name: str, script: Path = BUILD_SCRIPT) -> str:
    """The default of ``NAME="${NAME:-default}"`` in a shell script (exactly one)."""
    pattern = re.compile(rf'^{re.escape(name)}="\$\{{{re.escape(name)}:-([^}}]*)\}}"\s*(?:#.*)?$', re.MULTILINE)
    found = pattern.findall(script.read_text())
    assert len(found) == 1, f"{script.name}: expected one default for {name}, found {found}"
    return found[0]
