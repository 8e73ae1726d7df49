"""The pair's end ids: one list, computed the same way for both profiles
(specdec-serve for cpu, docker/build_engines.sh for trtllm), sent to the
engines as ``end_id`` plus stop words, and honoured by the CPU engine's
emulation of TensorRT-LLM (a stop word is returned and counted, the end id
neither)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.engines.tensors import engine_inputs
from coordinator.request.end_tokens import chat_template_text, end_token_ids
from coordinator.sampling.params import SamplingParams
from coordinator.sampling.penalties import read_word_list
from trtllm_emulation import calls

QWEN_VOCAB = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "hello": 9707}
QWEN_TEMPLATE = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "build_engines.sh"


def test_qwen_instruct_as_published_ends_at_both_tokens():
    ids = end_token_ids(QWEN_VOCAB, eos_token="<|im_end|>", generation_config={"eos_token_id": [151645, 151643]},
                        model_config={"model_type": "qwen2", "eos_token_id": 151645}, chat_template=QWEN_TEMPLATE)
    assert ids == [151645, 151643]


def test_a_converted_checkpoint_that_kept_one_eos_gets_the_same_list():
    """A GGUF conversion keeps <|im_end|> alone; the family's end tokens restore <|endoftext|>."""
    ids = end_token_ids(QWEN_VOCAB, eos_token="<|im_end|>", generation_config={"eos_token_id": 151645},
                        model_config={"model_type": "qwen2", "eos_token_id": 151645}, chat_template=QWEN_TEMPLATE)
    assert ids == [151645, 151643]


def test_the_chat_template_adds_its_turn_end_and_the_order_is_kept():
    vocab = {"<|end_of_text|>": 128001, "<|eot_id|>": 128009, "<|eom_id|>": 128008}
    template = "{{ message['content'] | trim + '<|eot_id|>' }}"
    assert end_token_ids(vocab, eos_token="<|end_of_text|>", model_config={"model_type": "other"},
                         chat_template=template) == [128001, 128009]
    assert end_token_ids(vocab, eos_token="<|end_of_text|>", model_config={"model_type": "llama"}) == [
        128001, 128009, 128008]


def test_nothing_named_gives_no_ids_and_bad_values_are_skipped():
    assert end_token_ids({}) == []
    assert end_token_ids({}, generation_config={"eos_token_id": [True, -1, None, 7]}) == [7]


def test_the_template_comes_from_the_jinja_file_first():
    assert chat_template_text({"chat_template": "a"}, "b") == "b"
    assert chat_template_text({"chat_template": "a"}, None) == "a"
    assert chat_template_text({"chat_template": [{"name": "default", "template": "c"}]}, None) == "c"


def test_cpu_profile_reads_both_ids_from_a_checkpoint_dir(tmp_path):
    from launcher.pair import read_profile

    tokenizer = {"version": "1.0", "model": {"type": "WordLevel", "vocab": QWEN_VOCAB, "unk_token": "hello"},
                 "added_tokens": [{"id": i, "content": t, "special": True, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False} for t, i in QWEN_VOCAB.items() if "<" in t]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                "pad_token": "<|endoftext|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 151645}))
    (tmp_path / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    assert read_profile(tmp_path).special.eos_token_ids == (151645, 151643)


def test_the_build_script_uses_the_same_function():
    text = BUILD_SCRIPT.read_text()
    assert "from coordinator.request.end_tokens import chat_template_text, end_token_ids" in text
    assert "sorted({int(e) for e in eos})" not in text  # the order is the list's: the first is end_id


def test_the_other_end_ids_go_to_the_engine_as_stop_words():
    tensors = engine_inputs([1, 2], 4, SamplingParams(), end_id=151645, pad_id=151643, stop_ids=(151643, 151645))
    assert int(tensors["end_id"].reshape(-1)[0]) == 151645
    assert read_word_list(tensors["stop_words_list"]) == ((151643,),)
    assert "stop_words_list" not in engine_inputs([1, 2], 4, SamplingParams(), end_id=5, pad_id=5)


def scripted(sequence):
    """A step function whose logits pick ``sequence`` one token at a time."""
    position = iter(sequence)

    def step(_token):
        row = np.zeros(16, dtype=np.float32)
        row[next(position)] = 10.0
        return row
    return step


GREEDY = SamplingParams()


def test_plain_decoding_stops_after_a_stop_word_and_returns_it():
    result = calls.generate(scripted([3, 4, 9, 5, 6]), 1, 5, GREEDY, end_id=7, stop_words=[(9,)])
    assert result.tokens == [3, 4, 9] and result.fed == 2


def test_plain_decoding_stops_before_the_end_id_and_hides_it():
    result = calls.generate(scripted([3, 4, 7, 5, 6]), 1, 5, GREEDY, end_id=7, stop_words=[(9,)])
    assert result.tokens == [3, 4]


def test_a_multi_token_stop_word_ends_where_it_completes():
    result = calls.generate(scripted([3, 4, 9, 5, 6]), 1, 5, GREEDY, end_id=None, stop_words=[(4, 9)])
    assert result.tokens == [3, 4, 9]


def test_verification_stops_at_a_stop_word_among_the_accepted():
    rows = np.zeros((4, 16), dtype=np.float32)
    for i, token in enumerate([3, 9, 5, 6]):
        rows[i, token] = 10.0
    result = calls.verify(rows, [3, 9, 5], None, 4, GREEDY, end_id=7, stop_words=[(9,)])
    assert result.tokens == [3, 9]
    assert calls.verify(rows, [3, 9, 5], None, 4, GREEDY, end_id=7).tokens == [3, 9, 5, 6]


@pytest.mark.parametrize("stop", [(), ((9,),)])
def test_the_cpu_engine_reads_stop_words_list(stop, monkeypatch):
    import importlib
    import sys
    import types

    tensors = engine_inputs([1, 2], 4, GREEDY, end_id=7, pad_id=7, stop_ids=[w[0] for w in stop])
    found = {name: type("Tensor", (), {"as_numpy": lambda self, a=array: a})() for name, array in tensors.items()}
    backend = types.ModuleType("triton_python_backend_utils")
    backend.get_input_tensor_by_name = lambda _request, name: found.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    monkeypatch.delitem(sys.modules, "cpu_engine.triton_model", raising=False)
    try:
        model = importlib.import_module("cpu_engine.triton_model")
        assert model._read_request(object()).stop_words == stop
    finally:  # not left behind bound to this fake backend (monkeypatch restores an earlier import)
        sys.modules.pop("cpu_engine.triton_model", None)


def test_the_cpu_engine_stops_at_a_stop_word_and_returns_it(tmp_path):
    pytest.importorskip("torch")
    from cpu_engine.engine import CausalLMEngine, EngineRequest
    from tests.tiny_models import write_tiny_qwen2

    engine = CausalLMEngine(str(write_tiny_qwen2(tmp_path / "m", vocab_size=16, seed=1, logit_scale=20.0)),
                            dtype="float32", num_threads=1)
    prompt = np.array([3, 5, 7, 11], dtype=np.int32)
    tokens = engine.run(EngineRequest(prompt, 8)).tokens
    stop = tokens[2]
    first = tokens.index(stop)
    stopped = engine.run(EngineRequest(prompt, 8, stop_words=((stop,),))).tokens
    assert stopped == tokens[: first + 1]
    ended = engine.run(EngineRequest(prompt, 8, end_id=stop)).tokens
    assert ended == tokens[:first]
