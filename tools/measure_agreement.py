"""Measure how often the draft predicts the target's greedy token, per draft
weight quantization: what a cheaper (quantized) draft costs in acceptance.

    python -m tools.measure_agreement [--schemes none,int8,int4] [--first 0 --last 9]

The target (dtype auto, as configs/cpu.pbtxt loads it) generates ``--tokens``
greedy tokens for each HumanEval prompt (``--target-tokens FILE`` keeps them
for the next run). The draft (bfloat16, as the engine loads it with each
``weight_quantization``) then reads the prompt and decodes the target's
tokens one at a time, teacher-forced: agreement is the fraction of positions where the
draft's argmax equals the target's token, given the target's own prefix. In
greedy speculation a draft token is accepted exactly when the draft agrees at
every position of the round up to it, so the same data also gives the
acceptance and tokens per round that a window of ``--window`` would see.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, DynamicCache

from tools.prompts import humaneval_prompts


def speculation_rounds(matches: list[bool], window: int) -> tuple[int, int, int]:
    """Greedy speculation over a teacher-forced match sequence: (rounds, drafted, accepted).

    Each round drafts min(window, tokens left - 1) tokens, accepts the leading
    matches and adds the target's own token, as the coordinator's loop does."""
    rounds = drafted = accepted = 0
    position = 0
    while position < len(matches):
        k = min(window, len(matches) - position - 1)
        run = 0
        while run < k and matches[position + run]:
            run += 1
        rounds += 1
        drafted += k
        accepted += run
        position += run + 1
    return rounds, drafted, accepted


@torch.inference_mode()
def greedy_argmaxes(model, prompt_ids: list[int], count: int, forced: list[int] | None = None,
                    end_id: int | None = None) -> list[int]:
    """The model's argmax at each of ``count`` positions after the prompt, decoding
    one token per forward (as the draft decodes when serving). It is fed its own
    argmax, or the ``forced`` tokens (teacher forcing) when given; stops after ``end_id``."""
    cache = DynamicCache(config=model.config)
    feed, argmaxes = prompt_ids, []
    for position in range(count):
        ids = torch.as_tensor([feed], dtype=torch.int64)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        argmaxes.append(int(logits[0, -1].float().argmax()))
        token = argmaxes[-1] if forced is None else forced[position]
        if token == end_id:
            break
        feed = [token]
    return argmaxes


def target_tokens(args, prompts) -> dict[str, list[int]]:
    """Greedy target tokens per task. With ``--target-tokens`` they are kept in
    that file after each prompt and reused by the next run with the same settings."""
    from cpu_engine.engine import DTYPES, resolve_dtype  # the CPU engine: not in the GPU image

    settings = {"target_dir": args.target_dir, "tokens": args.tokens}
    path = Path(args.target_tokens) if args.target_tokens else None
    tokens: dict[str, list[int]] = {}
    if path and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings:
            tokens = saved["tokens"]
    missing = [(task, ids) for task, ids in prompts if task not in tokens]
    if not missing:
        print(f"# target tokens from {path}", flush=True)
        return tokens
    dtype = resolve_dtype("auto")
    model = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=DTYPES[dtype]).eval()
    end_id = model.generation_config.eos_token_id
    end_id = end_id[0] if isinstance(end_id, list) else end_id
    start = time.perf_counter()
    for task, ids in missing:
        tokens[task] = greedy_argmaxes(model, ids, args.tokens, end_id=end_id)
        print(f"{task}: {len(tokens[task])} target tokens", file=sys.stderr, flush=True)
        if path:
            path.write_text(json.dumps({"settings": settings, "tokens": tokens}) + "\n")
    print(f"# target {args.target_dir} ({dtype}): {sum(len(t) for t in tokens.values())} greedy tokens "
          f"for {len(prompts)} prompts ({len(missing)} generated in {time.perf_counter() - start:.0f} s)", flush=True)
    return tokens


def main(argv: list[str] | None = None) -> None:
    # The CPU engine and the local model cache: imported here, since the GPU image
    # carries tools/ without them.
    from cpu_engine.engine import CausalLMEngine
    from cpu_engine.quantize import check_scheme
    from launcher.assets import DEFAULT_DRAFT, DEFAULT_TARGET, default_cache_dir

    models = default_cache_dir() / "models"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-dir", default=str(models / DEFAULT_TARGET))
    parser.add_argument("--draft-dir", default=str(models / DEFAULT_DRAFT))
    parser.add_argument("--tokenizer-dir", help="directory of tokenizer.json (default: --target-dir)")
    parser.add_argument("--schemes", default="none,int8,int4", help="draft weight_quantization schemes")
    parser.add_argument("--first", type=int, default=0, help="first HumanEval problem (default 0)")
    parser.add_argument("--last", type=int, default=9, help="last HumanEval problem (default 9)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy target tokens per prompt (default 48)")
    parser.add_argument("--window", type=int, default=5, help="speculation window of the simulated rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target-tokens", help="JSON file that keeps the target's greedy tokens between runs")
    args = parser.parse_args(argv)
    schemes = [check_scheme(s) for s in args.schemes.split(",")]

    # encoded as the coordinator encodes a prompt (coordinator/request/tokenizer.py)
    tokenizer = Tokenizer.from_file(f"{args.tokenizer_dir or args.target_dir}/tokenizer.json")
    torch.set_num_threads(args.threads)
    prompts = [(task, tokenizer.encode(prompt, add_special_tokens=True).ids)
               for task, prompt in humaneval_prompts(args.first, args.last)]
    expected = target_tokens(args, prompts)

    print(f"| draft weights | agreement | acceptance (window {args.window}) | tokens per round | "
          f"worst prompt | draft ms per token |")
    print("|---|---|---|---|---|---|")
    for scheme in schemes:
        draft = CausalLMEngine(args.draft_dir, dtype="bfloat16", num_threads=args.threads, max_cached_sequences=0,
                               weight_quantization=scheme)
        matched = total = rounds = drafted = accepted = 0
        worst = (2.0, "")
        start = time.perf_counter()
        for task, ids in prompts:
            tokens = expected[task]
            matches = [a == t for a, t in zip(greedy_argmaxes(draft.model, ids, len(tokens), forced=tokens), tokens)]
            matched += sum(matches)
            total += len(matches)
            worst = min(worst, (sum(matches) / len(matches), task))
            r, d, a = speculation_rounds(matches, args.window)
            rounds, drafted, accepted = rounds + r, drafted + d, accepted + a
        elapsed = time.perf_counter() - start
        print(f"| {scheme} | {matched / total:.3f} ({matched}/{total}) | {accepted / max(drafted, 1):.3f} | "
              f"{total / rounds:.2f} | {worst[1]} {worst[0]:.2f} | {1000 * elapsed / total:.0f} |", flush=True)
        del draft


if __name__ == "__main__":
    main()
