import numpy as np
import pytest

from coordinator.settings import CoordinatorSettings
from coordinator.request.parse import (InputError, check_context, check_end_id, check_parameters, check_prompt_size, parse_request)

SETTINGS = CoordinatorSettings(speculation_window=5, max_tokens_limit=1024, max_context_tokens=4096)


def parse(**inputs):
    raw = {k: (np.asarray(v) if v is not None else None) for k, v in inputs.items()}
    return parse_request(raw, SETTINGS, new_seed=lambda: 42)


def test_defaults():
    request = parse(text_input=np.array([b"def f():"], dtype=object))
    assert request.prompt == "def f():"
    assert request.max_tokens == 128
    assert request.speculation_window == 5
    assert request.sampling.greedy and request.sampling.seed == 42
    assert not request.stream and request.stop_words == ()
    assert request.adaptive_window and request.draft_sampling is None
    assert request.end_id is None and request.sampling.end_id is None and request.draft_distribution


def test_end_id_goes_to_the_engines_and_use_draft_logits_to_the_verification():
    request = parse(text_input=np.array([b"x"], dtype=object), end_id=np.array([13], np.int32),
                    use_draft_logits=np.array([False]), temperature=np.array([0.5], np.float32),
                    draft_temperature=np.array([0.9], np.float32))
    assert request.end_id == 13 and request.sampling.end_id == 13 and request.draft_sampling.end_id == 13
    assert not request.draft_distribution
    check_end_id(13, vocab_size=14)
    with pytest.raises(InputError, match="end_id must be a token id between 0 and 13, got 14"):
        check_end_id(14, vocab_size=14)


def test_adaptive_window_defaults_to_the_server_setting():
    settings = CoordinatorSettings(adaptive_window=False)
    raw = {"text_input": np.array([b"x"], dtype=object)}
    assert not parse_request(raw, settings, new_seed=lambda: 1).adaptive_window
    raw["adaptive_window"] = np.array([True])
    assert parse_request(raw, settings, new_seed=lambda: 1).adaptive_window


def test_draft_temperature_gives_the_draft_its_own_sampler():
    request = parse(
        text_input=np.array([b"x"], dtype=object),
        temperature=np.array([1.0], np.float32),
        top_k=np.array([20], np.int32),
        draft_temperature=np.array([0.5], np.float32),
        random_seed=np.array([9], np.uint64),
    )
    assert request.draft_sampling.temperature == 0.5
    assert (request.draft_sampling.top_k, request.draft_sampling.seed) == (20, 9)
    assert request.sampling.temperature == 1.0


def test_all_fields():
    request = parse(
        text_input=np.array([b"x"], dtype=object),
        max_tokens=np.array([7], np.int32),
        speculation_window=np.array([0], np.int32),
        temperature=np.array([0.5], np.float32),
        top_k=np.array([10], np.int32),
        top_p=np.array([0.9], np.float32),
        random_seed=np.array([2**63 + 5], np.uint64),
        stop_words=np.array([b"\n\n", b"def "], dtype=object),
        stream=np.array([True]),
    )
    assert (request.max_tokens, request.speculation_window, request.stream) == (7, 0, True)
    assert request.sampling.seed == 2**63 + 5 and not request.sampling.greedy
    assert request.stop_words == ("\n\n", "def ")


@pytest.mark.parametrize(
    "inputs,message",
    [
        ({}, "text_input is required"),
        ({"text_input": np.array([b""], dtype=object)}, "text_input is empty"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, "text_input is not valid UTF-8"),
        ({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input must hold exactly one element"),
        ({"max_tokens": np.array([0], np.int32)}, "max_tokens must be between 1 and 1024, got 0"),
        ({"max_tokens": np.array([1025], np.int32)}, "max_tokens must be between 1 and 1024, got 1025"),
        ({"speculation_window": np.array([-1], np.int32)}, "speculation_window must be between 0 and 5"),
        ({"speculation_window": np.array([6], np.int32)}, "the server's speculation_window"),
        ({"temperature": np.array([-0.1], np.float32)}, "temperature must be between 0 and 100"),
        ({"temperature": np.array([np.nan], np.float32)}, "temperature must be a finite number"),
        ({"top_k": np.array([-1], np.int32)}, "top_k must be between 0"),
        ({"top_p": np.array([0.0], np.float32)}, "top_p must be in (0, 1]"),
        ({"stop_words": np.array([b"ok", b""], dtype=object)}, "stop_words[1] is an empty string"),
        ({"stop_words": np.array([b"ok", b"\xff"], dtype=object)}, "stop_words[1] is not valid UTF-8"),
        ({"stop_words": np.array([b"x" * 257], dtype=object)}, "stop_words[0] is 257 characters; stop words may be at most 256"),
        ({"max_tokens": np.array([4.0], np.float32)}, "max_tokens must be an integer"),
        ({"max_tokens": np.array([-3], np.int32)}, "max_tokens must be between 1 and 1024, got -3"),
        ({"temperature": np.array([1000.0], np.float32)}, "temperature must be between 0 and 100 (0 = greedy), got 1000"),
        ({"temperature": np.array([b"hot"], dtype=object)}, "temperature must be a number"),
        ({"top_p": np.array([1.5], np.float32)}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": np.array([np.inf], np.float32)}, "top_p must be a finite number"),
        ({"stop_words": np.array([b"x"] * 17, dtype=object)}, "stop_words may hold at most 16"),
        ({"bogus": np.array([1])}, "unknown input(s) bogus"),
        ({"end_id": np.array([-1], np.int32)}, "end_id must be between 0 and 2147483647, got -1"),
        ({"draft_temperature": np.array([-1.0], np.float32)}, "draft_temperature must be between 0 and 100"),
        ({"draft_temperature": np.array([0.5], np.float32)}, "draft_temperature needs a sampled request"),
    ],
)
def test_bad_input_names_the_field_and_the_limit(inputs, message):
    inputs = {"text_input": np.array([b"ok"], dtype=object), **inputs}
    if message == "text_input is required":
        inputs.pop("text_input")
    with pytest.raises(InputError) as error:
        parse(**inputs)
    assert message in str(error.value)


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing():
    check_prompt_size(4096 * 128, 128, SETTINGS)
    with pytest.raises(InputError) as error:
        check_prompt_size(4096 * 128 + 1, 128, SETTINGS)
    assert str(error.value) == (
        "text_input is 524289 bytes; at most 524288 bytes can fit the context limit of 4096 tokens (shorten the prompt)"
    )


def test_only_tritons_own_request_parameters_are_accepted():
    check_parameters({})
    check_parameters({"triton_enable_empty_final_response": True, "priority": 1, "timeout": 5})
    with pytest.raises(InputError) as error:
        check_parameters({"max_token": 32, "bogus": 1})
    assert str(error.value).startswith("unknown parameter(s) bogus, max_token; the coordinator takes its settings "
                                       "as inputs: text_input, max_tokens,")


def test_context_limit():
    check_context(4000, 96, SETTINGS)
    with pytest.raises(InputError, match="text_input is 4001 tokens; with max_tokens 96 .* 4096"):
        check_context(4001, 96, SETTINGS)
