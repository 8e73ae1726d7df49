"""The profiles ``specdec-serve`` runs, and the sim profile's presets: checked
at start, each refusal naming the valid choices."""

from __future__ import annotations

from pathlib import Path

from sim_engine.presets import DEFAULT_PRESET, PRESETS, UnknownPreset, absolute, preset

# cpu: the CPU reference engine on the real model pair; sim: simulated GPU
# engines (sim_engine/). trtllm runs in its container (docker/, docs/gpu.md).
SERVABLE = ("cpu", "sim")
PROFILE_VAR = "SPECDEC_PROFILE"
PRESET_VAR = "SPECDEC_SIM_PRESET"
__all__ = ["DEFAULT_PRESET", "PRESETS", "ProfileError", "absolute", "check"]


class ProfileError(ValueError):
    pass


def check(profile: str, sim_preset: str, model_repository: Path) -> None:
    """Refuse a profile this launcher cannot run or the repository lacks, and an
    unknown preset or a timing table that does not load (missing, bad JSON, a
    missing field, an unknown pair): at start, not in the engines' logs."""
    if profile not in SERVABLE:
        raise ProfileError(f"unknown profile {profile!r}; valid profiles: {', '.join(SERVABLE)} "
                           "(trtllm runs in its container: docs/gpu.md)")
    config = Path(model_repository) / "coordinator" / "configs" / f"{profile}.pbtxt"
    if not config.is_file():
        raise ProfileError(f"profile {profile!r} has no {config}")
    if profile == "sim":
        try:
            preset(sim_preset)
        except UnknownPreset as error:
            raise ProfileError(str(error)) from None
