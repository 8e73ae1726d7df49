"""Measure what one forward pass of n new tokens costs, per model and dtype,
with a warm KV cache: the numbers that decide whether speculation can pay on
this machine (a cheap draft step, and a target that verifies k+1 tokens for
not much more than the cost of one).

    python -m coordinator.cpu_engine.measure --model-dir DIR [--dtypes float32,bfloat16]
        [--weight-quantization none,int8,int4]

``--weight-quantization`` measures each model also with weight-only quantized
linear layers (coordinator/cpu_engine/quantize.py), as the engine's
``weight_quantization`` parameter loads them.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from coordinator.cpu_engine.engine import DTYPES, cpu_has_native_bf16
from coordinator.cpu_engine.quantize import DENSE_ROWS, check_scheme, quantize_linear_layers


@torch.inference_mode()
def forward_ms(model, context: int, new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` time of one forward over ``new_tokens`` after ``context`` cached tokens."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, past_key_values=cache, use_cache=True)
    best = float("inf")
    for _ in range(repeats):
        tokens = torch.randint(0, vocab, (1, new_tokens), generator=generator)
        start = time.perf_counter()
        model(input_ids=tokens, past_key_values=cache, use_cache=True)
        best = min(best, time.perf_counter() - start)
        cache.crop(-new_tokens)
    return best * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", action="append", required=True, help="Hugging Face model dir (repeatable)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="1,2,4,6,8")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weight-quantization", default="none",
                        help="comma-separated schemes: none, int8, int4 (default none)")
    parser.add_argument("--dense-rows", type=int, default=DENSE_ROWS,
                        help=f"quantized layers use the original weights above this many rows (default {DENSE_ROWS}, "
                             "the engine's; 0: always the quantized kernels)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.tokens.split(",")]
    schemes = [check_scheme(s) for s in args.weight_quantization.split(",")]
    print(f"# forward time in ms, {args.threads} threads, {args.context}-token cached context, best of {args.repeats}; "
          f"native bfloat16: {'yes' if cpu_has_native_bf16() else 'no'} (dtype auto picks "
          f"{'bfloat16' if cpu_has_native_bf16() else 'float32'})")
    print("| model | dtype | weights | " + " | ".join(f"{n} tok" for n in counts)
          + f" | {counts[-1]} tok / {counts[0]} tok |")
    print("|---|---|---|" + "---|" * (len(counts) + 1))
    for model_dir in args.model_dir:
        for dtype in args.dtypes.split(","):
            for scheme in schemes:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
                quantize_linear_layers(model, scheme, dense_rows=args.dense_rows)
                times = [forward_ms(model, args.context, n, args.repeats) for n in counts]
                name = model_dir.rstrip("/").rsplit("/", 1)[-1]
                cells = " | ".join(f"{t:.1f}" for t in times)
                print(f"| {name} | {dtype} | {scheme} | {cells} | {times[-1] / times[0]:.2f}x |", flush=True)
                del model


if __name__ == "__main__":
    main()
