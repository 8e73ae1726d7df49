"""NVIDIA's model names on the real server: ``ensemble`` and
``tensorrt_llm_bls`` driven exactly as NVIDIA's end-to-end client drives them
(tensorrtllm_backend v0.17, inflight_batcher_llm/client/end_to_end_grpc_client.py:
a gRPC stream even when not streaming, [1, 1] tensors, its default inputs,
text_output read as ``output[0].decode()``, batch_index as ``[0][0]``)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.server_client import complete, engine_responses
from tests.unit.test_nvidia_interface import client_inputs

pytestmark = pytest.mark.slow

MODELS = ("ensemble", "tensorrt_llm_bls")
PROMPT = "def fibonacci(n):"
TOKENS = 16


@pytest.fixture(scope="module")
def reference(triton_server) -> str:
    """The coordinator's own greedy completion of PROMPT."""
    return complete(triton_server, PROMPT, TOKENS).text


def texts(responses) -> list[str]:
    return [r.as_numpy("text_output")[0].decode("utf-8") for r in responses]


@pytest.mark.parametrize("model", MODELS)
def test_non_streamed_output_starts_with_the_prompt_unless_excluded(triton_server, reference, model):
    outputs = ["text_output", "batch_index", "sequence_index"]
    [with_prompt] = engine_responses(triton_server, model, client_inputs(PROMPT, TOKENS), outputs)
    [without] = engine_responses(triton_server, model,
                                 client_inputs(PROMPT, TOKENS, exclude_input_in_output=True), outputs)
    assert texts([with_prompt]) == [PROMPT + reference]
    assert texts([without]) == [reference]
    assert with_prompt.as_numpy("batch_index")[0][0] == 0 and with_prompt.as_numpy("sequence_index")[0][0] == 0


@pytest.mark.parametrize("model", MODELS)
def test_streamed_chunks_add_up_to_the_completion_with_statistics_at_the_end(triton_server, reference, model):
    responses = engine_responses(triton_server, model, client_inputs(PROMPT, TOKENS, streaming=True),
                                 ["text_output", "batch_index", "total_draft_tokens", "completion_tokens"])
    assert len(responses) > 1
    assert "".join(texts(responses)) == reference  # streaming never repeats the prompt (as NVIDIA's)
    assert responses[-1].as_numpy("completion_tokens").item() == TOKENS
    assert responses[-1].as_numpy("total_draft_tokens").item() >= 0
    assert all(r.as_numpy("completion_tokens") is None for r in responses[:-1])


def test_batched_prompts_come_back_tagged_by_batch_index(triton_server, reference):
    one, two = client_inputs(PROMPT, TOKENS, exclude_input_in_output=True), client_inputs("def add(a, b):", 8)
    batched = {name: np.concatenate([one[name], two[name]]) for name in one}
    responses = engine_responses(triton_server, "tensorrt_llm_bls", batched, ["text_output", "batch_index"])
    by_index = {r.as_numpy("batch_index")[0][0]: texts([r])[0] for r in responses}
    assert by_index[0] == reference
    assert by_index[1] == "def add(a, b):" + complete(triton_server, "def add(a, b):", 8).text


def test_a_fixed_num_draft_tokens_is_lossless(triton_server, reference):
    inputs = client_inputs(PROMPT, TOKENS, exclude_input_in_output=True,
                           num_draft_tokens=np.array([[3]], dtype=np.int32))
    [response] = engine_responses(triton_server, "tensorrt_llm_bls", inputs,
                                  ["text_output", "total_draft_tokens", "speculative_rounds", "plain_rounds"])
    assert texts([response]) == [reference]
    assert response.as_numpy("total_draft_tokens").item() > 0


REFUSALS = [
    ("ensemble", {"beam_width": 2}, "beam_width must be 1"),
    ("ensemble", {"return_generation_logits": np.array([[True]])}, "return_generation_logits is not supported"),
    ("ensemble", {"repetition_penalty": np.array([[0.0]], dtype=np.float32)}, "repetition_penalty must be in"),
    ("tensorrt_llm_bls", {"num_draft_tokens": np.array([[99]], dtype=np.int32)}, "num_draft_tokens must be between"),
    ("tensorrt_llm_bls", {"output_len": 0}, "max_tokens must be between 1 and"),
]


def test_refusals_name_the_input_and_the_server_keeps_serving(triton_server, reference):
    for model, options, message in REFUSALS:
        with pytest.raises(InferenceServerException, match=message):
            engine_responses(triton_server, model, client_inputs(PROMPT, **{"output_len": TOKENS, **options}),
                             ["text_output"])
    for model in MODELS:
        [after] = engine_responses(triton_server, model,
                                   client_inputs(PROMPT, TOKENS, exclude_input_in_output=True), ["text_output"])
        assert texts([after]) == [reference]


def test_penalties_and_bad_words_decode_speculatively_and_losslessly(triton_server):
    """NVIDIA's client's --repetition-penalty, --frequency-penalty and --bad-words,
    through the engines' own inputs: speculation (a fixed window of 4) gives
    the text plain decoding (num_draft_tokens 0) gives, and the penalties
    change the text."""
    penalized = dict(repetition_penalty=np.array([[1.3]], dtype=np.float32),
                     frequency_penalty=np.array([[0.4]], dtype=np.float32),
                     bad_words=np.array([[" elif"]], dtype=object), exclude_input_in_output=True)
    answers = {}
    for window in (0, 4):
        inputs = client_inputs(PROMPT, 24, num_draft_tokens=np.array([[window]], dtype=np.int32), **penalized)
        [response] = engine_responses(triton_server, "tensorrt_llm_bls", inputs, ["text_output", "total_draft_tokens"])
        answers[window] = (texts([response])[0], response.as_numpy("total_draft_tokens").item())
    unpenalized = complete(triton_server, PROMPT, 24).text  # it has " elif" within 24 tokens
    assert answers[4][0] == answers[0][0] != unpenalized
    assert " elif" not in answers[0][0] and " elif" in unpenalized  # one token, " elif", in this tokenizer
    assert answers[4][1] > 0 and answers[0][1] == 0


def test_log_probs_come_with_the_final_response_and_do_not_depend_on_speculation(triton_server):
    """NVIDIA's client's --return-log-probs: output_log_probs [1, 1, n] with one
    value per generated token and cum_log_probs their sum; greedy speculation
    reports plain decoding's values (the CPU engine's rows are the same)."""
    outputs = ["text_output", "output_log_probs", "cum_log_probs", "completion_tokens"]
    found = {}
    for window in (0, 4):
        inputs = client_inputs(PROMPT, TOKENS, num_draft_tokens=np.array([[window]], dtype=np.int32),
                               return_log_probs=np.array([[True]]), streaming=True)
        responses = engine_responses(triton_server, "tensorrt_llm_bls", inputs, outputs)
        final = responses[-1]
        values = final.as_numpy("output_log_probs")
        assert values.shape == (1, 1, final.as_numpy("completion_tokens").item()) == (1, 1, TOKENS)
        assert final.as_numpy("cum_log_probs").shape == (1, 1)
        assert final.as_numpy("cum_log_probs").item() == pytest.approx(values.sum(), rel=1e-5)
        assert (values <= 0).all()
        found[window] = values
    np.testing.assert_allclose(found[4], found[0], rtol=1e-5, atol=1e-6)
