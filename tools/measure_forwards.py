"""Measure what one forward pass of n new tokens costs, per model and dtype,
with a warm KV cache: the numbers that decide whether speculation can pay on
this machine (a cheap draft step, and a target that verifies k+1 tokens for
not much more than the cost of one).

    python -m tools.measure_forwards --model-dir DIR [--dtypes float32,bfloat16]
        [--weight-quantization none,int8,int4] [--linear-kernels default,onednn-packed]

``--weight-quantization`` measures each model also with weight-only quantized
linear layers (cpu_engine/quantize.py), as the engine's
``weight_quantization`` parameter loads them; ``--linear-kernels`` with each
kernel of the float linear layers (cpu_engine/packed.py; ``auto``, the
default, measures and keeps the cheaper, as the engine's ``linear_kernel``).
A forward of n tokens is timed as it is, not padded to the row count from
which a kernel's rows agree (the engine pads a plain step to it).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

# The CPU engine is imported where it is used: the GPU image carries tools/ without it.


class ForwardTimer:
    """Times forwards of one model after a fixed cached context (the new tokens are cropped again)."""

    @torch.inference_mode()
    def __init__(self, model, context: int):
        self.model = model
        self.vocab = model.config.vocab_size
        self.generator = torch.Generator().manual_seed(0)
        self.cache = DynamicCache(config=model.config)
        prefix = torch.randint(0, self.vocab, (1, context), generator=self.generator)
        model(input_ids=prefix, past_key_values=self.cache, use_cache=True)

    @torch.inference_mode()
    def once_ms(self, new_tokens: int) -> float:
        tokens = torch.randint(0, self.vocab, (1, new_tokens), generator=self.generator)
        start = time.perf_counter()
        self.model(input_ids=tokens, past_key_values=self.cache, use_cache=True)
        elapsed = time.perf_counter() - start
        self.cache.crop(-new_tokens)
        return elapsed * 1000


MAX_NUM_TOKENS = 64  # the target engine's row budget, over which ``auto`` compares the kernels


def load_model(model_dir: str, dtype: str, scheme: str, dense_rows: int | None = None, kernel: str = "auto"):
    """The model as the engine loads it: ``dtype`` weights, linear layers quantized
    by ``scheme`` (the original weights above ``dense_rows`` rows; None: where they
    measure faster, as the engine chooses), the float ones on ``kernel``; returns
    (model, the kernel kept)."""
    from cpu_engine.engine import DTYPES
    from cpu_engine.packed import choose_linear_kernel
    from cpu_engine.quantize import DENSE_ROWS, choose_dense_rows, quantize_linear_layers

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    quantize_linear_layers(model, scheme, dense_rows=DENSE_ROWS if dense_rows is None else dense_rows)
    if dense_rows is None:
        choose_dense_rows(model, MAX_NUM_TOKENS)
    return model, choose_linear_kernel(model, MAX_NUM_TOKENS, kernel)


def forward_ms(model, context: int, new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` time of one forward over ``new_tokens`` after ``context`` cached tokens."""
    timer = ForwardTimer(model, context)
    return min(timer.once_ms(new_tokens) for _ in range(repeats))


def _dense_rows(text: str) -> int | None:
    if text == "auto":
        return None
    rows = int(text)
    if rows < 0:
        raise argparse.ArgumentTypeError(f"--dense-rows must be auto or >= 0, got {text}")
    return rows


def main(argv: list[str] | None = None) -> None:
    from cpu_engine.engine import cpu_has_native_bf16
    from cpu_engine.packed import KERNELS
    from cpu_engine.quantize import check_scheme

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", action="append", required=True, help="Hugging Face model dir (repeatable)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="1,2,4,6,8")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weight-quantization", default="none",
                        help="comma-separated schemes: none, int8, int4 (default none)")
    parser.add_argument("--dense-rows", type=_dense_rows, default=None,
                        help="quantized layers use the original weights above this many rows (0: always the "
                             "quantized kernels; default auto: where they measure faster, as the engine chooses)")
    parser.add_argument("--interleave", action="store_true",
                        help="load every variant at once and time them in turn each repeat, so a busy machine "
                             "slows all of them alike (needs the memory of all of them)")
    parser.add_argument("--linear-kernels", default="auto",
                        help=f"comma-separated kernels of the float linear layers: {', '.join(KERNELS)} (default auto)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.tokens.split(",")]
    schemes = [check_scheme(s) for s in args.weight_quantization.split(",")]
    kernels = args.linear_kernels.split(",")
    if unknown := [k for k in kernels if k not in KERNELS]:
        parser.error(f"--linear-kernels: unknown {', '.join(unknown)} (one of {', '.join(KERNELS)})")
    variants = [(d, t, s, k) for d in args.model_dir for t in args.dtypes.split(",") for s in schemes for k in kernels]
    print(f"# forward time in ms, {args.threads} threads, {args.context}-token cached context, best of {args.repeats}"
          f"{' (interleaved)' if args.interleave else ''}; native bfloat16: "
          f"{'yes' if cpu_has_native_bf16() else 'no'} (dtype auto picks "
          f"{'bfloat16' if cpu_has_native_bf16() else 'float32'})")
    print("| model | dtype | weights | linear kernel | " + " | ".join(f"{n} tok" for n in counts)
          + f" | {counts[-1]} tok / {counts[0]} tok |")
    print("|---|---|---|---|" + "---|" * (len(counts) + 1))
    kept = {}

    def load(model_dir, dtype, scheme, kernel):
        model, kept[(model_dir, dtype, scheme, kernel)] = load_model(model_dir, dtype, scheme, args.dense_rows, kernel)
        return ForwardTimer(model, args.context)

    def report(variant, times):
        model_dir, dtype, scheme, kernel = variant
        name = model_dir.rstrip("/").rsplit("/", 1)[-1]
        cells = " | ".join(f"{t:.1f}" for t in times)
        kernel = kept[variant] if kernel == kept[variant] else f"{kept[variant]} ({kernel})"
        print(f"| {name} | {dtype} | {scheme} | {kernel} | {cells} | {times[-1] / times[0]:.2f}x |", flush=True)

    if args.interleave:
        timers = [load(*variant) for variant in variants]
        best = [[float("inf")] * len(counts) for _ in variants]
        for _ in range(args.repeats):
            for timer, row in zip(timers, best):
                for i, n in enumerate(counts):
                    row[i] = min(row[i], timer.once_ms(n))
        for variant, row in zip(variants, best):
            report(variant, row)
        return
    for variant in variants:
        timer = load(*variant)
        report(variant, [min(timer.once_ms(n) for _ in range(args.repeats)) for n in counts])
        del timer


if __name__ == "__main__":
    main()
