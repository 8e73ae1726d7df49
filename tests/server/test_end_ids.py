"""The pair's end ids on the real server (cpu profile): the engines stop
where the text stops. A chat turn that ends by itself costs the target no
forwards past its end (``specdec_engine_forwards_total{model="target"}``),
and a direct engine call honours ``stop_words_list`` as TensorRT-LLM does
(the stop word returned and counted, the end id neither).

Uses the session fixtures ``triton_server`` and ``openai_frontend``."""

from __future__ import annotations

import time

import openai
import pytest
from tokenizers import Tokenizer

from coordinator.engines.tensors import engine_inputs, generated_tokens
from coordinator.sampling.params import SamplingParams
from tests.server_client import engine_responses, metric, metrics_text

pytestmark = pytest.mark.slow

IM_END, END_OF_TEXT = 151645, 151643
MESSAGES = [{"role": "user", "content": "Answer with one word: what is the capital of France?"}]


def quiet_metrics(server, quiet: float = 1.0, timeout: float = 60.0) -> str:
    """The metrics once the target has run no forward for ``quiet`` seconds and holds no call."""
    def state(text):
        return (metric(text, "specdec_engine_forwards_total", model="target"),
                metric(text, "specdec_engine_running_calls", model="target"))
    started = time.monotonic()
    text = metrics_text(server)
    since, last = time.monotonic(), state(text)
    while time.monotonic() - started < timeout:
        time.sleep(0.2)
        text = metrics_text(server)
        now = state(text)
        if now != last or now[1]:
            since, last = time.monotonic(), now
        elif time.monotonic() - since >= quiet:
            return text
    raise AssertionError(f"the target was still running forwards after {timeout:g} s")


def test_the_coordinator_knows_both_end_ids(triton_server):
    from launcher.launch import ServerOptions, prepare
    from coordinator.request.tokenizer import Codec

    assert Codec.from_dir(prepare(ServerOptions()).tokenizer_dir).special.eos_token_ids == (IM_END, END_OF_TEXT)


def test_a_chat_turn_that_ends_by_itself_costs_the_target_no_forward_past_its_end(triton_server, openai_frontend,
                                                                                  real_target_dir):
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(real_target_dir)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert len(Tokenizer.from_file(str(real_target_dir / "tokenizer.json")).encode(text).ids) < 64
    client = openai.OpenAI(base_url=openai_frontend, api_key=triton_server.api_key or "none", max_retries=0,
                           timeout=300)
    before = quiet_metrics(triton_server)
    answer = client.chat.completions.create(model="coordinator", messages=MESSAGES, max_tokens=64, temperature=0,
                                            extra_body={"speculation_window": 0})
    after = quiet_metrics(triton_server)
    assert answer.choices[0].finish_reason == "stop", answer
    completion = answer.usage.completion_tokens
    forwards = (metric(after, "specdec_engine_forwards_total", model="target")
                - metric(before, "specdec_engine_forwards_total", model="target"))
    # the prefill, one per token, the end: nothing generated past the end of the text
    assert completion < 64 and forwards <= completion + 3, (completion, forwards, answer.choices[0].message.content)


def test_the_target_stops_at_a_stop_word_and_returns_it(triton_server, real_target_dir):
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    prompt = tokenizer.encode("def fibonacci(n):").ids

    def call(**ends):
        tensors = engine_inputs(prompt, 8, SamplingParams(), pad_id=END_OF_TEXT, **ends)
        tokens = []
        for result in engine_responses(triton_server, "target", tensors, ["output_ids", "sequence_length"]):
            tokens += generated_tokens(result.as_numpy("output_ids"), result.as_numpy("sequence_length"))
        return tokens

    tokens = call(end_id=END_OF_TEXT)
    assert len(tokens) == 8
    stop = tokens[3]
    first = tokens.index(stop)
    assert call(end_id=END_OF_TEXT, stop_ids=(stop,)) == tokens[: first + 1]  # returned and counted
    assert call(end_id=stop, stop_ids=(END_OF_TEXT,)) == tokens[:first]  # the end id neither
