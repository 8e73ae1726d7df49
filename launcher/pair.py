"""Check that a draft/target pair shares one tokenizer, and write the
tokenizer directory the coordinator loads.

Speculative decoding compares token ids: a draft whose ids mean other strings
than the target's (or whose end-of-sequence id differs) silently proposes
nonsense, acceptance collapses, and nothing says why. This check refuses
such a pair at start-up instead."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from coordinator.request.end_tokens import chat_template_text, end_token_ids
from coordinator.request.tokenizer import SPECIAL_TOKENS_FILE, SpecialTokens


class TokenizerMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class TokenizerProfile:
    vocab: dict[str, int]
    special: SpecialTokens
    bos_token_id: int | None
    model_vocab_size: int | None  # rows of the model's output layer


def read_profile(model_dir: Path) -> TokenizerProfile:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tok_config = _json(model_dir / "tokenizer_config.json")
    gen_config = _json(model_dir / "generation_config.json")
    model_config = _json(model_dir / "config.json")

    def token_id(key: str) -> int | None:
        token = tok_config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return vocab.get(token) if isinstance(token, str) else None

    template_file = model_dir / "chat_template.jinja"
    template = chat_template_text(tok_config, template_file.read_text() if template_file.is_file() else None)
    eos_token = tok_config.get("eos_token")
    eos = end_token_ids(vocab, eos_token=eos_token.get("content") if isinstance(eos_token, dict) else eos_token,
                        generation_config=gen_config, model_config=model_config, chat_template=template)
    if not eos:
        raise TokenizerMismatch(f"{model_dir}: no end-of-sequence token id in tokenizer_config/generation_config/"
                                "config/chat template")
    pad = token_id("pad_token")
    if pad is None:
        pad = gen_config.get("pad_token_id", model_config.get("pad_token_id"))
    bos = token_id("bos_token")
    if bos is None:
        bos = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
    vocab_size = model_config.get("vocab_size", model_config.get("text_config", {}).get("vocab_size"))
    return TokenizerProfile(
        vocab=vocab,
        special=SpecialTokens(tuple(eos), pad if isinstance(pad, int) else eos[0]),
        bos_token_id=bos,
        model_vocab_size=vocab_size,
    )


def check_pair(target: TokenizerProfile, draft: TokenizerProfile) -> None:
    """Raise TokenizerMismatch naming every difference that breaks speculation."""
    problems = []
    if target.vocab != draft.vocab:
        differing = sorted(
            set(target.vocab.items()) ^ set(draft.vocab.items()), key=lambda item: (item[1], item[0])
        )
        example = ", ".join(f"{token!r}->{index}" for token, index in differing[:3])
        problems.append(
            f"vocabularies differ ({len(target.vocab)} vs {len(draft.vocab)} tokens, "
            f"{len(differing)} differing entries, e.g. {example})"
        )
    if target.special.eos_token_ids != draft.special.eos_token_ids:
        problems.append(f"end-of-sequence ids differ ({list(target.special.eos_token_ids)} vs "
                        f"{list(draft.special.eos_token_ids)})")
    if target.special.pad_token_id != draft.special.pad_token_id:
        problems.append(f"pad ids differ ({target.special.pad_token_id} vs {draft.special.pad_token_id})")
    if target.bos_token_id != draft.bos_token_id:
        problems.append(f"begin-of-sequence ids differ ({target.bos_token_id} vs {draft.bos_token_id})")
    if target.model_vocab_size != draft.model_vocab_size:
        problems.append(
            f"output vocabulary sizes differ ({target.model_vocab_size} vs {draft.model_vocab_size}); "
            "draft logits could not be compared with the target's"
        )
    if problems:
        raise TokenizerMismatch(
            "the target and draft models do not share a tokenizer: "
            + "; ".join(problems)
            + ". Speculative decoding needs a draft from the same model family with the identical tokenizer."
        )


def prepare_pair_tokenizer(target_dir: Path, draft_dir: Path, cache_dir: Path) -> Path:
    """Check the pair and return a directory with tokenizer.json + special_tokens.json."""
    target, draft = read_profile(target_dir), read_profile(draft_dir)
    check_pair(target, draft)
    key = hashlib.sha256(f"{target_dir.resolve()}\n{draft_dir.resolve()}".encode()).hexdigest()[:16]
    out = cache_dir / "pairs" / key
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target_dir / "tokenizer.json", out / "tokenizer.json")
    (out / SPECIAL_TOKENS_FILE).write_text(target.special.to_json() + "\n")
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
