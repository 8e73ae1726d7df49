"""The chat prompt and the prompt's token count, from the target's tokenizer
directory (``tokenizer.json`` and its chat template).

Chat messages become text with ``transformers``' own ``apply_chat_template``
(the template the model was trained with, Jinja and all); the count uses
``tokenizer.json`` with ``tokenizers`` exactly as the coordinator encodes a
prompt (``coordinator.request.tokenizer.Codec.encode``), so ``usage.prompt_tokens`` is
what the engines were given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from frontend.errors import OpenAIError


class Prompts:
    def __init__(self, tokenizer_dir: str | Path):
        from transformers import AutoTokenizer  # imports torch: only the server process pays for it

        directory = Path(tokenizer_dir)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer directory {directory} has no tokenizer.json")
        self.directory = directory
        self._template = AutoTokenizer.from_pretrained(str(directory))
        if not getattr(self._template, "chat_template", None):
            raise ValueError(f"the tokenizer in {directory} has no chat template")
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))

    def chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt of a conversation, ending where the assistant's reply starts."""
        try:
            return self._template.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        except Exception as error:  # the template's own checks (jinja2 raise_exception), e.g. role order
            raise OpenAIError(f"messages do not fit the model's chat template: {error}", param="messages") from None

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=True).ids)
