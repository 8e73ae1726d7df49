"""``specdec-client``: stream a completion from the coordinator over gRPC and
print tokens/s and the acceptance rate at the end."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from coordinator.request.api import Statistics
from coordinator.drafters import registry
from tools.stream import responses



@dataclass
class Completion(Statistics):
    """One completion as the client saw it: the text, its timing, and the server's statistics."""

    text: str = ""
    chunks: int = 0
    seconds: float = 0.0
    time_to_first_chunk: float | None = None
    deltas: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def build_inputs(prompt: str, max_tokens: int, *, speculation_window: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop_words: list[str] | None = None, stream: bool = True, adaptive_window: bool | None = None,
                 draft_temperature: float | None = None, drafter: str | None = None) -> list[grpcclient.InferInput]:
    arrays: dict[str, np.ndarray] = {
        "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
        "max_tokens": np.array([max_tokens], dtype=np.int32),
        "stream": np.array([stream], dtype=bool),
    }
    if speculation_window is not None:
        arrays["speculation_window"] = np.array([speculation_window], dtype=np.int32)
    if adaptive_window is not None:
        arrays["adaptive_window"] = np.array([adaptive_window], dtype=bool)
    if draft_temperature is not None:
        arrays["draft_temperature"] = np.array([draft_temperature], dtype=np.float32)
    if temperature is not None:
        arrays["temperature"] = np.array([temperature], dtype=np.float32)
    if top_k is not None:
        arrays["top_k"] = np.array([top_k], dtype=np.int32)
    if top_p is not None:
        arrays["top_p"] = np.array([top_p], dtype=np.float32)
    if seed is not None:
        arrays["random_seed"] = np.array([seed], dtype=np.uint64)
    if drafter is not None:
        arrays["drafter"] = np.array([drafter.encode("utf-8")], dtype=np.object_)
    if stop_words:
        arrays["stop_words"] = np.array([w.encode("utf-8") for w in stop_words], dtype=np.object_)
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _triton_dtype(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _triton_dtype(array: np.ndarray) -> str:
    return {np.object_: "BYTES", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64", np.bool_: "BOOL"}[
        array.dtype.type
    ]


def stream_completion(client: grpcclient.InferenceServerClient, inputs, on_delta=None, timeout: float = 600.0,
                      request_id: str = "", headers=None) -> Completion:
    """Send one streaming request and collect its responses until the final one
    (raises tools.stream.RequestFailed, an InferenceServerException). ``headers``:
    gRPC metadata; None: the API key in SPECDEC_API_KEY, if any (tools.stream.responses)."""
    completion = Completion()
    for arrived, delta, result in responses(client, inputs, timeout=timeout, request_id=request_id, headers=headers):
        if delta:
            if completion.time_to_first_chunk is None:
                completion.time_to_first_chunk = arrived
            completion.chunks += 1
            completion.deltas.append(delta)
            completion.text += delta
            if on_delta:
                on_delta(delta)
        completion.read(result.as_numpy)  # the statistics, on the final response
        completion.seconds = arrived
    return completion


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec-client", description="Stream a completion from the coordinator.",
        epilog="A server with an API key: put it in SPECDEC_API_KEY (read from the environment only).")
    parser.add_argument("prompt", help="prompt text ('-' reads standard input)")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default localhost:8001)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speculation-window", type=int, default=None,
                        help="cap on drafted tokens per round; 0 = plain target decoding (default: server's)")
    parser.add_argument("--temperature", type=float, default=None, help="0 (default) = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop word (repeatable)")
    parser.add_argument("--drafter", choices=registry.names(), default=None, help="who drafts (default: the server's)")
    args = parser.parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    inputs = build_inputs(prompt, args.max_tokens, speculation_window=args.speculation_window,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop_words=args.stop, drafter=args.drafter)
    try:
        with grpcclient.InferenceServerClient(args.url) as client:
            completion = stream_completion(client, inputs, on_delta=lambda d: print(d, end="", flush=True))
    except InferenceServerException as error:  # RequestFailed included: error responses, timeouts, RPC errors
        print(f"\nspecdec-client: {error.message()}", file=sys.stderr)
        return 1
    print(flush=True)  # end the completion's line on stdout
    print(
        f"[{completion.completion_tokens} tokens in {completion.seconds:.2f} s = {completion.tokens_per_second:.2f} tok/s; "
        f"first text after {completion.time_to_first_chunk or 0:.2f} s; acceptance {completion.acceptance_rate:.2f} "
        f"({completion.accepted_draft_tokens}/{completion.draft_tokens} drafted tokens accepted)]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
