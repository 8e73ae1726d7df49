import numpy as np
import pytest

from coordinator.engines.contract import ENGINE_INPUTS
from coordinator.engines.tensors import engine_inputs, generated_tokens, generation_logits
from coordinator.sampling.params import SamplingParams


def test_inputs_follow_the_contract_with_a_batch_dimension():
    tensors = engine_inputs([5, 6, 7], 4, SamplingParams(temperature=0.8, top_k=3, seed=9), end_id=2, pad_id=1,
                            draft_tokens=[8, 9, 10])
    for name, array in tensors.items():
        spec = ENGINE_INPUTS[name]
        assert array.dtype == np.dtype(spec.numpy_dtype), name
        assert array.ndim == len(spec.dims) + 1 and array.shape[0] == 1, name
    assert tensors["input_ids"].tolist() == [[5, 6, 7]]
    assert tensors["draft_input_ids"].tolist() == [[8, 9, 10]]
    assert tensors["runtime_top_k"].tolist() == [[3]]
    assert tensors["random_seed"].tolist() == [[9]]


def test_the_prompt_length_is_sent_only_when_given():
    from coordinator.engines.contract import ENGINE_EXTENSION_INPUTS

    assert "prompt_length" not in engine_inputs([1, 2], 1, SamplingParams(), end_id=2, pad_id=1)
    sent = engine_inputs([1, 2], 1, SamplingParams(), end_id=2, pad_id=1, prompt_length=2)["prompt_length"]
    assert sent.tolist() == [[2]] and sent.dtype == np.dtype(ENGINE_EXTENSION_INPUTS["prompt_length"].numpy_dtype)


def test_greedy_is_sent_as_top_k_one_and_empty_draft_is_never_sent():
    tensors = engine_inputs([1], 1, SamplingParams(), end_id=2, pad_id=1, draft_tokens=[])
    assert "draft_input_ids" not in tensors
    assert tensors["runtime_top_k"].tolist() == [[1]] and tensors["temperature"].tolist() == [[1.0]]


def test_generated_tokens_reads_beam_zero_up_to_sequence_length():
    assert generated_tokens(np.array([[[4, 5, 6, 0]]]), np.array([[3]])) == [4, 5, 6]
    with pytest.raises(ValueError):
        generated_tokens(np.array([[[4]]]), np.array([[2]]))


def test_a_call_that_returned_no_token_reads_as_empty():
    """TensorRT-LLM returns no token when the first new one is the end id."""
    assert generated_tokens(np.zeros((1, 1, 0), np.int32), np.array([[0]])) == []
    assert generated_tokens(np.array([[[7, 7]]]), np.array([[0]])) == []
    assert generation_logits(np.zeros((1, 1, 0, 5), np.float32), 0).shape == (0, 5)
    assert generation_logits(np.ones((1, 1, 3, 5), np.float32), 2).shape == (2, 5)


def test_the_seed_goes_out_under_the_configured_name():
    params = SamplingParams(temperature=1.0, seed=2**64 - 1)
    assert engine_inputs([1], 1, params, end_id=2, pad_id=1)["random_seed"].tolist() == [[2**64 - 1]]
    renamed = engine_inputs([1], 1, params, end_id=2, pad_id=1, seed_input="seed")
    assert "random_seed" not in renamed and renamed["seed"].dtype == np.uint64
