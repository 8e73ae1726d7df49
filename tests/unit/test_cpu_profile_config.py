"""Consistency of the cpu profile's engine settings with the coordinator's."""

from coordinator.settings import CoordinatorSettings
from cpu_engine.engine import KNOWN_PARAMETERS
from cpu_engine.quantize import SCHEMES
from tests._config_helpers import COORDINATOR, model_config, parameter

COORDINATOR_CPU = model_config(COORDINATOR, "cpu")


def coordinator_settings() -> CoordinatorSettings:
    params = {k: v.string_value for k, v in COORDINATOR_CPU.parameters.items()}
    return CoordinatorSettings.from_parameters(params, {"SPECDEC_TOKENIZER_DIR": "/tokenizer"})


def test_coordinator_cpu_config_parses_into_settings():
    settings = coordinator_settings()
    assert settings.speculation_window == 8 and settings.fallback_threshold == 0.3
    assert settings.drafter == "hybrid" and settings.policy == CoordinatorSettings().policy


def test_engines_declare_only_parameters_the_cpu_engine_knows():
    for name in ("target", "draft"):
        assert set(model_config(name, "cpu").parameters) <= KNOWN_PARAMETERS, name


def test_a_full_round_fits_one_forward():
    # a verify forward carries the last token plus speculation_window drafts; only the
    # target verifies (the draft decodes a row per call, and a catch-up is chunked prefill)
    window = coordinator_settings().speculation_window
    assert int(parameter(model_config("target", "cpu"), "max_draft_len")) >= window
    assert int(parameter(model_config("target", "cpu"), "max_num_tokens")) >= window + 1


def test_rows_are_invariant_and_the_coordinator_reads_the_engines_as_decoupled():
    from coordinator.drafters.draft_model import CATCH_UP_CHUNK
    from cpu_engine.quantize import DENSE_ROWS

    # the target's rows in every forward (greedy identity); the draft's where a sampled request's rows are
    assert parameter(model_config("target", "cpu"), "row_invariant") == "true"
    assert parameter(model_config("draft", "cpu"), "row_invariant") == "sampled"
    # a catch-up call of the coordinator's is one forward of the draft; its kernel calls stay on the
    # quantized kernels all the same (the measured block, test_cpu_engine: at most DENSE_ROWS rows)
    assert int(parameter(model_config("draft", "cpu"), "max_num_tokens")) >= CATCH_UP_CHUNK > DENSE_ROWS
    for name in ("target", "draft"):
        assert model_config(name, "cpu").model_transaction_policy.decoupled, name
    assert coordinator_settings().engine_decoupled


def test_engine_context_covers_the_coordinator_limit():
    limit = coordinator_settings().max_context_tokens
    for name in ("target", "draft"):
        engine_limit = int(parameter(model_config(name, "cpu"), "max_context_tokens"))
        # a verify round may need speculation_window + 1 tokens beyond the context
        assert engine_limit >= limit, name


def test_only_the_draft_is_weight_quantized():
    # the target defines the served output; the draft's precision only changes the acceptance rate
    target = model_config("target", "cpu")
    assert "weight_quantization" not in target.parameters or parameter(target, "weight_quantization") == "none"
    assert parameter(model_config("draft", "cpu"), "weight_quantization") in SCHEMES
