"""The coordinator's tokenizer: ``tokenizer.json`` plus the special ids the
loop needs, read from one directory (prepared by ``specdec-serve`` in the cpu
profile and by the engine build script in the trtllm profile)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from tokenizers import Tokenizer

SPECIAL_TOKENS_FILE = "special_tokens.json"


@dataclass(frozen=True)
class SpecialTokens:
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @property
    def end_id(self) -> int:
        """The id sent to engines as ``end_id`` (the first eos)."""
        return self.eos_token_ids[0]

    def to_json(self) -> str:
        return json.dumps({"eos_token_ids": list(self.eos_token_ids), "pad_token_id": self.pad_token_id})

    @classmethod
    def from_json(cls, text: str) -> SpecialTokens:
        data = json.loads(text)
        eos = tuple(int(i) for i in data["eos_token_ids"])
        if not eos:
            raise ValueError("special_tokens.json: eos_token_ids is empty")
        return cls(eos, int(data["pad_token_id"]))


class Codec:
    """Text <-> ids with the model pair's shared tokenizer."""

    def __init__(self, tokenizer: Tokenizer, special: SpecialTokens):
        self._tokenizer = tokenizer
        self.special = special
        self._max_token_bytes: int | None = None

    @property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest token's text (128 for Qwen2.5): a prompt
        of n bytes has at least n / max_token_bytes tokens, which bounds the
        prompt size worth tokenizing at all."""
        if self._max_token_bytes is None:
            size = self.vocab_size
            texts = self._tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
            self._max_token_bytes = max(1, max(len(t.encode("utf-8")) for t in texts))
        return self._max_token_bytes

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def text_bytes(self, text: str) -> int:
        """UTF-8 length of ``text`` as the tokenizer's model sees it (after its
        normalizer, if it has one: normalization may lengthen text)."""
        normalizer = self._tokenizer.normalizer
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        return len(text.encode("utf-8"))

    @classmethod
    def from_dir(cls, directory: str | Path) -> Codec:
        directory = Path(directory)
        for name in ("tokenizer.json", SPECIAL_TOKENS_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"tokenizer_dir {directory} has no {name}")
        special = SpecialTokens.from_json((directory / SPECIAL_TOKENS_FILE).read_text())
        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), special)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_words(self, text: str) -> list[int]:
        """``text`` as a word list entry: no special tokens, as NVIDIA's
        preprocessing tokenizes stop and bad words."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)
