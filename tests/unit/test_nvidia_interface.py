"""NVIDIA's request interface (``ensemble``, ``tensorrt_llm_bls``): the
translation to coordinator requests, and the configs against it. Requests are
shaped exactly as NVIDIA's end-to-end client shapes them
(tensorrtllm_backend v0.17, inflight_batcher_llm/client/end_to_end_grpc_client.py,
``prepare_inputs``): every tensor [1, 1] (batch dim), its default inputs
text_input, max_tokens, stream, beam_width, temperature (1.0),
exclude_input_in_output (False) and, when given, num_return_sequences."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.request import nvidia
from coordinator.request.parse import InputError, parse_request
from coordinator.settings import CoordinatorSettings
from tests._config_helpers import data_type_name, model_config, profiles


def client_inputs(prompt="def add(a, b):", output_len=16, streaming=False, beam_width=1, temperature=1.0,
                  exclude_input_in_output=False, **more):
    """NVIDIA's ``prepare_inputs`` defaults, for one prompt."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like(np.array([[prompt]])).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
        "exclude_input_in_output": np.array([[exclude_input_in_output]], dtype=bool),
    }
    inputs.update(more)
    return inputs


def coordinator_request(item: nvidia.Item):
    """The item's inputs as the coordinator parses them (its own validation)."""
    return parse_request(item.inputs, CoordinatorSettings(), new_seed=lambda: 7)


def test_default_client_request_is_greedy_with_the_prompt_in_front():
    """top_k and top_p default to 0 in TensorRT-LLM, and top_k 0 with top_p 0 is
    greedy whatever the temperature (samplingTopKKernels.h, regularizeTopKTopP):
    the client's default temperature 1.0 alone does not sample."""
    [item] = nvidia.translate(client_inputs())
    request = coordinator_request(item)
    assert request.sampling.greedy
    assert request.prompt == "def add(a, b):" and request.max_tokens == 16 and not request.stream
    assert item.include_prompt and nvidia.final_text(item, " return a + b") == "def add(a, b): return a + b"
    assert request.adaptive_window  # no num_draft_tokens: the server's adaptive speculation


def test_exclude_input_in_output_and_streaming_leave_the_prompt_out():
    [excluded] = nvidia.translate(client_inputs(exclude_input_in_output=True))
    [streamed] = nvidia.translate(client_inputs(streaming=True))
    assert not excluded.include_prompt and nvidia.final_text(excluded, "x") == "x"
    assert streamed.stream and not streamed.include_prompt
    assert coordinator_request(streamed).stream


@pytest.mark.parametrize("top_k, top_p, expected", [
    (np.int32(5), None, (5, 1.0)),  # top-k alone: top_p 0 becomes 1 (regularizeTopKTopP)
    (None, np.float32(0.9), (0, 0.9)),
    (np.int32(3), np.float32(0.5), (3, 0.5)),
])
def test_sampling_needs_top_k_or_top_p(top_k, top_p, expected):
    more = {}
    if top_k is not None:
        more["top_k"] = np.array([[top_k]], dtype=np.int32)
    if top_p is not None:
        more["top_p"] = np.array([[top_p]], dtype=np.float32)
    more["random_seed"] = np.array([[42]], dtype=np.uint64)
    [item] = nvidia.translate(client_inputs(temperature=0.7, **more))
    request = coordinator_request(item)
    assert not request.sampling.greedy
    assert (request.sampling.top_k, pytest.approx(request.sampling.top_p)) == expected
    assert request.sampling.temperature == pytest.approx(0.7) and request.sampling.seed == 42


def test_num_draft_tokens_is_a_fixed_window_and_use_draft_logits_is_passed_on():
    [item] = nvidia.translate(client_inputs(num_draft_tokens=np.array([[3]], dtype=np.int32),
                                            use_draft_logits=np.array([[False]], dtype=bool)))
    request = coordinator_request(item)
    assert request.speculation_window == 3 and not request.adaptive_window
    assert not request.draft_distribution
    [plain] = nvidia.translate(client_inputs(num_draft_tokens=np.array([[0]], dtype=np.int32)))
    assert coordinator_request(plain).speculation_window == 0


def test_stop_words_end_id_and_pad_id():
    [item] = nvidia.translate(client_inputs(stop_words=np.array([["\n\n", ""]], dtype=object),
                                            end_id=np.array([[13]], dtype=np.int32),
                                            pad_id=np.array([[0]], dtype=np.int32)))
    request = coordinator_request(item)
    assert request.stop_words == ("\n\n",)  # the empty string pads a batch's rows
    assert request.end_id == 13 and request.sampling.end_id == 13


def test_penalties_min_length_bad_words_and_log_probs_are_passed_on():
    [item] = nvidia.translate(client_inputs(repetition_penalty=np.array([[1.3]], dtype=np.float32),
                                            presence_penalty=np.array([[0.5]], dtype=np.float32),
                                            frequency_penalty=np.array([[0.25]], dtype=np.float32),
                                            min_length=np.array([[4]], dtype=np.int32),
                                            bad_words=np.array([["foo", "bar baz"]], dtype=object),
                                            return_log_probs=np.array([[True]])))
    request = coordinator_request(item)
    assert request.penalties.repetition == pytest.approx(1.3) and request.penalties.presence == 0.5
    assert request.penalties.frequency == 0.25 and request.penalties.min_length == 4
    assert request.bad_word_texts == ("foo", "bar baz") and request.return_log_probs


def test_batched_inputs_become_one_request_per_prompt():
    """The client's --batch-inputs stacks each input's [1, 1] rows."""
    one, two = client_inputs("a"), client_inputs("b", exclude_input_in_output=True)
    batched = {name: np.concatenate([one[name], two[name]]) for name in one}
    items = nvidia.translate(batched)
    assert [(i.batch_index, i.prompt, i.include_prompt) for i in items] == [(0, "a", True), (1, "b", False)]
    with pytest.raises(InputError, match="max_tokens has batch size 1, text_input has 2"):
        nvidia.translate({**batched, "max_tokens": one["max_tokens"]})


@pytest.mark.parametrize("name, value, message", [
    ("beam_width", np.array([[2]], dtype=np.int32), "beam_width must be 1"),
    ("num_return_sequences", np.array([[2]], dtype=np.int32), "num_return_sequences must be 1"),
    ("return_generation_logits", np.array([[True]]), "return_generation_logits is not supported"),
    ("return_context_logits", np.array([[True]]), "return_context_logits is not supported"),
    ("lora_task_id", np.array([[1]], dtype=np.uint64), r"LoRA \(lora_task_id\)"),
    ("embedding_bias_words", np.array([["foo"]], dtype=object), "embedding bias"),
    ("prompt_embedding_table", np.zeros((1, 2, 4), dtype=np.float16), "prompt tuning"),
])
def test_what_this_server_does_not_implement_is_refused_by_name(name, value, message):
    with pytest.raises(InputError, match=message):
        nvidia.translate(client_inputs(**{name: value}))


def test_neutral_values_of_unimplemented_inputs_are_accepted():
    """A client that sends the defaults explicitly (as NVIDIA's client sends
    beam_width 1 and num_return_sequences 1) is served."""
    neutral = {"repetition_penalty": np.array([[1.0]], dtype=np.float32),
               "presence_penalty": np.array([[0.0]], dtype=np.float32),
               "min_length": np.array([[0]], dtype=np.int32),
               "num_return_sequences": np.array([[1]], dtype=np.int32),
               "return_log_probs": np.array([[False]]),
               "length_penalty": np.array([[1.5]], dtype=np.float32),  # beams only: no effect at beam_width 1
               "bad_words": np.zeros((1, 0), dtype=object)}
    assert len(nvidia.translate(client_inputs(**neutral))) == 1


def test_required_inputs_and_coordinator_errors_in_the_clients_terms():
    with pytest.raises(InputError, match="max_tokens is required"):
        nvidia.translate({"text_input": np.array([["x"]], dtype=object)})
    assert nvidia.client_message("speculation_window must be between 0 and 8") == \
        "num_draft_tokens must be between 0 and 8"


def declared(tensors):
    return {t.name: (data_type_name(t.data_type), tuple(t.dims)) for t in tensors}


@pytest.mark.parametrize("profile", profiles())
def test_tensorrt_llm_bls_declares_the_interface(profile):
    config = model_config("tensorrt_llm_bls", profile)
    assert declared(config.input) == {s.name: (s.data_type, s.dims) for s in nvidia.INPUTS}
    assert {t.name for t in config.input if not t.optional} == {"text_input", "max_tokens"}
    assert declared(config.output) == {s.name: (s.data_type, s.dims) for s in nvidia.OUTPUTS}
    assert config.max_batch_size > 0 and config.model_transaction_policy.decoupled


@pytest.mark.parametrize("profile", profiles())
def test_the_ensemble_is_one_step_into_tensorrt_llm_bls(profile):
    ensemble, bls = model_config("ensemble", profile), model_config("tensorrt_llm_bls", profile)
    [step] = ensemble.ensemble_scheduling.step
    assert step.model_name == "tensorrt_llm_bls"
    assert [t.name for t in ensemble.input] == list(nvidia.ENSEMBLE_INPUT_NAMES)
    assert dict(step.input_map) == {n: n for n in nvidia.ENSEMBLE_INPUT_NAMES}
    assert dict(step.output_map) == {t.name: t.name for t in ensemble.output}
    bls_tensors = declared(bls.input) | declared(bls.output)
    for tensor in (*ensemble.input, *ensemble.output):
        assert declared([tensor])[tensor.name] == bls_tensors[tensor.name], tensor.name
    assert ensemble.max_batch_size == bls.max_batch_size
