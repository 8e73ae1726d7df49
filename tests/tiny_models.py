"""Tiny tokenizers and models written to disk, for tests that need real files."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ["<eos>", "<pad>", "def", "return", "x", "y", "(", ")", ":", "+", "1", "2"]


def write_tokenizer(directory: Path, words=WORDS, eos="<eos>", pad="<pad>", vocab_size=None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "pad_token": pad}))
    (directory / "config.json").write_text(json.dumps({"vocab_size": vocab_size or len(words)}))
    return directory


def write_tiny_qwen2(directory: Path, vocab_size: int = 64, seed: int = 0, logit_scale: float = 1.0) -> Path:
    """A random 2-layer Qwen2. ``logit_scale`` multiplies the output layer: a
    freshly initialised model predicts nearly uniform tokens, a scaled one has
    peaked, context-dependent distributions like a trained model's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    model = Qwen2ForCausalLM(config)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(str(directory))
    return directory
