"""The end ids of a checkpoint: one ordered list, computed the same way for
both profiles (``specdec-serve`` for cpu, ``docker/build_engines.sh`` for
trtllm), so the engines and the coordinator agree on where a completion ends.

A checkpoint names its end tokens in several places, and conversions lose
some of them (a GGUF keeps one eos; the original Qwen2.5-instruct generation
config lists ``<|im_end|>`` and ``<|endoftext|>``). The list is the union of

* the tokenizer's ``eos_token``,
* ``eos_token_id`` of the generation config, then of the model config,
* the turn-end tokens the chat template writes (a known spelling that the
  template contains and the vocabulary holds),
* the model family's end tokens (by ``model_type``), where the vocabulary
  holds them,

in that order, without repeats. The first is the engines' ``end_id``; the
others go to the engines as stop words."""

from __future__ import annotations

from collections.abc import Mapping

# Spellings of the tokens chat templates end a turn (or the text) with.
TURN_END_SPELLINGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                      "<end_of_turn>", "<|end|>", "<|return|>", "</s>")

# A family's end tokens, whichever of them its converted checkpoint still names.
FAMILY_END_TOKENS: dict[str, tuple[str, ...]] = {
    "qwen2": ("<|im_end|>", "<|endoftext|>"),
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "llama": ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"),
    "gemma2": ("<end_of_turn>", "<eos>"),
    "gemma3_text": ("<end_of_turn>", "<eos>"),
    "phi3": ("<|end|>", "<|endoftext|>"),
}


def end_token_ids(vocab: Mapping[str, int], *, eos_token: str | None = None,
                  generation_config: Mapping | None = None, model_config: Mapping | None = None,
                  chat_template: str | None = None) -> list[int]:
    """The checkpoint's end ids, first the one the engines get as ``end_id``."""
    ids: list[int] = []

    def add(value) -> None:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0 and item not in ids:
                ids.append(item)

    if eos_token is not None:
        add(vocab.get(eos_token))
    add((generation_config or {}).get("eos_token_id"))
    add((model_config or {}).get("eos_token_id"))
    if chat_template:
        for spelling in TURN_END_SPELLINGS:
            if spelling in chat_template:
                add(vocab.get(spelling))
    for spelling in FAMILY_END_TOKENS.get(str((model_config or {}).get("model_type", "")), ()):
        add(vocab.get(spelling))
    return ids


def chat_template_text(tokenizer_config: Mapping, template_file_text: str | None) -> str:
    """The chat template: ``chat_template.jinja`` where there is one, else the
    tokenizer config's ``chat_template`` (a string, or a list of named ones)."""
    if template_file_text:
        return template_file_text
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""
