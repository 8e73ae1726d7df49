import json

import pytest

from launcher import launch
from launcher.pair import TokenizerMismatch, check_pair, prepare_pair_tokenizer, read_profile
from coordinator.request.tokenizer import Codec
from tests.tiny_models import WORDS, write_tokenizer


def test_identical_tokenizers_pass_and_the_coordinator_dir_is_written(tmp_path):
    target, draft = write_tokenizer(tmp_path / "t"), write_tokenizer(tmp_path / "d")
    out = prepare_pair_tokenizer(target, draft, tmp_path / "cache")
    assert json.loads((out / "special_tokens.json").read_text()) == {"eos_token_ids": [0], "pad_token_id": 1}
    codec = Codec.from_dir(out)
    assert codec.decode(codec.encode("def x ( )")) == "def x ( )"
    assert codec.special.end_id == 0


@pytest.mark.parametrize(
    "draft_kwargs,message",
    [
        (dict(words=WORDS[:-1] + ["3"]), "vocabularies differ"),
        (dict(words=list(reversed(WORDS))), "vocabularies differ"),
        (dict(eos="<pad>"), "end-of-sequence ids differ"),
        (dict(pad="<eos>"), "pad ids differ"),
        (dict(vocab_size=64), "output vocabulary sizes differ"),
    ],
)
def test_mismatched_pairs_are_refused_with_the_difference_named(tmp_path, draft_kwargs, message):
    target = read_profile(write_tokenizer(tmp_path / "t"))
    draft = read_profile(write_tokenizer(tmp_path / "d", **draft_kwargs))
    with pytest.raises(TokenizerMismatch) as error:
        check_pair(target, draft)
    assert message in str(error.value) and "do not share a tokenizer" in str(error.value)


def test_specdec_serve_refuses_to_start_on_a_mismatched_pair(tmp_path, capsys):
    target = write_tokenizer(tmp_path / "t")
    draft = write_tokenizer(tmp_path / "d", eos="<pad>")
    code = launch.main(["--target", str(target), "--draft", str(draft), "--cache-dir", str(tmp_path / "cache")])
    assert code == 2
    assert "do not share a tokenizer" in capsys.readouterr().err
