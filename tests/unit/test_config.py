import pytest

from coordinator.settings import CoordinatorSettings, SettingsError, expand_env


def test_parameters_parse_with_env_expansion_and_overrides():
    settings = CoordinatorSettings.from_parameters(
        {"speculation_window": "5", "fallback_threshold": "0.3", "tokenizer_dir": "${TOK}/x"},
        {"TOK": "/data", "SPECDEC_SPECULATION_WINDOW": "3"},
    )
    assert settings.speculation_window == 3  # environment overrides the config file
    assert settings.fallback_threshold == 0.3
    assert settings.tokenizer_dir == "/data/x"


@pytest.mark.parametrize(
    "parameters,message",
    [
        ({"speculation_window": "17"}, "speculation_window must be between 0 and 16"),
        ({"fallback_threshold": "1.5"}, "fallback_threshold must be between 0 and 1"),
        ({"speculation_window": "five"}, "speculation_window must be int"),
        ({"max_tokens_limit": "64"}, "default_max_tokens must be between 1 and max_tokens_limit"),
        ({"speculation_windw": "5"}, "unknown coordinator parameter(s): speculation_windw"),
        ({"adaptive_window": "yes"}, "adaptive_window must be bool"),
        ({"tokenizer_dir": "${NOPE}"}, "needs environment variable NOPE"),
        ({"engine_seed_input": "random-seed"}, "engine_seed_input must be one of random_seed, seed"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(parameters, message):
    with pytest.raises(SettingsError) as error:
        CoordinatorSettings.from_parameters(parameters, {})
    assert message in str(error.value)


def test_expand_env_leaves_plain_values_alone():
    assert expand_env("float32", {}, "dtype") == "float32"


def test_adaptive_window_parameter_and_override():
    assert CoordinatorSettings.from_parameters({"adaptive_window": "false"}, {}).adaptive_window is False
    settings = CoordinatorSettings.from_parameters({"adaptive_window": "false"}, {"SPECDEC_ADAPTIVE_WINDOW": "true"})
    assert settings.adaptive_window is True


def test_engine_seed_input_follows_the_backend_version():
    assert CoordinatorSettings.from_parameters({}, {}).engine_seed_input == "random_seed"
    assert CoordinatorSettings.from_parameters({"engine_seed_input": "seed"}, {}).engine_seed_input == "seed"


def test_the_policys_tuning_values_are_parameters_of_their_own_names():
    from coordinator.policy.speculation import PolicySettings

    settings = CoordinatorSettings.from_parameters({"probe_interval": "4", "hysteresis": "0.2"}, environ={})
    assert settings.policy == PolicySettings(probe_interval=4, hysteresis=0.2)
    assert CoordinatorSettings().policy == PolicySettings()  # the defaults live in one place
    with pytest.raises(SettingsError, match="max_probe_interval must be at least probe_interval"):
        CoordinatorSettings.from_parameters({"probe_interval": "80"}, environ={})
    with pytest.raises(SettingsError, match="min_evidence must be at least 1, got 0"):
        CoordinatorSettings.from_parameters({"min_evidence": "0"}, environ={})


@pytest.mark.parametrize("parameters,message", [
    ({"drafter": "ngram"}, "drafter must be one of draft_model, prompt_lookup, hybrid, got 'ngram'"),
    ({"prompt_lookup_min_ngram": "4"}, "prompt_lookup_min_ngram and prompt_lookup_max_ngram must satisfy"),
    ({"hybrid_min_match": "17"}, "hybrid_min_match must be between 1 and 16"),
])
def test_drafter_settings_are_checked(parameters, message):
    with pytest.raises(SettingsError, match=message):
        CoordinatorSettings.from_parameters(parameters, environ={})
