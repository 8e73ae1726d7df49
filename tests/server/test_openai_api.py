"""The OpenAI-compatible API on the real server, driven by the official
``openai`` package: completions and chat, streamed and not, refusals as
``BadRequestError`` naming the field, the speculative statistics, and greedy
text identical to what the coordinator returns over gRPC for the same prompt.

Uses the session fixtures ``triton_server`` and ``openai_frontend``
(tests/conftest.py); SPECDEC_TEST_SERVER=host:8001 points them at a running
server."""

from __future__ import annotations

import time

import openai
import pytest

from coordinator.request.api import STATISTICS
from coordinator.request.tokenizer import Codec
from tests.server_client import complete, metric, metrics_text

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the square of x."}]
MAX_TOKENS = 24
STATISTIC_NAMES = [spec.name for spec in STATISTICS]


@pytest.fixture(scope="module")
def client(openai_frontend, triton_server) -> openai.OpenAI:
    """As a user's client: the server's API key as the package's api_key (Bearer)."""
    return openai.OpenAI(base_url=openai_frontend, api_key=triton_server.api_key or "none", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def coordinator_codec() -> Codec:
    """The tokenizer directory the coordinator loads, prepared as specdec-serve prepares it."""
    from launcher.launch import ServerOptions, prepare

    return Codec.from_dir(prepare(ServerOptions()).tokenizer_dir)


@pytest.fixture(scope="module")
def chat_prompt(real_target_dir) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_target_dir)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def grpc_greedy(triton_server):
    """The coordinator's own greedy text over gRPC, per prompt (cached: one call each)."""
    texts = {}

    def text(prompt: str) -> str:
        if prompt not in texts:
            texts[prompt] = complete(triton_server, prompt, MAX_TOKENS, temperature=0.0).text
        return texts[prompt]

    return text


def test_models_lists_the_coordinator(client):
    assert [model.id for model in client.models.list()] == ["coordinator"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_greedy_completion_is_the_coordinators_text_with_usage_and_statistics(client, grpc_greedy,
                                                                              coordinator_codec):
    response = client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.text == grpc_greedy(PROMPT)
    assert response.object == "text_completion" and response.model == "coordinator"
    assert response.usage.completion_tokens <= MAX_TOKENS
    assert choice.finish_reason == ("length" if response.usage.completion_tokens == MAX_TOKENS else "stop")
    assert response.usage.prompt_tokens == len(coordinator_codec.encode(PROMPT))
    speculation = response.model_extra["speculation"]
    assert list(speculation) == STATISTIC_NAMES
    assert speculation["completion_tokens"] == response.usage.completion_tokens
    assert 0 <= speculation["total_accepted_draft_tokens"] <= speculation["total_draft_tokens"]


def test_streamed_completion_arrives_in_chunks_that_add_up_to_the_same_text(client, grpc_greedy):
    stream = client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [chunk for chunk in chunks if chunk.choices]
    assert len(text_chunks) > 1  # streamed, not one body
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == grpc_greedy(PROMPT)
    assert text_chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == last.model_extra["speculation"]["completion_tokens"]
    assert len({chunk.id for chunk in chunks}) == 1


def test_greedy_chat_is_the_coordinators_text_for_the_templated_prompt(client, grpc_greedy, chat_prompt,
                                                                        coordinator_codec):
    response = client.chat.completions.create(model="coordinator", messages=MESSAGES,
                                              max_completion_tokens=MAX_TOKENS, temperature=0)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == grpc_greedy(chat_prompt)
    assert response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(coordinator_codec.encode(chat_prompt))
    assert list(response.model_extra["speculation"]) == STATISTIC_NAMES


def test_streamed_chat_names_the_role_first_and_ends_with_the_statistics(client, grpc_greedy, chat_prompt):
    stream = client.chat.completions.create(model="coordinator", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == grpc_greedy(chat_prompt)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert list(chunks[-1].model_extra["speculation"]) == STATISTIC_NAMES
    assert all("speculation" not in (chunk.model_extra or {}) for chunk in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_a_coordinator_refusal_is_a_bad_request_naming_the_field(client, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=0, stream=stream)
    assert refused.value.status_code == 400 and refused.value.param == "max_tokens"
    assert "max_tokens must be between 1 and" in refused.value.message
    with pytest.raises(openai.BadRequestError) as chat_refused:
        client.chat.completions.create(model="coordinator", messages=MESSAGES, max_completion_tokens=0)
    assert chat_refused.value.param == "max_completion_tokens"


@pytest.mark.parametrize("options,param", [
    ({"n": 2}, "n"),
    ({"logprobs": 2}, "logprobs"),
    ({"presence_penalty": 5e9}, "presence_penalty"),
    ({"extra_body": {"speculation_window": 99}}, "speculation_window"),
    ({"extra_body": {"ignore_eos": True}}, "ignore_eos"),
])
def test_what_the_server_cannot_honour_is_refused_by_name(client, options, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=4, **options)
    assert refused.value.param == param and param in refused.value.message


def test_extension_fields_reach_the_coordinator(client, grpc_greedy):
    plain = client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"speculation_window": 0})
    speculation = plain.model_extra["speculation"]
    assert speculation["total_draft_tokens"] == 0 and speculation["speculative_rounds"] == 0
    assert plain.choices[0].text == grpc_greedy(PROMPT)  # lossless: plain decoding gives the same text


def test_seed_and_stop_are_the_coordinators_random_seed_and_stop_words(client, grpc_greedy):
    sampled = [client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=12, temperature=0.8,
                                         seed=1234, extra_body={"adaptive_window": False}).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # same seed, fixed window: same text
    greedy = grpc_greedy(PROMPT)
    assert "return" in greedy
    stopped = client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        stop=["return"])
    assert stopped.choices[0].text == greedy[: greedy.index("return")]
    assert stopped.choices[0].finish_reason == "stop"


def test_a_client_that_leaves_a_stream_cancels_its_request(client, triton_server):
    def cancelled() -> float:
        return metric(metrics_text(triton_server), "specdec_requests_total", outcome="cancelled")

    before = cancelled()
    stream = client.completions.create(model="coordinator", prompt=PROMPT, max_tokens=512, temperature=0,
                                       stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while cancelled() <= before:
        assert time.monotonic() < deadline, "the coordinator did not see the request cancelled"
        time.sleep(0.5)
