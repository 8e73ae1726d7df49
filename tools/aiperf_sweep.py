"""``specdec-aiperf``: NVIDIA AIPerf against a running server, speculation on and off.

For each endpoint (``template``: Triton's generate extension,
``/v2/models/coordinator/generate_stream``; ``chat`` and ``completions``: the
OpenAI-compatible frontend), each concurrency and each speculation mode (on:
the server's default; off: ``speculation_window`` 0 in every request), one
``aiperf profile`` runs into its own artifact directory; then AIPerf's own
JSON exports are read into one side-by-side table (``tools/aiperf_table.py``),
written as markdown and JSON. Exit status 1 if any run had errors.

AIPerf is run as an executable (``--aiperf``, by default the one of
``.venv-aiperf`` that ``make aiperf`` installs) and never imported: its pins
conflict with this project's, so it lives in its own virtualenv.

Every run gets its own seed, so its synthetic prompts are new to the engines'
KV-cache pools: with one seed for all, the second mode at a concurrency would
find every prompt's prefill cached by the first and its TTFT would look better
than it is.

A server with an API key: put it in ``SPECDEC_API_KEY``. AIPerf takes it on
its command line only (Triton's header, or OpenAI's Bearer token), so while a
run lasts other users of the machine can read it in the process list; the
sweep's report and log show it redacted, as AIPerf's exports do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from coordinator.request.access import API_KEY_HEADER, api_key_from_env
from tools.aiperf_table import MODES, Run, build_rows, has_errors, markdown

REPO = Path(__file__).resolve().parents[1]
DEFAULT_AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
EXPORT_NAME = "profile_export_aiperf.json"
ENDPOINTS = ("template", "chat", "completions")
TEMPLATE_PATH = "/v2/models/coordinator/generate_stream"
# Triton's generate extension takes the coordinator's inputs by name and streams
# SSE events whose text is in ``text_output``; the last one carries the statistics.
PAYLOAD_TEMPLATE = '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": true}'
EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class SweepError(RuntimeError):
    """The sweep cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class Settings:
    """What every run of a sweep shares."""

    triton_url: str
    openai_url: str
    model: str  # the model name AIPerf sends and reports (OpenAI requests carry it)
    tokenizer: str
    requests: int
    input_tokens: int
    output_tokens: int
    request_timeout: float


@dataclass(frozen=True)
class Plan:
    """One ``aiperf profile`` to run."""

    endpoint: str
    concurrency: int
    mode: str
    seed: int
    artifact_dir: Path

    @property
    def name(self) -> str:
        return self.artifact_dir.name


def plan_runs(endpoints, concurrencies, modes, out_dir: Path, base_seed: int) -> list[Plan]:
    """Every run, in order: endpoint by endpoint, then concurrency, the modes
    back to back at each (so on and off meet the same state of the machine)."""
    plans = []
    for endpoint in endpoints:
        for concurrency in concurrencies:
            for mode in modes:
                name = f"{endpoint}-c{concurrency}-{mode}"
                plans.append(Plan(endpoint, concurrency, mode, base_seed + len(plans), out_dir / name))
    return plans


def extra_inputs(endpoint: str, mode: str) -> dict:
    """What AIPerf adds to every request body: the template endpoint's payload
    and response field, and ``speculation_window`` 0 with speculation off."""
    extra = {}
    if endpoint == "template":
        extra = {"payload_template": PAYLOAD_TEMPLATE, "response_field": "text_output"}
    if mode == "off":
        extra["speculation_window"] = 0
    return extra


def openai_base(url: str) -> str:
    """AIPerf appends ``/v1/chat/completions`` itself; OpenAI clients take the URL with ``/v1``: both work."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


REDACTED = "<redacted>"


def key_args(endpoint: str, api_key: str | None) -> list[str]:
    """The arguments that give AIPerf the server's API key (SPECDEC_API_KEY):
    Triton's header for its generate endpoint, OpenAI's Bearer token for the
    frontend. AIPerf takes them on its command line only (it redacts them in
    its exports); they are kept out of the sweep's own report and log."""
    if api_key is None:
        return []
    if endpoint == "template":
        return ["--header", f"{API_KEY_HEADER}:{api_key}"]
    return ["--api-key", api_key]


def redacted(args: list[str], api_key: str | None) -> list[str]:
    return [arg.replace(api_key, REDACTED) for arg in args] if api_key else list(args)


def aiperf_command(aiperf: str, plan: Plan, settings: Settings, extra_args=()) -> list[str]:
    """The ``aiperf profile`` command line of one run."""
    command = [aiperf, "profile", "--model", settings.model, "--endpoint-type", plan.endpoint, "--streaming"]
    if plan.endpoint == "template":
        command += ["--url", settings.triton_url, "--endpoint", TEMPLATE_PATH]
    else:
        command += ["--url", openai_base(settings.openai_url)]
    extra = extra_inputs(plan.endpoint, plan.mode)
    if extra:
        # The JSON form: the key:value form splits its value at commas (a template has them).
        command += ["--extra-inputs", json.dumps(extra)]
    command += [
        "--tokenizer", settings.tokenizer,
        "--concurrency", str(plan.concurrency),
        "--request-count", str(settings.requests),
        "--num-dataset-entries", str(settings.requests),
        "--prompt-input-tokens-mean", str(settings.input_tokens), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(settings.output_tokens), "--prompt-output-tokens-stddev", "0",
        "--random-seed", str(plan.seed),
        "--request-timeout-seconds", f"{settings.request_timeout:g}",
        "--output-artifact-dir", str(plan.artifact_dir),
        "--no-gpu-telemetry",  # no GPU on the cpu profile; pass --gpu-telemetry after -- for the trtllm one
        "--ui-type", "none",
    ]
    if "--server-metrics" not in extra_args:
        # AIPerf looks for them at the endpoint's URL + /metrics; Triton serves them on
        # its own port (after --: --server-metrics http://HOST:8002/metrics).
        command.append("--no-server-metrics")
    return command + list(extra_args)


def _last_words(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def execute(plan: Plan, command: list[str], timeout: float) -> Run:
    """Run one ``aiperf profile`` (its output in ``aiperf.out`` of its artifact
    directory) and read its JSON export."""
    if plan.artifact_dir.exists():
        shutil.rmtree(plan.artifact_dir)  # an earlier sweep's export must not pass for this run's
    plan.artifact_dir.mkdir(parents=True)
    log = plan.artifact_dir / "aiperf.out"
    with open(log, "w") as output:
        # Its own session, so that a run past the timeout is stopped with all of
        # AIPerf's service processes, not only the first.
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = None
    export_path = plan.artifact_dir / EXPORT_NAME
    export = json.loads(export_path.read_text()) if export_path.is_file() else None
    if status is None:
        failure = f"aiperf ran past --run-timeout {timeout:g} s and was stopped"
    elif status != 0:
        failure = f"aiperf exited with status {status}"  # e.g. every request failed: no export
    elif export is None:
        failure = f"aiperf wrote no {EXPORT_NAME}"
    else:
        failure = ""  # a clean run: the export counts its errors, if any
    if failure:
        failure += f" (output: {log}):\n{_last_words(log)}"
    return Run(plan.endpoint, plan.concurrency, plan.mode, export, failure)


def default_tokenizer() -> Path:
    """The target model's directory that ``make serve`` prepared (it holds the tokenizer)."""
    from launcher.assets import DEFAULT_TARGET, default_cache_dir

    return default_cache_dir() / "models" / DEFAULT_TARGET


def parse_list(text: str, allowed=None, kind=str) -> list:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    try:
        values = [kind(item) for item in items]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    for value in values:
        if allowed is not None and value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(map(str, allowed))}")
        if kind is int and value < 1:
            raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="specdec-aiperf", description=__doc__.split("\n\n")[1],
        epilog="Arguments after -- go to every `aiperf profile` as they are, e.g. -- --warmup-request-count 1.")
    parser.add_argument("--aiperf", default=os.environ.get("SPECDEC_AIPERF", str(DEFAULT_AIPERF)),
                        help="the aiperf executable (env SPECDEC_AIPERF; default: %(default)s, from `make aiperf`)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Triton's HTTP endpoint (%(default)s)")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000",
                        help="the OpenAI-compatible frontend, for chat and completions (%(default)s)")
    parser.add_argument("--endpoints", type=lambda text: parse_list(text, ENDPOINTS), default=list(ENDPOINTS),
                        help="comma-separated, of " + ", ".join(ENDPOINTS) + " (default: all)")
    parser.add_argument("--concurrency", type=lambda text: parse_list(text, kind=int), default=[1, 2, 4],
                        help="comma-separated concurrencies (default: 1,2,4)")
    parser.add_argument("--modes", type=lambda text: parse_list(text, MODES), default=list(MODES),
                        help="speculation modes: on, off or on,off (default)")
    parser.add_argument("--requests", type=int, default=8, help="requests per run (default: %(default)s)")
    parser.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt tokens (%(default)s)")
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request (%(default)s)")
    parser.add_argument("--model", default="coordinator",
                        help="the model name in requests and AIPerf's report (%(default)s)")
    parser.add_argument("--tokenizer", default=None,
                        help="a local tokenizer directory (default: the target model that `make serve` prepared)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the first run; each next run adds 1")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per request (%(default)s)")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds per aiperf run (%(default)s)")
    parser.add_argument("--out", type=Path, default=Path("reports/aiperf"),
                        help="directory for the runs' artifacts and the table (%(default)s)")
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = argv, []
    if "--" in argv:
        own, passthrough = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    options = parser.parse_args(own)
    options.aiperf_args = passthrough
    options.argv = argv
    if options.requests < 1 or options.input_tokens < 1 or options.output_tokens < 1:
        parser.error("--requests, --input-tokens and --output-tokens must be at least 1")
    return options


def check_setup(options) -> None:
    if not Path(options.aiperf).is_file():
        raise SweepError(f"no aiperf executable at {options.aiperf}: run `make aiperf` (it creates .venv-aiperf "
                         "from requirements/aiperf.txt) or pass --aiperf")
    tokenizer = Path(options.tokenizer) if options.tokenizer else default_tokenizer()
    if not (tokenizer / "tokenizer.json").is_file():
        raise SweepError(f"no tokenizer.json in {tokenizer}: pass --tokenizer with a local tokenizer directory "
                         "(AIPerf needs one to count tokens; `make serve` prepares the target model's)")
    options.tokenizer = str(tokenizer.resolve())


def sweep(options) -> tuple[list[Run], list[dict]]:
    """Every planned run, one after the other; returns the runs and what was run."""
    settings = Settings(options.url, options.openai_url, options.model, options.tokenizer, options.requests,
                        options.input_tokens, options.output_tokens, options.request_timeout)
    plans = plan_runs(options.endpoints, options.concurrency, options.modes, options.out.resolve(), options.seed)
    runs, log = [], []
    api_key = api_key_from_env()
    for index, plan in enumerate(plans, 1):
        command = aiperf_command(options.aiperf, plan, settings, options.aiperf_args) + key_args(plan.endpoint, api_key)
        print(f"specdec-aiperf: [{index}/{len(plans)}] {plan.name}: {options.requests} requests ...", flush=True)
        started = time.monotonic()
        run = execute(plan, command, options.run_timeout)
        seconds = time.monotonic() - started
        errors = "failed" if run.export is None else int((run.export.get("error_request_count") or {}).get("avg", 0))
        print(f"specdec-aiperf: [{index}/{len(plans)}] {plan.name}: {seconds:.0f} s, errors: {errors}", flush=True)
        if run.failure:
            print(run.failure, file=sys.stderr, flush=True)
        runs.append(run)
        log.append({**asdict(plan), "artifact_dir": str(plan.artifact_dir), "seconds": round(seconds, 1),
                    "command": shlex.join(redacted(command, api_key)), "failure": run.failure})
    return runs, log


def report(options, rows: list[dict], log: list[dict]) -> dict:
    return {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "settings": {key: options.__dict__[key] for key in (
            "url", "openai_url", "endpoints", "concurrency", "modes", "requests", "input_tokens", "output_tokens",
            "model", "tokenizer", "seed", "aiperf_args")},
        "command": shlex.join(["specdec-aiperf", *options.argv]),
        "rows": rows,
        "runs": log,
        "errors": has_errors(rows),
    }


def main(argv=None) -> int:
    options = parse_args(argv)
    try:
        check_setup(options)
    except SweepError as error:
        print(f"specdec-aiperf: {error}", file=sys.stderr)
        return EXIT_USAGE
    options.out.mkdir(parents=True, exist_ok=True)
    runs, log = sweep(options)
    rows = build_rows(runs)
    table = markdown(rows)
    result = report(options, rows, log)
    (options.out / "aiperf_sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    (options.out / "aiperf_sweep.md").write_text(table)
    print(table, flush=True)
    print(f"specdec-aiperf: table in {options.out / 'aiperf_sweep.md'}, JSON in {options.out / 'aiperf_sweep.json'}",
          flush=True)
    if result["errors"]:
        print("specdec-aiperf: some runs had errors (see the table and each run's aiperf.out)", file=sys.stderr)
        return EXIT_ERRORS
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
