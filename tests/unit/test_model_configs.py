"""Every model config in every profile is a valid Triton ModelConfig, and the
trtllm profile's settings are the ones the deployment depends on."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from tests._config_helpers import (
    COORDINATOR,
    MODEL_REPOSITORY,
    config_paths,
    engine_names,
    load_config,
    model_config,
    parameter,
    profiles,
    script_default,
)

CONFIGS = config_paths()

# Parameters of the coordinator that may differ between profiles, with the reason.
COORDINATOR_PROFILE_DIFFERENCES: dict[str, str] = {
    "max_inflight_requests": "the target engine's capacity in the profile (its max_batch_size): "
                             "test_the_admission_bound_is_the_target_engines_capacity",
    "speculate_with_penalties": "lossless only where the target engine counts drafted tokens in each verified "
                                "position's penalties: checked for the CPU engine, to be checked on a GPU for "
                                "TensorRT-LLM (docs/gpu.md)",
    "engine_prompt_length": "the CPU engine's own prompt_length input, which TensorRT-LLM and the sim engine "
                            "do not declare: test_contract.py",
}


def test_every_model_has_every_profile():
    assert {"cpu", "trtllm"} <= set(profiles())
    models = sorted(p.name for p in MODEL_REPOSITORY.iterdir() if (p / "configs").is_dir())
    assert {COORDINATOR, "target", "draft"} <= set(models)
    for model in models:
        for profile in profiles():
            assert (MODEL_REPOSITORY / model / "configs" / f"{profile}.pbtxt").is_file(), (model, profile)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(MODEL_REPOSITORY)) for p in CONFIGS])
def test_config_parses_into_model_config(path):
    config = load_config(path)
    model = path.parent.parent.name
    assert config.name == model, f"{path}: name {config.name!r} differs from its directory"
    assert config.backend or config.platform == "ensemble", f"{path}: no backend"
    assert len(config.input) > 0 and len(config.output) > 0


def test_unknown_field_is_rejected(tmp_path):
    """The check above is only worth something if a typo fails it."""
    bad = tmp_path / "bad.pbtxt"
    bad.write_text('name: "x"\nbackend: "python"\nmax_batch_sise: 8\n')
    with pytest.raises(text_format.ParseError):
        load_config(bad)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_trtllm_engine_settings(role):
    name = engine_names("trtllm")[role]
    config = model_config(name, "trtllm")
    assert config.backend == "tensorrtllm"
    assert parameter(config, "gpt_model_type") == "inflight_fused_batching"
    assert parameter(config, "gpt_model_path") == f"/opt/specdec/engines/{role}"
    assert parameter(config, "enable_kv_cache_reuse") == "true"
    assert parameter(config, "exclude_input_in_output") == "true"
    assert parameter(config, "max_beam_width") == "1"
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds == 0
    # The engine batches in flight up to its build-time --max_batch_size.
    assert config.max_batch_size == int(script_default("MAX_BATCH_SIZE"))
    fraction = float(parameter(config, "kv_cache_free_gpu_mem_fraction"))
    assert 0.0 < fraction < 1.0


@pytest.mark.parametrize("role", ["target", "draft"])
def test_trtllm_kv_cache_holds_every_sequence_at_its_longest(role):
    """The KV cache is sized in tokens, so the split between the two engines does
    not depend on which one Triton loads first: exactly the sequences the engine
    batches in flight at the longest the build allows (docker/build_engines.sh)."""
    config = model_config(engine_names("trtllm")[role], "trtllm")
    tokens = int(parameter(config, "max_tokens_in_paged_kv_cache"))
    assert tokens == int(script_default("MAX_BATCH_SIZE")) * int(script_default("MAX_SEQ_LEN"))


def test_trtllm_kv_cache_split_fits_one_gpu():
    """Target and draft share one GPU and may load at the same time: their KV-cache
    fractions of the free memory must fit together, with room for activations."""
    names = engine_names("trtllm")
    fractions = {
        role: float(parameter(model_config(name, "trtllm"), "kv_cache_free_gpu_mem_fraction"))
        for role, name in names.items()
    }
    assert fractions["target"] + fractions["draft"] <= 0.9, fractions
    # The target holds the same tokens with more layers/heads per token.
    assert fractions["target"] > fractions["draft"], fractions
    devices = {parameter(model_config(name, "trtllm"), "gpu_device_ids") for name in names.values()}
    assert devices == {"0"}, "the documented split assumes both engines on GPU 0"


def test_coordinator_is_the_same_in_every_profile():
    reference = model_config(COORDINATOR, "cpu")
    for profile in profiles():
        config = model_config(COORDINATOR, profile)
        for key in COORDINATOR_PROFILE_DIFFERENCES:
            for c in (config, reference):
                if key in c.parameters:
                    del c.parameters[key]
        assert config == reference, (
            f"coordinator/configs/{profile}.pbtxt differs from cpu.pbtxt; keep them equal "
            "or list the parameter in COORDINATOR_PROFILE_DIFFERENCES with the reason"
        )


@pytest.mark.parametrize("profile", profiles())
def test_the_admission_bound_is_the_target_engines_capacity(profile):
    """Each request holds one sequence of the target while it decodes: the
    coordinator admits as many requests as the target batches (its
    max_batch_size, equal to a TensorRT-LLM engine's --max_batch_size), and no
    more than a CPU engine keeps KV caches for."""
    bound = int(parameter(model_config(COORDINATOR, profile), "max_inflight_requests"))
    target = model_config(engine_names(profile)["target"], profile)
    assert bound == target.max_batch_size > 0, (profile, bound, target.max_batch_size)
    if "max_cached_sequences" in target.parameters:
        assert bound <= int(parameter(target, "max_cached_sequences"))
    if profile == "trtllm":
        assert bound == int(script_default("MAX_BATCH_SIZE"))  # the engines docker/build_engines.sh builds
