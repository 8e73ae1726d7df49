"""What the load test sends and how it is paced, without locust or gevent
(importable anywhere, tested in-process): options, prompts, phases, the
address, the contract checks on a final response."""

from __future__ import annotations


from loadtests.grpc_stream import RequestFailed, Timing
from tools.prompts import file_prompts, humaneval_prompts

# Options added to locust's command line. Each also reads an environment
# variable, LOCUST_ + the name in capitals (e.g. LOCUST_STEPS), like locust's
# own options: the Kubernetes manifests in k8s/loadtest set them from a ConfigMap.
OPTIONS = [
    ("--prompts-file", dict(default="", help="your prompts: .jsonl (per line a JSON string, or an object with "
                                             "'prompt' and optional 'id'), .json (a list of those) or any other "
                                             "file: one prompt per line. Default: HumanEval problems --humaneval")),
    ("--humaneval", dict(default="0-99", help="HumanEval problem range FIRST-LAST (default 0-99)")),
    ("--max-tokens", dict(default="64", help="max_tokens, or a comma list to draw from per request (default 64)")),
    ("--temperature", dict(default="0", help="temperature, or a comma list to draw from (default 0: greedy)")),
    ("--spec-window", dict(default="", help="speculation_window of speculative requests "
                                            "(default: not sent, the server's own)")),
    ("--adaptive-window", dict(choices=("", "true", "false"), default="",
                               help="adaptive_window of speculative requests: true (the cost model picks each round's "
                                    "window), false (always the full window); default: not sent, the server's own")),
    ("--stream-ratio", dict(type=float, default=1.0, help="share of requests sent with stream=true (default 1); "
                                                          "the others get one response and report no ttft/itl")),
    ("--request-timeout", dict(type=float, default=300.0, help="seconds to the final response (default 300)")),
    ("--think-time", dict(type=float, default=0.0, help="pause between a user's requests, s (default 0)")),
    ("--steps", dict(default="1,2,4", help="concurrent users of each step (default 1,2,4)")),
    ("--modes", dict(default="on,off", help="phases of each step, in order: on, off or mix (default on,off)")),
    ("--step-seconds", dict(type=float, default=120.0, help="duration of each phase, s (default 120)")),
    ("--prompt-order", dict(choices=("sequential", "random"), default="sequential",
                            help="sequential (default): every phase of a mode walks the prompts from the first, so "
                                 "speculation on and off get the same prompts; random: drawn with --seed")),
    ("--seed", dict(type=int, default=0, help="seed of the random draws (default 0)")),
    ("--report-prefix", dict(default="", help="prefix of the specdec report files (default: the --csv prefix; "
                                              "without either the table is only printed)")),
    ("--skip-ready-check", dict(action="store_true", default=False,
                                help="start even if the server does not report the coordinator ready")),
]

MODES = ("on", "off", "mix")  # phase kinds: speculation on, off, or both at once


def env_name(flag: str) -> str:
    return "LOCUST_" + flag.lstrip("-").upper().replace("-", "_")


def numbers(text, kind) -> list:
    """``64`` or ``32,64,128`` -> a list to draw from."""
    values = [kind(v) for v in str(text).split(",") if v.strip()]
    if not values:
        raise ValueError(f"expected a number or a comma list, got {text!r}")
    return values


def humaneval_range(text: str) -> tuple[int, int]:
    first, _, last = str(text).partition("-")
    first_number, last_number = int(first), int(last or first)
    if not 0 <= first_number <= last_number <= 163:
        raise ValueError(f"--humaneval takes FIRST-LAST within 0-163, got {text!r}")
    return first_number, last_number


def load_prompts(prompts_file: str = "", humaneval: str = "0-99") -> list[tuple[str, str]]:
    """(id, prompt) pairs from ``prompts_file`` (tools/prompts.py's formats), else the HumanEval range."""
    if not prompts_file:
        return humaneval_prompts(*humaneval_range(humaneval))
    return file_prompts(prompts_file)


def build_phases(steps: str, modes: str) -> list[tuple[int, str]]:
    """``1,2,4`` x ``on,off`` -> [(1, on), (1, off), (2, on), ...]."""
    users = numbers(steps, int)
    kinds = [m.strip() for m in str(modes).split(",") if m.strip()]
    if not kinds or any(m not in MODES for m in kinds):
        raise ValueError(f"--modes takes on, off and mix; got {modes!r}")
    if any(u < 1 for u in users):
        raise ValueError(f"--steps takes positive user counts, got {steps!r}")
    return [(u, m) for u in users for m in kinds]


def grpc_url(host: str | None) -> str:
    """locust's --host as a gRPC address: ``host:port``, optionally with grpc://."""
    if not host:
        raise ValueError("no --host: give the server's gRPC address, e.g. --host 127.0.0.1:8001")
    for scheme in ("grpc://", "http://"):
        if host.startswith(scheme):
            host = host[len(scheme):]
    return host.rstrip("/")


def request_name(label: str, stream: bool) -> str:
    """The locust event name: ``spec`` / ``plain``, marked when not streaming."""
    return label if stream else f"{label}, stream=false"


def check_statistics(timing: Timing, max_tokens: int, speculation: bool) -> None:
    """A final response whose statistics break the contract is a failure."""
    problem = timing.problem(max_tokens, speculation)
    if problem is not None:
        raise RequestFailed("bad statistics", problem)
