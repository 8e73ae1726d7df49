"""``python -m frontend.overhead``: what the OpenAI frontend adds per token.

Sends the same greedy HumanEval prompts to the coordinator over gRPC directly
and through the OpenAI API (streamed ``/v1/completions``), per prompt an
uncounted warm-up (so every measured request meets a warm prefix cache) and
then gRPC, OpenAI, OpenAI, gRPC (drift within a prompt cancels), and reports
seconds per generated token on each path, their ratio over all requests and
the median of the per-prompt ratios (robust to a neighbour's load spike).
Greedy text must be identical on both paths; a difference is reported.

Wall-clock ratios on a shared machine are noisy; with ``--frontend-pid`` (a
frontend serving only this run) it also reports the frontend's own CPU time
per streamed token, read from /proc, which the neighbours' load cannot inflate."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from coordinator.request.access import api_key_from_env


@dataclass
class Timing:
    seconds: float
    first_chunk: float
    tokens: int
    text: str


def read_sse(lines) -> list[dict]:
    """The JSON payloads of an SSE stream's ``data:`` lines, up to ``[DONE]``."""
    events = []
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):].strip()
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events


class OpenAIPath:
    """Streamed completions, a connection each (uvicorn closes one idle for 5 s,
    and the gRPC request in between takes longer)."""

    def __init__(self, base_url: str, timeout: float):
        parts = urlsplit(base_url)
        self.host, self.port, self.prefix = parts.hostname, parts.port or 80, parts.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        api_key = api_key_from_env()  # the gRPC path sends it too (tools.stream)
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def complete(self, prompt: str, max_tokens: int) -> Timing:
        body = json.dumps({"model": "coordinator", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        start = time.perf_counter()
        connection.request("POST", f"{self.prefix}/completions", body, self.headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"OpenAI API answered {response.status}: {response.read().decode(errors='replace')}")
        text, first, tokens = [], None, 0
        for raw in response:
            for event in read_sse([raw]):
                if "error" in event:
                    raise RuntimeError(f"OpenAI API stream failed: {event['error']['message']}")
                for choice in event.get("choices", []):
                    if choice.get("text") and first is None:
                        first = time.perf_counter() - start
                    text.append(choice.get("text", ""))
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        seconds = time.perf_counter() - start
        connection.close()
        return Timing(seconds, first if first is not None else seconds, tokens, "".join(text))


class GrpcPath:
    """Streamed completions from the coordinator over one gRPC client."""

    def __init__(self, url: str, timeout: float):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.timeout = timeout

    def complete(self, prompt: str, max_tokens: int) -> Timing:
        from tools.client import build_inputs, stream_completion

        completion = stream_completion(self.client, build_inputs(prompt, max_tokens, temperature=0.0),
                                       timeout=self.timeout)
        return Timing(completion.seconds, completion.time_to_first_chunk or completion.seconds,
                      completion.completion_tokens, completion.text)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_token(timings: list[Timing]) -> float:
    return sum(t.seconds for t in timings) / max(1, sum(t.tokens for t in timings))


def summary(grpc: list[Timing], openai: list[Timing], per_prompt: int = 1) -> dict:
    """Seconds per token on each path (all requests together), their ratio, the
    median of the per-prompt ratios (``per_prompt`` requests per path and
    prompt, in order), and the median time to the first chunk."""
    grpc_token, openai_token = per_token(grpc), per_token(openai)
    prompts = range(0, len(grpc), per_prompt)
    ratios = [per_token(openai[i:i + per_prompt]) / per_token(grpc[i:i + per_prompt]) for i in prompts]
    return {
        "requests": len(grpc),
        "grpc_ms_per_token": 1000 * grpc_token,
        "openai_ms_per_token": 1000 * openai_token,
        "ratio": openai_token / grpc_token if grpc_token else float("nan"),
        "median_prompt_ratio": statistics.median(ratios),
        "added_ms_per_token": 1000 * (openai_token - grpc_token),
        "grpc_first_chunk_ms": 1000 * statistics.median(t.first_chunk for t in grpc),
        "openai_first_chunk_ms": 1000 * statistics.median(t.first_chunk for t in openai),
        "different_texts": sum(t.text != grpc[i - i % per_prompt].text for i, t in enumerate(openai)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000/v1")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval problems 0..N-1 (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--frontend-pid", type=int, default=None,
                        help="process id of the frontend behind --openai-url (serving only this run): "
                             "report its CPU time per streamed token")
    args = parser.parse_args(argv)
    from tools.prompts import humaneval_prompts

    paths = {"grpc": GrpcPath(args.grpc_url, args.timeout), "openai": OpenAIPath(args.openai_url, args.timeout)}
    cpu_before = cpu_seconds(args.frontend_pid) if args.frontend_pid else 0.0
    timings: dict[str, list[Timing]] = {"grpc": [], "openai": []}
    print(f"{'prompt':<14}{'path':<8}{'seconds':>9}{'tokens':>8}{'ms/token':>10}{'first chunk ms':>16}", flush=True)
    for task, prompt in humaneval_prompts(0, args.prompts - 1):
        paths["grpc"].complete(prompt, args.max_tokens)  # warm-up: the prompt's prefix cached for all four
        for name in ("grpc", "openai", "openai", "grpc"):
            timing = paths[name].complete(prompt, args.max_tokens)
            timings[name].append(timing)
            print(f"{task:<14}{name:<8}{timing.seconds:>9.2f}{timing.tokens:>8}"
                  f"{1000 * timing.seconds / max(1, timing.tokens):>10.1f}{1000 * timing.first_chunk:>16.0f}",
                  flush=True)
    result = summary(timings["grpc"], timings["openai"], per_prompt=2)
    print(f"\n{args.prompts} prompts x 2 requests per path x {args.max_tokens} tokens: gRPC "
          f"{result['grpc_ms_per_token']:.1f} ms/token, OpenAI API {result['openai_ms_per_token']:.1f} ms/token, "
          f"ratio {result['ratio']:.3f} ({result['added_ms_per_token']:+.1f} ms/token), median per-prompt ratio "
          f"{result['median_prompt_ratio']:.3f}; median first chunk gRPC "
          f"{result['grpc_first_chunk_ms']:.0f} ms, OpenAI API {result['openai_first_chunk_ms']:.0f} ms; "
          f"{result['different_texts']} different texts")
    if args.frontend_pid:
        streamed = sum(t.tokens for t in timings["openai"])
        cpu = cpu_seconds(args.frontend_pid) - cpu_before
        print(f"frontend CPU: {1000 * cpu:.0f} ms for {streamed} streamed tokens = "
              f"{1000 * cpu / max(1, streamed):.2f} ms/token")
    return 1 if result["different_texts"] else 0


if __name__ == "__main__":
    sys.exit(main())
