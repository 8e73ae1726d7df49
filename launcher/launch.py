"""``specdec-serve``: prepare the model pair and run a real tritonserver with
the cpu profile in the foreground (README command 1)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import shlex
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import coordinator
from cpu_engine.turns import TURNS_VARIABLE
from launcher import assets, engine_watchdog, openai_frontend, profiles, shm_regions, tritonserver
from selfheal import exposition, readiness, stubs
from coordinator.request.access import (API_KEY_FILE_VAR, API_KEY_HEADER, API_KEY_VAR, GRPC_API_KEY_HEADER, ApiKeyError,
                                        server_api_key)
from selfheal.triton_admin import ADMIN_KEY_HEADER, ADMIN_KEY_VAR
from launcher.pair import TokenizerMismatch, prepare_pair_tokenizer

PROJECT_ROOT = Path(coordinator.__file__).resolve().parent.parent

# Triton APIs that answer only requests carrying the header ADMIN_KEY_HEADER with
# the admin key, on HTTP and gRPC alike. Health and metadata stay open;
# inference needs the API key (INFERENCE_APIS). The same list is in
# docker/trtllm-entrypoint.sh (tests/unit/test_security_config.py).
RESTRICTED_APIS = ("model-repository", "model-config", "shared-memory", "statistics", "trace", "logging")
# Every model loads at start-up; explicit control lets the engine watchdog
# (selfheal/) reload an engine whose process died. Loading and unloading are
# model-repository calls, so they too need the admin key.
MODEL_CONTROL_ARGS = ("--model-control-mode=explicit", "--load-model=*")
# Triton's gRPC endpoint expects the header with this prefix (gRPC metadata key).
GRPC_ADMIN_KEY_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER
# With an API key (SPECDEC_API_KEY), Triton's inference category answers only
# requests carrying it in API_KEY_HEADER (coordinator/request/access.py), on
# HTTP (infer, generate, generate_stream) and gRPC alike; the OpenAI frontend
# asks its clients for the same key. Health and metadata stay open (probes).
INFERENCE_APIS = ("inference",)
# The longest the launcher waits for the coordinator's first request (its engines timed, one token).
FIRST_REQUEST_SECONDS = 300.0
# Without an API key, listening beyond loopback needs this set to 1: inference
# is then open to everyone who can reach the ports (an authenticating gateway
# in front, for example).
ALLOW_OPEN_INFERENCE_VAR = "SPECDEC_ALLOW_OPEN_INFERENCE"
# Defaults for the model processes' CPU runtime (measurements in the README):
ENGINE_ENV_DEFAULTS = {
    # oneDNN (torch's CPU kernels) keeps a compiled primitive per matrix shape,
    # up to 1024 by default; when any prompt length made new shapes, the
    # engines' resident memory crept up by megabytes per request ("Soak").
    # The target's kernel calls now carry one measured block of rows at most
    # (cpu_engine/row_blocks.py), so its shapes are few, but more than 16: a
    # cache of 16 re-created primitives inside every prefill (a 243-token
    # prompt's first token 1.45-1.54 s against 1.19-1.23 s with 64 or 256 on a
    # 2-vCPU Intel Xeon with AMX). 256 holds them and still bounds the memory.
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
    # target and draft are two processes with their own OpenMP threads on the
    # same cores. Spinning threads (OpenMP's default wait) took the cores from
    # the other engine: 4 concurrent speculative streams got 0.24x the total
    # tokens/s of one stream; sleeping threads: 0.89x ("Load testing").
    "OMP_WAIT_POLICY": "PASSIVE",
    # ... except the target's between the parallel regions of one forward: a
    # short spin (libgomp's GOMP_SPINCOUNT, set in the target's stub only,
    # cpu_engine/threads.py) keeps its workers on the cores. The draft still
    # sleeps at once, so it never spins on a core the target's step needs.
    "SPECDEC_TARGET_GOMP_SPINCOUNT": "100000",
}
_ADMIN_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]{16,256}")


class AdminKeyError(ValueError):
    """A key setting (SPECDEC_ADMIN_KEY, SPECDEC_API_KEY) that cannot be used."""


class OpenInferenceError(ValueError):
    """Inference would be open beyond loopback without anyone having asked for that."""


def new_admin_key() -> str:
    return secrets.token_hex(32)


def check_key(key: str, variable: str) -> str:
    """16-256 characters of [A-Za-z0-9._~+/-]: a key goes into Triton's flag syntax
    (apis:header=key), where ':' ',' '=' or spaces would change its meaning."""
    if not _ADMIN_KEY_PATTERN.fullmatch(key):
        raise AdminKeyError(
            f"{variable} must be 16 to 256 characters of letters, digits and ._~+/- "
            f"(e.g. `openssl rand -hex 32`); got {len(key)} characters"
        )
    return key


def check_admin_key(key: str) -> str:
    return check_key(key, ADMIN_KEY_VAR)


def restricted_api_args(admin_key: str) -> list[str]:
    """tritonserver flags that put RESTRICTED_APIS behind the admin key."""
    setting = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={check_admin_key(admin_key)}"
    return [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]


def inference_api_args(api_key: str | None) -> list[str]:
    """tritonserver flags that put inference behind the API key (none without a key).
    Triton takes a second pair of restricted-API flags for a second category
    and key; each category in one flag only."""
    if api_key is None:
        return []
    setting = f"{','.join(INFERENCE_APIS)}:{API_KEY_HEADER}={check_key(api_key, API_KEY_VAR)}"
    return [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_access(options: ServerOptions) -> None:
    """Refuse settings that would hand out more than their holder asked for:
    an API key equal to the admin key (a client could then load models),
    or inference open beyond loopback without ALLOW_OPEN_INFERENCE_VAR."""
    check_admin_key(options.admin_key)
    if options.api_key is not None:
        check_key(options.api_key, API_KEY_VAR)
        if options.api_key == options.admin_key:
            raise AdminKeyError(f"{API_KEY_VAR} must differ from {ADMIN_KEY_VAR}: every client holds the API key, "
                                "and the admin key opens model loading")
    elif not is_loopback(options.address) and not options.allow_open_inference:
        raise OpenInferenceError(
            f"listening on {options.address} without {API_KEY_VAR} would open inference to everyone who can "
            f"reach the ports: set {API_KEY_VAR} (e.g. `openssl rand -hex 32`; clients send it too), or "
            f"{ALLOW_OPEN_INFERENCE_VAR}=1 (--allow-open-inference) if a gateway in front authenticates callers")


@dataclass
class ServerOptions:
    target: str = assets.DEFAULT_TARGET
    draft: str = assets.DEFAULT_DRAFT
    cache_dir: Path = field(default_factory=assets.default_cache_dir)
    model_repository: Path = PROJECT_ROOT / "model_repository"
    profile: str = "cpu"  # cpu or sim (launcher/profiles.py)
    sim_preset: str = profiles.DEFAULT_PRESET  # the sim profile's latency table (sim_engine/presets.py)
    address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    openai_port: int = openai_frontend.DEFAULT_PORT  # the OpenAI-compatible frontend; 0: not started
    watchdog_port: int = exposition.DEFAULT_PORT  # the engine watchdog's /metrics; 0: none
    log_verbose: int = 0
    triton_args: list[str] = field(default_factory=list)  # appended to tritonserver's command line
    extra_env: dict[str, str] = field(default_factory=dict)
    # Key of the restricted APIs (header specdec-admin-key); a random one per
    # start unless given (SPECDEC_ADMIN_KEY). Never printed or logged.
    admin_key: str = field(default_factory=new_admin_key, repr=False)
    admin_key_from_env: bool = False
    # Key of the inference APIs (Triton's and the OpenAI frontend's); None:
    # inference is open, which check_access allows on loopback addresses or
    # with allow_open_inference only. Never printed or logged.
    api_key: str | None = field(default=None, repr=False)
    allow_open_inference: bool = False
    # Names this server's Python-backend regions in /dev/shm (launcher/shm_regions.py).
    shm_region_prefix: str = field(default_factory=lambda: shm_regions.prefix(os.getpid()))


@dataclass(frozen=True)
class PreparedPair:
    target_dir: Path
    draft_dir: Path
    tokenizer_dir: Path


def prepare(options: ServerOptions) -> PreparedPair:
    """Fetch/convert both models and check they share a tokenizer."""
    options.cache_dir.mkdir(parents=True, exist_ok=True)
    target_dir = assets.prepare_model(options.target, options.cache_dir, "target")
    draft_dir = assets.prepare_model(options.draft, options.cache_dir, "draft")
    tokenizer_dir = prepare_pair_tokenizer(target_dir, draft_dir, options.cache_dir)
    return PreparedPair(target_dir, draft_dir, tokenizer_dir)


def server_command(options: ServerOptions, install: tritonserver.TritonInstall) -> list[str]:
    return [
        str(install.binary),
        f"--model-repository={options.model_repository}",
        f"--model-config-name={options.profile}",
        f"--backend-directory={install.backend_dir}",
        *MODEL_CONTROL_ARGS,
        *restricted_api_args(options.admin_key),
        *inference_api_args(options.api_key),
        "--strict-readiness=true",
        "--exit-on-error=true",
        f"--http-address={options.address}",
        f"--grpc-address={options.address}",
        f"--metrics-address={options.address}",
        f"--http-port={options.http_port}",
        f"--grpc-port={options.grpc_port}",
        f"--metrics-port={options.metrics_port}",
        f"--log-verbose={options.log_verbose}",
        shm_regions.backend_arg(options.shm_region_prefix),
        *options.triton_args,
    ]


def server_environment(options: ServerOptions, pair: PreparedPair, install: tritonserver.TritonInstall) -> dict:
    # The Python backend stub ignores PYTHONPATH; model.py files read SPECDEC_PYTHONPATH.
    paths = [str(PROJECT_ROOT), *site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    env = dict(os.environ)
    env.update(
        {
            "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in (str(install.library_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p
            ),
            "SPECDEC_PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
            "SPECDEC_TARGET_MODEL_DIR": str(pair.target_dir),
            "SPECDEC_DRAFT_MODEL_DIR": str(pair.draft_dir),
            "SPECDEC_TOKENIZER_DIR": str(pair.tokenizer_dir),
            profiles.PRESET_VAR: profiles.absolute(options.sim_preset),  # a table's path, absolute
        }
    )
    for name, value in ENGINE_ENV_DEFAULTS.items():  # a value already in the environment wins
        env.setdefault(name, value)
    env.setdefault(TURNS_VARIABLE, str(forward_turns_path(options)))
    env.update(options.extra_env)
    for secret in (ADMIN_KEY_VAR, API_KEY_VAR):  # the keys go to tritonserver's flags only, never to the models
        env.pop(secret, None)
    return env


def forward_turns_path(options: ServerOptions) -> Path:
    """Where the cpu engines' forwards take turns on the cores (cpu_engine/turns.py).
    One per server: two servers on one machine (different ports) do not wait
    for each other. In the machine's own temporary directory, not the model
    cache, which may be shared between machines. An empty SPECDEC_FORWARD_TURNS
    turns the turns off."""
    return Path(tempfile.gettempdir()) / f"specdec-{os.getuid()}" / f"forward-turns-{options.grpc_port}"


def start(options: ServerOptions, pair: PreparedPair, **popen_kwargs) -> subprocess.Popen:
    install = tritonserver.locate(options.cache_dir)
    return subprocess.Popen(
        server_command(options, install), env=server_environment(options, pair, install), **popen_kwargs
    )


def wait_until_ready(process: subprocess.Popen, options: ServerOptions, timeout: float = 600.0) -> None:
    url = f"{readiness.local_url(options.address, options.http_port)}/v2/health/ready"
    readiness.wait_for(process, url, "tritonserver", timeout)


def send_first_request(options: ServerOptions, timeout: float = FIRST_REQUEST_SECONDS) -> None:
    """The coordinator times its engines before it serves its first request
    (coordinator/policy/startup_profile.py): sent here, one token, so no user's
    request waits for it. A failure is reported; the server still serves."""
    from selfheal.probe import probe

    url = f"{readiness.local_host(options.address)}:{options.grpc_port}"
    answered, why = probe(url, "coordinator", timeout, api_key=options.api_key, coordinator=True)
    if not answered:
        print(f"specdec-serve: the first request (the coordinator times its engines on it) failed: {why}",
              file=sys.stderr, flush=True)


def _parse_args(argv: list[str] | None) -> ServerOptions:
    env = os.environ
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="specdec-serve",
        usage="specdec-serve [options] [-- extra tritonserver arguments]",
        description="Run the speculative-decoding Triton server (cpu profile) in the foreground. "
        "Arguments after -- (and SPECDEC_TRITON_ARGS) are appended to tritonserver's command line.",
    )
    models = ", ".join(assets.BUILTIN_MODELS)
    parser.add_argument("--target", default=env.get("SPECDEC_TARGET", assets.DEFAULT_TARGET),
                        help=f"target model: built-in name ({models}), .gguf file or HF directory [SPECDEC_TARGET]")
    parser.add_argument("--draft", default=env.get("SPECDEC_DRAFT", assets.DEFAULT_DRAFT),
                        help="draft model, same forms as --target [SPECDEC_DRAFT]")
    parser.add_argument("--cache-dir", type=Path, default=assets.default_cache_dir(),
                        help="where downloads and converted models are kept [SPECDEC_CACHE_DIR, ~/.cache/specdec]")
    parser.add_argument("--address", default=env.get("SPECDEC_ADDRESS", "127.0.0.1"),
                        help="address to listen on; 0.0.0.0 in containers [SPECDEC_ADDRESS]")
    parser.add_argument("--http-port", type=int, default=int(env.get("SPECDEC_HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(env.get("SPECDEC_GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(env.get("SPECDEC_METRICS_PORT", 8002)))
    parser.add_argument("--openai-port", type=int,
                        default=int(env.get(openai_frontend.PORT_VAR, openai_frontend.DEFAULT_PORT)),
                        help="port of the OpenAI-compatible API, started next to Triton; 0: none "
                             f"[{openai_frontend.PORT_VAR}, {openai_frontend.DEFAULT_PORT}]")
    parser.add_argument("--watchdog-port", type=int,
                        default=int(env.get(exposition.PORT_VAR, exposition.DEFAULT_PORT)),
                        help="port of the engine watchdog's /metrics; 0: none "
                             f"[{exposition.PORT_VAR}, {exposition.DEFAULT_PORT}; "
                             f"{engine_watchdog.ENABLED_VAR}=0: no watchdog]")
    parser.add_argument("--model-repository", type=Path,
                        default=Path(env.get("SPECDEC_MODEL_REPOSITORY", PROJECT_ROOT / "model_repository")))
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--profile", default=env.get(profiles.PROFILE_VAR, "cpu"),
                        help=f"engines: {' or '.join(profiles.SERVABLE)} (simulated GPU engines, no weights: "
                             f"sim_engine/) [{profiles.PROFILE_VAR}, cpu]")
    parser.add_argument("--sim-preset", default=env.get(profiles.PRESET_VAR, profiles.DEFAULT_PRESET),
                        help=f"the sim profile's step times and acceptance: {', '.join(profiles.PRESETS)}, "
                             "or a timing table of tools/gpu_timing.py, TABLE.json (its first pair) or "
                             f"TABLE.json#PAIR [{profiles.PRESET_VAR}, {profiles.DEFAULT_PRESET}]")
    parser.add_argument("--allow-open-inference", action="store_true",
                        default=env.get(ALLOW_OPEN_INFERENCE_VAR, "") == "1",
                        help=f"serve inference without {API_KEY_VAR} on an address beyond loopback (a gateway in "
                             f"front authenticates callers) [{ALLOW_OPEN_INFERENCE_VAR}=1]")
    parser.epilog = (f"Keys, from the environment only (never flags, which every user can read): {API_KEY_VAR}, "
                     f"the key inference clients send (header {API_KEY_HEADER}, gRPC {GRPC_API_KEY_HEADER}, "
                     f"OpenAI 'Authorization: Bearer'), or {API_KEY_FILE_VAR}, a file holding it (a mounted "
                     f"Secret); unset: inference is open, allowed on loopback only "
                     f"unless --allow-open-inference. {ADMIN_KEY_VAR}: the admin APIs' key (header "
                     f"{ADMIN_KEY_HEADER}); unset: a random one per start, shown nowhere.")
    args = parser.parse_args(argv)
    key = env.get(ADMIN_KEY_VAR, "").strip()
    try:
        api_key = server_api_key(env)
    except ApiKeyError as error:
        parser.error(str(error))
    return ServerOptions(
        target=args.target, draft=args.draft, cache_dir=args.cache_dir, model_repository=args.model_repository,
        address=args.address, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, openai_port=args.openai_port, watchdog_port=args.watchdog_port,
        log_verbose=args.log_verbose, profile=args.profile, sim_preset=args.sim_preset,
        triton_args=shlex.split(env.get("SPECDEC_TRITON_ARGS", "")) + passthrough,
        admin_key=key or new_admin_key(), admin_key_from_env=bool(key),
        api_key=api_key, allow_open_inference=args.allow_open_inference,
    )


def main(argv: list[str] | None = None) -> int:
    options = _parse_args(argv)
    try:
        profiles.check(options.profile, options.sim_preset, options.model_repository)
        check_access(options)
        pair = prepare(options)
    except (AdminKeyError, OpenInferenceError, assets.AssetError, TokenizerMismatch,
            tritonserver.TritonNotFound, profiles.ProfileError) as error:
        print(f"specdec-serve: {error}", file=sys.stderr)
        return 2
    orphans = shm_regions.remove_orphans(os.getpid())
    if orphans:
        print(f"specdec: removed {len(orphans)} shared-memory regions that stopped servers left in "
              f"{shm_regions.SHM_DIR}", flush=True)
    print(f"specdec: starting tritonserver (target {pair.target_dir.name}, draft {pair.draft_dir.name})", flush=True)
    process = start(options, pair)
    try:
        return _serve(options, pair, process)
    finally:
        if process.poll() is not None:  # its regions are nobody's now, even if it exited on its exit timeout
            _kill_stray_stubs(options.shm_region_prefix)
            shm_regions.remove(options.shm_region_prefix)


def _kill_stray_stubs(region_prefix: str) -> None:
    """Kill this server's Python-backend stubs still running after tritonserver exited:
    Triton stops its stubs as it shuts down, but one that does not exit in time
    outlives it, re-parented and holding its memory, and nothing else would end it."""
    for pid in stubs.server_stub_pids(region_prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # exited meanwhile
            continue
        print(f"specdec: killed a Python-backend stub (pid {pid}) that outlived tritonserver", flush=True)


def _serve(options: ServerOptions, pair: PreparedPair, process: subprocess.Popen) -> int:
    children = [process]
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        wait_until_ready(process, options)
    except (RuntimeError, TimeoutError) as error:
        print(f"specdec-serve: {error}", file=sys.stderr)
        process.terminate()
        process.wait()
        return 1
    send_first_request(options)
    if engine_watchdog.enabled():
        children.append(engine_watchdog.start(readiness.local_url(options.address, options.http_port), process.pid,
                                              options.admin_key, ADMIN_KEY_VAR, options.address,
                                              options.watchdog_port, api_key=options.api_key))
    openai = ""
    if options.openai_port:
        url = openai_frontend.base_url(options.address, options.openai_port)
        frontend = openai_frontend.start(f"{readiness.local_host(options.address)}:{options.grpc_port}", pair.target_dir,
                                         options.address, options.openai_port, secret_vars=(ADMIN_KEY_VAR,),
                                         api_key=options.api_key)
        children.append(frontend)
        try:
            openai_frontend.wait_until_ready(frontend, url)
        except (RuntimeError, TimeoutError) as error:
            print(f"specdec-serve: {error}", file=sys.stderr)
            for child in reversed(children):
                openai_frontend.stop(child)
            return 1
        openai = f", OpenAI http://{options.address}:{options.openai_port}/v1"
    print(
        f"specdec: ready - gRPC {options.address}:{options.grpc_port}, HTTP {options.address}:{options.http_port}, "
        f"metrics {options.address}:{options.metrics_port}{openai} - try: "
        f".venv/bin/specdec-client --url localhost:{options.grpc_port} 'def fibonacci(n):'",
        flush=True,
    )
    key_source = (f"the key in {ADMIN_KEY_VAR}" if options.admin_key_from_env
                  else f"a random key made for this run and shown nowhere (set {ADMIN_KEY_VAR} to choose one)")
    print(f"specdec: admin APIs ({', '.join(RESTRICTED_APIS)}) need header {ADMIN_KEY_HEADER} (HTTP) or "
          f"{GRPC_ADMIN_KEY_HEADER} (gRPC) with {key_source}", flush=True)
    if options.api_key is not None:
        print(f"specdec: inference needs the key in {API_KEY_VAR}: header {API_KEY_HEADER} (HTTP), "
              f"{GRPC_API_KEY_HEADER} (gRPC), 'Authorization: Bearer' (OpenAI); the tools read {API_KEY_VAR}",
              flush=True)
    else:
        print(f"specdec: inference is open to everyone who can reach {options.address} (no {API_KEY_VAR})",
              flush=True)
    return _supervise(process, children[1:], lambda: stopping)


def _child_name(child: subprocess.Popen) -> str:
    args = child.args if isinstance(child.args, (list, tuple)) else [str(child.args)]
    return "the engine watchdog" if "selfheal.watchdog" in map(str, args) else "the OpenAI frontend"


def _supervise(process: subprocess.Popen, others: list[subprocess.Popen], stopping) -> int:
    """Run until tritonserver exits, then stop the others; one of them exiting
    on its own (not on a signal) stops tritonserver: a server whose OpenAI port
    died would look healthy to probes that only ask Triton, and a watchdog
    exits when reloading an engine did not keep it up."""
    while process.poll() is None:
        for child in others:
            if child.poll() is not None and not stopping():
                print(f"specdec-serve: {_child_name(child)} exited with code {child.returncode}; "
                      "stopping tritonserver", file=sys.stderr, flush=True)
                process.terminate()
                process.wait()
                return child.returncode or 1
        time.sleep(0.5)
    for child in others:
        openai_frontend.stop(child)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
