"""The OpenAI frontend's pure core (frontend/errors.py, requests.py,
responses.py): OpenAI request JSON to coordinator inputs, refusals naming the
field, the coordinator's errors in OpenAI's format, response bodies, stream
chunks and their SSE framing. No server, no network: milliseconds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from coordinator.request.api import INPUT_NAMES, STATISTICS, Statistics
from frontend import errors
from frontend.requests import UNSUPPORTED, chat_request, completion_request
from frontend.responses import DONE, Reply, finish_reason, speculation, sse, usage

DEFAULT_MAX_TOKENS = 128


def completion(**fields):
    return completion_request({"model": "coordinator", "prompt": "def f():", **fields}, DEFAULT_MAX_TOKENS)


def chat(**fields):
    body = {"model": "coordinator", "messages": [{"role": "user", "content": "hi"}], **fields}
    return chat_request(body, DEFAULT_MAX_TOKENS)


def refusal(build, **fields) -> errors.OpenAIError:
    with pytest.raises(errors.OpenAIError) as caught:
        build(**fields)
    return caught.value


# ------------------------------------------------------------ mapping ----


def test_a_bare_completion_keeps_the_coordinators_defaults_but_sends_max_tokens():
    generation = completion()
    assert generation.coordinator_inputs() == {"text_input": "def f():", "max_tokens": DEFAULT_MAX_TOKENS,
                                               "stream": False}
    assert generation.max_tokens == DEFAULT_MAX_TOKENS and not generation.chat


def test_openai_fields_and_extensions_map_to_coordinator_inputs():
    generation = completion(max_tokens=64, temperature=0.7, top_p=0.9, seed=2**64 - 1, stop=["\n\n", "def "],
                            stream=True, speculation_window=0, adaptive_window=False, drafter="prompt_lookup",
                            draft_temperature=0.5, top_k=40, user="someone", stream_options={"include_usage": True})
    assert generation.coordinator_inputs() == {
        "text_input": "def f():", "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "draft_temperature": 0.5,
        "speculation_window": 0, "top_k": 40, "adaptive_window": False, "drafter": "prompt_lookup",
        "random_seed": 2**64 - 1, "stop_words": ["\n\n", "def "], "stream": True,
        "ab_key": "someone",  # the user: the traffic split's key
    }
    assert set(generation.coordinator_inputs()) <= set(INPUT_NAMES)
    assert generation.include_usage and generation.fields == {}


@pytest.mark.parametrize("stop,words", [("\n", ["\n"]), ([], None), (None, None)])
def test_stop_may_be_a_string_a_list_or_nothing(stop, words):
    assert completion(stop=stop).inputs.get("stop_words") == words


def test_usage_is_streamed_only_when_asked_and_only_to_a_stream():
    assert not completion(stream=True).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage
    assert not completion(stream=False, stream_options={"include_usage": True}).include_usage
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_a_prompt_list_of_one_string_is_that_string():
    assert completion(prompt=["x = 1"]).prompt == "x = 1"


def test_chat_messages_become_role_and_text_for_the_template():
    generation = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}],
         "name": "ann"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Sort a list."},
    ])
    assert generation.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Sort a list."},
    )
    assert generation.chat and generation.prompt == ""
    assert generation.with_prompt("<templated>").coordinator_inputs()["text_input"] == "<templated>"
    assert generation.fields["text_input"] == "messages"


def test_chat_max_completion_tokens_is_max_tokens_and_errors_name_it():
    generation = chat(max_completion_tokens=7)
    assert generation.inputs["max_tokens"] == 7 and generation.max_tokens == 7
    assert generation.fields["max_tokens"] == "max_completion_tokens"
    assert chat(max_tokens=9).inputs["max_tokens"] == 9
    assert chat(max_tokens=9, max_completion_tokens=9).max_tokens == 9
    error = refusal(chat, max_tokens=9, max_completion_tokens=8)
    assert error.param == "max_completion_tokens" and "differ" in error.message


# ------------------------------------------------------------ refusals ----


@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", "10", "must be an integer"),
    ("max_tokens", True, "must be an integer"),
    ("max_tokens", 2**31, "between -2147483648 and 2147483647"),
    ("temperature", "hot", "must be a number"),
    ("temperature", float("nan"), "finite"),
    ("top_p", False, "must be a number"),
    ("seed", -1, "between 0 and 18446744073709551615"),
    ("seed", 2**64, "between 0 and 18446744073709551615"),
    ("seed", 1.5, "must be an integer"),
    ("stop", ["a", 1], "a string or a list of strings"),
    ("stream", "yes", "true or false"),
    ("stream_options", [], "must be an object"),
    ("speculation_window", 1.0, "must be an integer"),
    ("adaptive_window", 1, "true or false"),
    ("drafter", 3, "must be a string"),
    ("top_k", "all", "must be an integer"),
])
def test_a_value_of_the_wrong_kind_is_refused_naming_its_field(field, value, words):
    error = refusal(completion, **{field: value})
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", field)
    assert error.message.startswith(field) and words in error.message


@pytest.mark.parametrize("field,value", [
    ("n", 2), ("best_of", 3), ("echo", True), ("logprobs", 1), ("logprobs", 0), ("logit_bias", {"50256": -100}),
    ("suffix", "return x"),
])
def test_completion_fields_that_would_change_the_output_are_refused_by_name(field, value):
    error = refusal(completion, **{field: value})
    assert error.status == 400 and error.param == field
    assert error.message.startswith(f"{field} is not supported: {UNSUPPORTED[field][0]}")


@pytest.mark.parametrize("field,value", [
    ("n", 3), ("logprobs", True), ("top_logprobs", 2), ("tools", [{"type": "function"}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("reasoning_effort", "low"),
])
def test_chat_fields_that_would_change_the_output_are_refused_by_name(field, value):
    error = refusal(chat, **{field: value})
    assert error.status == 400 and error.param == field and "is not supported" in error.message


def test_penalties_reach_the_coordinator_under_its_input_names():
    generation = completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_length=3)
    assert generation.inputs["presence_penalty"] == 0.5 and generation.inputs["frequency_penalty"] == -1
    assert generation.inputs["repetition_penalty"] == 1.2 and generation.inputs["min_length"] == 3


@pytest.mark.parametrize("fields", [
    {"n": 1}, {"best_of": 1}, {"echo": False}, {"logprobs": None}, {"logit_bias": {}}, {"presence_penalty": 0},
    {"frequency_penalty": 0.0}, {"suffix": None}, {"user": "u-1"}, {"metadata": {"a": "b"}}, {"store": False},
])
def test_neutral_values_and_harmless_fields_are_accepted(fields):
    assert completion(**fields).prompt == "def f():"


def test_chat_accepts_what_asks_for_nothing():
    generation = chat(n=1, logprobs=False, top_logprobs=None, tools=[], tool_choice="none",
                      response_format={"type": "text"}, parallel_tool_calls=True, service_tier="auto")
    assert generation.messages


def test_an_unknown_field_is_refused_not_ignored():
    error = refusal(completion, max_token=10)
    assert error.param == "max_token" and "unknown field 'max_token'" in error.message
    assert "max_tokens" in error.message  # the accepted fields are listed
    assert refusal(completion, messages=[]).param == "messages"  # a chat field on the completions endpoint
    assert refusal(chat, prompt="x").param == "prompt"


def test_model_is_required_and_another_model_is_not_found():
    with pytest.raises(errors.OpenAIError) as missing:
        completion_request({"prompt": "x"}, DEFAULT_MAX_TOKENS)
    assert (missing.value.status, missing.value.param) == (400, "model")
    with pytest.raises(errors.OpenAIError) as other:
        completion_request({"model": "gpt-4o", "prompt": "x"}, DEFAULT_MAX_TOKENS)
    assert (other.value.status, other.value.param, other.value.code) == (404, "model", "model_not_found")
    assert "'gpt-4o'" in other.value.message and "'coordinator'" in other.value.message


@pytest.mark.parametrize("prompt,words", [
    (None, "prompt is required"), (7, "prompt is required"), ([1, 2, 3], "token ids"), ([[1, 2]], "token ids"),
    (["a", "b"], "holds 2 prompts"),
])
def test_prompts_other_than_one_text_are_refused(prompt, words):
    error = refusal(completion, prompt=prompt)
    assert error.param == "prompt" and words in error.message


@pytest.mark.parametrize("messages,words", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"role": "tool", "content": "42"}], "messages[0].role must be one of"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{}]}],
     "messages[1].tool_calls is not supported"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0] is 'image_url'"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
])
def test_chat_messages_other_than_plain_text_are_refused(messages, words):
    error = refusal(chat, messages=messages)
    assert error.param == "messages" and words in error.message


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(errors.OpenAIError) as caught:
        completion_request(["model", "coordinator"], DEFAULT_MAX_TOKENS)
    assert caught.value.status == 400 and "JSON object" in caught.value.message


# ------------------------------------------------- the coordinator's errors ----


@pytest.mark.parametrize("message,fields,param,status", [
    ("max_tokens must be between 1 and 1024, got 0", None, "max_tokens", 400),
    ("max_tokens must be between 1 and 1024, got 0", {"max_tokens": "max_completion_tokens"},
     "max_completion_tokens", 400),
    ("random_seed must be between 0 and 2^64-1, got -1", None, "seed", 400),
    ("stop_words holds 17 strings; at most 16", None, "stop", 400),
    ("text_input is empty; send at least one character of prompt", None, "prompt", 400),
    ("text_input is 5000 tokens; with max_tokens 128 that exceeds the context limit of 4096 tokens",
     {"text_input": "messages"}, "messages", 400),
    ("speculation_window must be between 0 and 8 (the server's speculation_window), got 9", None,
     "speculation_window", 400),
    ("[request id: <id_unknown>] temperature must be between 0 and 100 (0 = greedy), got 101", None,
     "temperature", 400),
    ("target engine failed: CUDA error", None, None, 500),
    ("coordinator internal error: boom", None, None, 500),
    ("unknown input(s) foo; accepted inputs: text_input", None, None, 500),
])
def test_coordinator_errors_map_to_the_openai_field_or_a_server_error(message, fields, param, status):
    error = errors.from_coordinator(message, fields)
    assert (error.status, error.param) == (status, param)
    assert error.type == ("invalid_request_error" if status == 400 else "server_error")
    assert message in error.message  # the coordinator's words, with the limit, are kept
    if param and not message.startswith("[") and not message.startswith(param):
        assert error.message.startswith(f"{param}: ")  # the OpenAI name first, then the coordinator's


def test_error_bodies_have_openais_shape():
    body = errors.OpenAIError("max_tokens must be between 1 and 1024, got 0", param="max_tokens").body()
    assert body == {"error": {"message": "max_tokens must be between 1 and 1024, got 0",
                              "type": "invalid_request_error", "param": "max_tokens", "code": None}}


def test_request_validation_errors_become_one_400():
    invalid_json = errors.from_validation([{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
                                            "ctx": {"error": "Expecting value"}}])
    assert invalid_json.status == 400 and "not valid JSON (Expecting value)" in invalid_json.message
    not_object = errors.from_validation([{"type": "dict_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}])
    assert not_object.param is None and "JSON object" in not_object.message
    field = errors.from_validation([{"type": "int_type", "loc": ("body", "max_tokens"), "msg": "Input should be a valid integer"}])
    assert (field.status, field.param) == (400, "max_tokens") and field.message.startswith("max_tokens: ")


# ------------------------------------------------------------ responses ----


def statistics(**values) -> Statistics:
    stats = Statistics(draft_tokens=10, accepted_draft_tokens=8, acceptance_rate=0.800000011920929,
                       completion_tokens=16, speculative_rounds=3, draft_seconds=0.25)
    for name, value in values.items():
        setattr(stats, name, value)
    return stats


def test_finish_reason_is_length_when_every_allowed_token_was_used():
    assert finish_reason(16, 16) == "length"
    assert finish_reason(15, 16) == "stop"
    assert usage(5, 16) == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}


def test_speculation_carries_every_statistic_by_its_wire_name():
    values = speculation(statistics(fallback_reason="acceptance below fallback_threshold"))
    assert list(values) == [spec.name for spec in STATISTICS]
    assert values["total_draft_tokens"] == 10 and values["total_accepted_draft_tokens"] == 8
    assert values["acceptance_rate"] == 0.8  # float32's digits, not its binary tail
    assert values["draft_seconds"] == 0.25 and values["fallback_reason"] == "acceptance below fallback_threshold"
    json.dumps(values)  # plain JSON types


def test_a_completion_body():
    reply = Reply(chat=False, model="coordinator", max_tokens=16, created=1, request_id="cmpl-1")
    body = reply.body("x = 1", statistics(), prompt_tokens=4)
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1" and body["model"] == "coordinator"
    assert body["choices"] == [{"index": 0, "text": "x = 1", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}
    assert body["speculation"]["total_draft_tokens"] == 10


def test_a_chat_body():
    reply = Reply(chat=True, model="coordinator", max_tokens=64)
    body = reply.body("Hi.", statistics(), prompt_tokens=30)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi."}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_chunks_announce_the_role_once_and_end_with_the_statistics():
    reply = Reply(chat=True, model="coordinator", max_tokens=16)
    first, = reply.chunks("Hel")
    second, = reply.chunks("lo")
    last, = reply.chunks("!", statistics())
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None,
                                 "finish_reason": None}]
    assert second["choices"][0]["delta"] == {"content": "lo"}
    assert last["choices"][0]["delta"] == {"content": "!"} and last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last and last["speculation"]["completion_tokens"] == 16
    assert "speculation" not in first and "speculation" not in second
    assert len({chunk["id"] for chunk in (first, second, last)}) == 1


def test_a_stream_whose_only_response_is_the_final_one_still_names_the_role():
    reply = Reply(chat=True, model="coordinator", max_tokens=16)
    only, = reply.chunks("", statistics(completion_tokens=0))
    assert only["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert only["choices"][0]["finish_reason"] == "stop"


def test_with_include_usage_the_last_chunk_has_no_choices_and_carries_usage_and_statistics():
    reply = Reply(chat=False, model="coordinator", max_tokens=16, include_usage=True)
    first, = reply.chunks("a")
    finish, tail = reply.chunks("b", statistics(), prompt_tokens=4)
    assert first["usage"] is None and finish["usage"] is None
    assert finish["choices"][0] == {"index": 0, "text": "b", "logprobs": None, "finish_reason": "length"}
    assert "speculation" not in finish
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 20 and "speculation" in tail
    with pytest.raises(ValueError):
        Reply(chat=False, model="coordinator", max_tokens=16, include_usage=True).chunks("b", statistics())


def test_sse_framing():
    event = sse({"text": "naïve → ok", "n": 1})
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    assert json.loads(event[len("data: "):]) == {"text": "naïve → ok", "n": 1}
    assert "naïve → ok" in event  # UTF-8 as is, not \u escapes
    assert DONE == "data: [DONE]\n\n"


# ------------------------------------------------------------ boundary ----


def test_the_pure_modules_import_no_web_server_triton_or_torch():
    code = ("import sys\nimport frontend.errors, frontend.requests, frontend.responses\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'uvicorn', 'tritonclient',"
            " 'grpc', 'transformers', 'torch'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ------------------------------------------------ the overhead command ----


def test_overhead_reads_sse_and_compares_seconds_per_token():
    from frontend.overhead import Timing, read_sse, summary

    stream = [b'data: {"choices":[{"text":"a"}]}\n', b"\n", b'data: {"choices":[],"usage":{"completion_tokens":2}}\n',
              b"\n", b"data: [DONE]\n", b'data: {"after": "done"}\n']
    assert read_sse(stream) == [{"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 2}}]
    grpc = [Timing(1.0, 0.2, 10, "x"), Timing(3.0, 0.4, 30, "y")]
    openai = [Timing(1.1, 0.25, 10, "x"), Timing(3.3, 0.45, 30, "z")]
    result = summary(grpc, openai)
    assert result["grpc_ms_per_token"] == pytest.approx(100.0)
    assert result["openai_ms_per_token"] == pytest.approx(110.0)
    assert result["ratio"] == pytest.approx(1.1) and result["added_ms_per_token"] == pytest.approx(10.0)
    assert result["grpc_first_chunk_ms"] == pytest.approx(300.0) and result["different_texts"] == 1
    two_each = summary(grpc + grpc, [openai[0], openai[0], openai[1], openai[1]], per_prompt=2)
    assert two_each["median_prompt_ratio"] == pytest.approx(1.1) and two_each["different_texts"] == 2
