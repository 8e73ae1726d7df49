"""Measure how often the draft predicts the target's greedy token, per draft
weight quantization: what a cheaper (quantized) draft costs in acceptance.

    python -m coordinator.cpu_engine.measure_agreement [--schemes none,int8,int4] [--first 0 --last 9]

The target (engine settings of configs/cpu.pbtxt: dtype auto, 8 decode rows)
generates ``--tokens`` greedy tokens for each HumanEval prompt. The draft
(bfloat16, each scheme) then reads the prompt and decodes the target's tokens
one at a time, teacher-forced: agreement is the fraction of positions where the
draft's argmax equals the target's token, given the target's own prefix. In
greedy speculation a draft token is accepted exactly when the draft agrees at
every position of the round up to it, so the same data also gives the
acceptance and tokens per round that a window of ``--window`` would see.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import DynamicCache

from coordinator.bench import humaneval_prompts
from coordinator.cpu_engine.engine import CausalLMEngine, EngineRequest
from coordinator.cpu_engine.quantize import check_scheme
from coordinator.serving.assets import DEFAULT_DRAFT, DEFAULT_TARGET, default_cache_dir


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


def target_tokens(engine: CausalLMEngine, prompt_ids: list[int], count: int, end_id: int | None) -> list[int]:
    return engine.run(EngineRequest(np.asarray(prompt_ids), count, end_id=end_id)).tokens


@torch.inference_mode()
def draft_matches(engine: CausalLMEngine, prompt_ids: list[int], tokens: list[int]) -> list[bool]:
    """Teacher-forced: does the draft's argmax after prompt + tokens[:i] equal tokens[i]?

    The prompt is prefilled in one forward and the tokens are then fed one at a
    time, as the draft decodes when serving (one-row forwards: the quantized kernels)."""
    cache = DynamicCache(config=engine.model.config)
    feed = prompt_ids
    matches = []
    for token in tokens:
        ids = torch.as_tensor([feed], dtype=torch.int64)
        logits = engine.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        matches.append(int(logits[0, -1].float().argmax()) == token)
        feed = [token]
    return matches


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    schemes = [check_scheme(s) for s in args.schemes.split(",")]

    # encoded as the coordinator encodes a prompt (coordinator/tokenizer.py)
    tokenizer = Tokenizer.from_file(f"{args.tokenizer_dir or args.target_dir}/tokenizer.json")
    target = CausalLMEngine(args.target_dir, dtype="auto", num_threads=args.threads, max_cached_sequences=0,
                            decode_rows=8)
    end_id = target.model.generation_config.eos_token_id
    end_id = end_id[0] if isinstance(end_id, list) else end_id
    prompts = []
    start = time.perf_counter()
    for task, prompt in humaneval_prompts(args.first, args.last):
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids
        prompts.append((task, ids, target_tokens(target, ids, args.tokens, end_id)))
    print(f"# target {args.target_dir} ({target.dtype}): {sum(len(t) for *_, t in prompts)} greedy tokens "
          f"for {len(prompts)} prompts in {time.perf_counter() - start:.0f} s", flush=True)
    del target

    print(f"| draft weights | agreement | acceptance (window {args.window}) | tokens per round | "
          f"worst prompt | draft forward s |")
    print("|---|---|---|---|---|---|")
    for scheme in schemes:
        draft = CausalLMEngine(args.draft_dir, dtype="bfloat16", num_threads=args.threads, max_cached_sequences=0,
                               weight_quantization=scheme)
        matched = total = rounds = drafted = accepted = 0
        worst = (2.0, "")
        start = time.perf_counter()
        for task, ids, tokens in prompts:
            matches = draft_matches(draft, ids, tokens)
            matched += sum(matches)
            total += len(matches)
            worst = min(worst, (sum(matches) / len(matches), task))
            r, d, a = speculation_rounds(matches, args.window)
            rounds, drafted, accepted = rounds + r, drafted + d, accepted + a
        elapsed = time.perf_counter() - start
        print(f"| {scheme} | {matched / total:.3f} ({matched}/{total}) | {accepted / max(drafted, 1):.3f} | "
              f"{total / rounds:.2f} | {worst[1]} {worst[0]:.2f} | {elapsed:.1f} |", flush=True)
        del draft


if __name__ == "__main__":
    main()
