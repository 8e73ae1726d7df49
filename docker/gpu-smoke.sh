#!/usr/bin/env bash
# The GPU smoke test of the trtllm profile: one run on a GPU host (H100 or
# A100, Docker with the NVIDIA Container Toolkit, the image built from
# docker/Dockerfile.trtllm), about 10-15 minutes, one markdown report to
# paste into docs/gpu.md ("The GPU smoke test" says what each step checks).
#
#   docker build -f docker/Dockerfile.trtllm -t specdec-trtllm:0.1.0 .
#   docker/gpu-smoke.sh --target-hf /srv/models/Qwen2.5-Coder-0.5B-Instruct
#   docker/gpu-smoke.sh --dry-run ...     # no Docker, no GPU: prints the plan
#
# Run it on the host (it calls `docker run`), from a checkout of the repository
# the image was built from: tools/gpu_smoke.py (the checks that need Python)
# is mounted into client containers of the same image and runs with the
# image's interpreter.
#
# The steps, each timed and recorded PASS, FAIL or SKIP with an excerpt of its
# output; a failed step does not stop the later ones that do not need it, and
# the exit status is 1 when any step failed (2: bad arguments):
#   1  environment: nvidia-smi, driver and CUDA, TensorRT-LLM, pip check, build info
#   2a the engine pair, bfloat16, built by build_engines.sh in the image as uid 10001
#   2b the same in fp8 (compute capability >= 8.9 only; runs last, the server stopped)
#   3  the server started as Kubernetes starts it; the time until /v2/health/ready
#   4  direct calls to the target (and the draft) as NVIDIA's client makes them
#   5  greedy speculative vs plain decoding: share identical, first differences
#   6  sampled first tokens, speculative vs plain: a chi-square test
#   7a the openai package against the OpenAI-compatible API (port 9000)
#   7b NVIDIA's end-to-end client, when the image (or --nvidia-client) has it
#   8  32 concurrent sampled requests: all succeed; latency and tokens/s
#   9  kill -9 of the draft's executor worker; the time until drafting is back
#
# Every container runs as the pods do (k8s/base/deployment.yaml): uid 10001,
# read-only root filesystem, all capabilities dropped, no privilege escalation,
# /tmp a fresh scratch volume. Every command runs under `timeout`, the whole
# run under --timeout-minutes; the containers are removed on exit, whatever
# happens. Files the containers wrote in --work-dir belong to uid 10001 (the
# report's last lines say how to remove them).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"
SMOKE_PY="${REPO_ROOT}/tools/gpu_smoke.py"
SMOKE_IN=/opt/specdec/smoke/gpu_smoke.py
BUILD_SCRIPT="${SCRIPT_DIR}/build_engines.sh"

# ---- defaults -------------------------------------------------------------------
# The cheapest pair that exercises everything: the 0.5B model as target and draft.
DEFAULT_CHECKPOINT=/srv/models/Qwen2.5-Coder-0.5B-Instruct
IMAGE=specdec-trtllm:0.1.0
TARGET_HF=""
DRAFT_HF=""
WORK_DIR="${PWD}/gpu-smoke"
REPORT=""
SKIP_FP8=0
GPUS=all
TIMEOUT_MINUTES=15
PORT_BASE=18000
CALIB_DATASET=""
NVIDIA_CLIENT_FILE=""
DRY_RUN=0
# The openai package's version: the one the tests use (requirements/test.txt).
OPENAI_VERSION="$(sed -n 's/^openai==\([0-9][0-9.]*\).*/\1/p' "${REPO_ROOT}/requirements/test.txt" 2>/dev/null || true)"
# Samples quantize.py calibrates FP8 on: few, to keep the build short.
CALIB_SIZE=64

usage() {
    cat <<EOF
usage: $(basename "$0") [options]

  --image TAG             the trtllm image (docker/Dockerfile.trtllm)   (default ${IMAGE})
  --target-hf DIR         Hugging Face checkpoint of the target   (default ${DEFAULT_CHECKPOINT})
  --draft-hf DIR          Hugging Face checkpoint of the draft    (default: --target-hf)
  --work-dir DIR          engines, logs and the report go under DIR/run-<time>  (default ./gpu-smoke)
  --report PATH           where the markdown report is written    (default: in the run directory)
  --gpus SPEC             docker's --gpus: all, a count, device=0  (default ${GPUS})
  --skip-fp8              do not build the FP8 engines
  --calib-dataset DIR     FP8 calibration data (local dataset directory; default: a
                          generated ${CALIB_SIZE}-line set, so nothing is downloaded)
  --nvidia-client FILE    NVIDIA's end_to_end_grpc_client.py, when the image has none
  --port-base N           host ports N..N+4 on 127.0.0.1 for the server's 8000, 8001,
                          8002, 8003 and 9000                   (default ${PORT_BASE})
  --timeout-minutes N     the whole run's limit                    (default ${TIMEOUT_MINUTES})
  --dry-run               print every step and docker command, run nothing (no Docker,
                          no GPU); still checks the arguments and the checkpoints and
                          runs build_engines.sh --dry-run
  -h, --help              this text
EOF
}

die() {
    echo "gpu-smoke: error: $*" >&2
    exit 2
}

require_value() {
    if [ "$#" -lt 2 ] || [ -z "$2" ]; then
        die "$1 needs a value"
    fi
}

COMMAND_LINE="$(printf ' %q' "$0" "$@")"
COMMAND_LINE="${COMMAND_LINE# }"

while [ "$#" -gt 0 ]; do
    case "$1" in
        --image) require_value "$@"; IMAGE="$2"; shift 2 ;;
        --target-hf) require_value "$@"; TARGET_HF="$2"; shift 2 ;;
        --draft-hf) require_value "$@"; DRAFT_HF="$2"; shift 2 ;;
        --work-dir) require_value "$@"; WORK_DIR="$2"; shift 2 ;;
        --report) require_value "$@"; REPORT="$2"; shift 2 ;;
        --gpus) require_value "$@"; GPUS="$2"; shift 2 ;;
        --skip-fp8) SKIP_FP8=1; shift ;;
        --calib-dataset) require_value "$@"; CALIB_DATASET="$2"; shift 2 ;;
        --nvidia-client) require_value "$@"; NVIDIA_CLIENT_FILE="$2"; shift 2 ;;
        --port-base) require_value "$@"; PORT_BASE="$2"; shift 2 ;;
        --timeout-minutes) require_value "$@"; TIMEOUT_MINUTES="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

# ---- validate the arguments -------------------------------------------------------
is_int() {
    case "$1" in
        '' | *[!0-9]*) return 1 ;;
        *) return 0 ;;
    esac
}

absolute_dir() {
    (cd "$1" && pwd)
}

[[ "${IMAGE}" =~ ^[A-Za-z0-9][A-Za-z0-9._/:@-]*$ ]] || die "--image: '${IMAGE}' is not a Docker image reference"
[[ "${GPUS}" =~ ^(all|[1-9][0-9]*|\"?device=[A-Za-z0-9,:-]+\"?)$ ]] \
    || die "--gpus: '${GPUS}' is not one of: all, a number of GPUs, device=<index or UUID>[,...]"
{ is_int "${TIMEOUT_MINUTES}" && [ "${TIMEOUT_MINUTES}" -ge 5 ] && [ "${TIMEOUT_MINUTES}" -le 600 ]; } \
    || die "--timeout-minutes: '${TIMEOUT_MINUTES}' is not a whole number of minutes from 5 to 600"
{ is_int "${PORT_BASE}" && [ "${PORT_BASE}" -ge 1024 ] && [ "${PORT_BASE}" -le 65531 ]; } \
    || die "--port-base: '${PORT_BASE}' is not a port from 1024 to 65531 (it uses N..N+4)"
[ -n "${OPENAI_VERSION}" ] || die "no openai==<version> pin in ${REPO_ROOT}/requirements/test.txt"
[ -f "${SMOKE_PY}" ] || die "${SMOKE_PY} is missing: run this script from a checkout of the repository"
if [ "${DRY_RUN}" != "1" ]; then
    command -v timeout >/dev/null 2>&1 || die "timeout (GNU coreutils) is needed to bound every step"
fi

if [ -z "${TARGET_HF}" ]; then
    [ -f "${DEFAULT_CHECKPOINT}/config.json" ] \
        || die "--target-hf: the default checkpoint ${DEFAULT_CHECKPOINT} is not there; download it" \
               "(huggingface-cli download Qwen/Qwen2.5-Coder-0.5B-Instruct --local-dir ${DEFAULT_CHECKPOINT})" \
               "or pass --target-hf DIR"
    TARGET_HF="${DEFAULT_CHECKPOINT}"
fi
DRAFT_HF="${DRAFT_HF:-${TARGET_HF}}"
for pair in "--target-hf:${TARGET_HF}" "--draft-hf:${DRAFT_HF}"; do
    option="${pair%%:*}"
    dir="${pair#*:}"
    [ -d "${dir}" ] || die "${option}: ${dir} is not a directory"
    [ -f "${dir}/config.json" ] || die "${option}: ${dir} is not a Hugging Face checkpoint (no config.json)"
done
TARGET_HF="$(absolute_dir "${TARGET_HF}")"
DRAFT_HF="$(absolute_dir "${DRAFT_HF}")"
if [ -n "${CALIB_DATASET}" ]; then
    [ -d "${CALIB_DATASET}" ] || die "--calib-dataset: ${CALIB_DATASET} is not a directory"
    CALIB_DATASET="$(absolute_dir "${CALIB_DATASET}")"
fi
if [ -n "${NVIDIA_CLIENT_FILE}" ]; then
    [ -f "${NVIDIA_CLIENT_FILE}" ] || die "--nvidia-client: ${NVIDIA_CLIENT_FILE} is not a file"
    NVIDIA_CLIENT_FILE="$(absolute_dir "$(dirname "${NVIDIA_CLIENT_FILE}")")/$(basename "${NVIDIA_CLIENT_FILE}")"
fi
if [ -n "${REPORT}" ]; then
    [ ! -d "${REPORT}" ] || die "--report: ${REPORT} is a directory; name a file"
    mkdir -p "$(dirname "${REPORT}")" 2>/dev/null || die "--report: cannot create the directory of ${REPORT}"
fi
mkdir -p "${WORK_DIR}" 2>/dev/null || die "--work-dir: cannot create ${WORK_DIR}"
[ -w "${WORK_DIR}" ] || die "--work-dir: ${WORK_DIR} is not writable"
WORK_DIR="$(absolute_dir "${WORK_DIR}")"

# ---- the run's files and names --------------------------------------------------------
RUN_ID="$(date +%Y%m%d-%H%M%S)"
RUN_DIR="${WORK_DIR}/run-${RUN_ID}"
LOG_DIR="${RUN_DIR}/logs"
ENGINES_BF16="${RUN_DIR}/engines-bf16"
ENGINES_FP8="${RUN_DIR}/engines-fp8"
# The build containers' /tmp (HOME, scratch, converted checkpoints), on disk as
# the engine-build Job's emptyDir is.
BUILD_TMP="${RUN_DIR}/build-tmp"
CALIB_DIR="${RUN_DIR}/calibration"
REPORT="${REPORT:-${RUN_DIR}/gpu-smoke-report.md}"
mkdir -p "${LOG_DIR}"
chmod 0700 "${RUN_DIR}"
PREFIX="gpu-smoke-${RUN_ID}-$$"
SERVER="${PREFIX}-server"
HTTP_PORT="${PORT_BASE}"
GRPC_PORT=$((PORT_BASE + 1))
METRICS_PORT=$((PORT_BASE + 2))
WATCHDOG_PORT=$((PORT_BASE + 3))
OPENAI_PORT=$((PORT_BASE + 4))

# Every container of this script runs with the pods' security context
# (k8s/base/deployment.yaml, k8s/components/trtllm/engine-build-job.yaml), and
# never pulls: the image must be the one built here.
SECURE=(--user 10001:10001 --read-only --cap-drop ALL --security-opt no-new-privileges --pull never)
# /tmp of the server and client containers: a fresh in-memory volume, as the
# pod's emptyDir (exec allowed, as on an emptyDir).
SCRATCH=(--tmpfs "/tmp:rw,exec,nosuid,nodev,mode=1777,size=2g" -e HOME=/tmp -e TMPDIR=/tmp)
# The a100 overlay's limits (k8s/overlays/a100/gpu.yaml), the smaller of the two
# GPU overlays: memory 48Gi, 12 CPUs (fewer on a smaller host), /dev/shm 8Gi.
CPUS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 12)"
[ "${CPUS}" -le 12 ] || CPUS=12
LIMITS=(--memory 48g --cpus "${CPUS}" --shm-size 8g --ulimit memlock=-1 --ulimit stack=67108864)

START_EPOCH="$(date +%s)"
# 45 s of the limit are kept for stopping the containers and writing the report.
DEADLINE=$((START_EPOCH + TIMEOUT_MINUTES * 60 - 45))

# ---- the steps: titles, what each checks, results -----------------------------------------
STEP_ORDER=(1 2a 2b 3 4 5 6 7a 7b 8 9)
declare -A TITLE=(
    [1]="Environment"
    [2a]="Engine build, bfloat16"
    [2b]="Engine build, FP8"
    [3]="Server start as in Kubernetes"
    [4]="Direct engine calls"
    [5]="Greedy agreement, speculative vs plain"
    [6]="Sampled first-token distribution, speculative vs plain"
    [7a]="OpenAI-compatible API with the openai package"
    [7b]="NVIDIA's end-to-end client"
    [8]="32 concurrent sampled requests"
    [9]="Draft executor killed: recovery"
)
declare -A WHAT=(
    [1]="nvidia-smi on the host and in the image; the GPU, its compute capability, the driver and CUDA versions; the versions of TensorRT-LLM and the other packages in the image and that tensorrt_llm imports; \`pip check\` against the base image's own report (/opt/specdec/pip-check-base.txt: only new problems fail); the image's id, labels and build info."
    [2a]="docker/build_engines.sh inside the image, as uid 10001 on a read-only root filesystem (as the engine-build Job), bfloat16, target and draft; the engines, tokenizer and build-info.json must be there afterwards."
    [2b]="The same build with --dtype fp8 (ModelOpt quantization, FP8 KV cache), calibrated on ${CALIB_SIZE} local samples; skipped on GPUs below compute capability 8.9 and with --skip-fp8. It runs last, after the server is stopped, so it cannot starve the serving checks; the FP8 engines are built, not served."
    [3]="The image's entrypoint with the pods' settings: --user 10001:10001 --read-only --cap-drop ALL --security-opt no-new-privileges, /tmp a tmpfs, the a100 overlay's memory, CPU and /dev/shm limits, the bfloat16 engines mounted read-only, an API key and an admin key, the Deployment's tritonserver arguments; the time until /v2/health/ready answers 200."
    [4]="Requests straight to the target model in the tensorrtllm contract, shaped as NVIDIA's client shapes them (input_ids, input_lengths, request_output_len, end_id, pad_id, runtime_top_k, streaming; leading batch dimension 1): output_ids [1, 1, L] and sequence_length [1, 1]; streamed responses add up to the non-streamed tokens; an end_id stops generation before it (not returned, not counted); generation_logits [1, 1, n, vocab] whose argmax is the greedy token; external draft tokens are accepted when right and cut at the first wrong one; the draft model answers with logits."
    [5]="16 code prompts, 64 tokens, greedy, through the coordinator with speculation_window 0 (plain) and with the server's window, the draft model drafting every round (adaptive_window off). TensorRT-LLM does not promise bitwise identity (its verification kernels round differently from its generation kernels), so the share of identical completions is reported, with the first differing token (completions re-encoded with the pair's tokenizer); the step passes at >= 75 % identical."
    [6]="200 samples per arm of a 3-token completion of one prompt at temperature 1, plain and speculative (draft model, adaptive_window off), distinct seeds. The first token and the first two tokens are compared with a chi-square test of homogeneity (categories expected < 5 times pooled); the step fails when p < 0.001 (a false alarm once in a thousand runs). The coordinator decodes a request's first token plainly and speculates from the second, so the two-token test is the one that exercises rejection sampling; with the same model as target and draft a wrong rejection sampler can still pass, so run it with a distinct draft (--draft-hf) for that."
    [7a]="The openai package at the version requirements/test.txt pins (${OPENAI_VERSION}), pip-installed as uid 10001 into a throwaway client container (the image does not carry it; needs network): models.list, a chat completion with the speculation statistics, the same streamed, a completion."
    [7b]="NVIDIA's inflight_batcher_llm/client/end_to_end_grpc_client.py, unchanged, against the ensemble model, streamed and not; found in the image (tools/gpu_smoke.py lists the places it looks) or given with --nvidia-client. It has no option for the API key header, so its gRPC streams get the key through a patch of tritonclient's start_stream made before it runs."
    [8]="32 streamed requests at once through the coordinator (temperature 0.8, top_p 0.95, 64 tokens, the server's speculation settings): every one must succeed; p50 and p99 latency, time to first text and tokens/s."
    [9]="A greedy speculative request drafts; then the draft's TensorRT-LLM executor worker is killed with kill -9. It is found by its command line: the processes in the container (docker top) whose program is trtllmExecutorWorker (executor_worker_path in configs/trtllm.pbtxt; TensorRT-LLM's orchestrator mode spawns one per model, with no other arguments), and of the two, the one holding less GPU memory (host nvidia-smi): the target's KV-cache fraction and weights are the larger. Then a greedy speculative request every second until one drafts again; the step reports the time and whether the engine watchdog reloaded the draft in place or the container restarted."
)
declare -A STATUS=() STEP_SECONDS=() NOTE=()
CURRENT_STEP=""
STEP_START=0
LOG=/dev/null
CONTAINERS=()
RUN_STDIN=/dev/null
RUN_PID=""
HEARTBEAT_PID=""
REPORT_WRITTEN=0
SERVER_STARTED=0

# Facts for the report's header, filled in by step 1.
GPU_NAME="?"
COMPUTE_CAP="?"
DRIVER="?"
CUDA_DRIVER="?"
CUDA_IMAGE="?"
TRTLLM_INSTALLED="?"
IMAGE_ID="?"
DOCKER_OK=0
IMAGE_OK=0

elapsed() {
    local s=$(($(date +%s) - START_EPOCH))
    printf '%02d:%02d' $((s / 60)) $((s % 60))
}

say() {
    printf '[%s] %s\n' "$(elapsed)" "$*" >&2
}

# Seconds a step may take: its own cap, or what is left of the run's limit.
budget() {
    local cap="$1" left
    left=$((DEADLINE - $(date +%s)))
    if [ "${left}" -lt "${cap}" ]; then
        cap="${left}"
    fi
    if [ "${cap}" -lt 10 ]; then
        cap=10
    fi
    echo "${cap}"
}

begin() {
    CURRENT_STEP="$1"
    STEP_START="$(date +%s)"
    LOG="${LOG_DIR}/step-$1.log"
    : >"${LOG}"
    say "step $1: ${TITLE[$1]}"
}

# Explanations of failures whose cause is known, from the step's log.
hint() {
    local log="$1"
    if grep -q "could not select device driver" "${log}" 2>/dev/null; then
        echo "Docker cannot give containers a GPU: install the NVIDIA Container Toolkit and restart Docker."
    elif grep -q -i "permission denied while trying to connect to the docker" "${log}" 2>/dev/null; then
        echo "this user may not use Docker: run as a member of the docker group (or root)."
    elif grep -q -E "No such image|pull access denied|Unable to find image" "${log}" 2>/dev/null; then
        echo "the image ${IMAGE} is not on this host: docker build -f docker/Dockerfile.trtllm -t ${IMAGE} ."
    elif grep -q -E "CUDA driver version is insufficient|forward compatibility was attempted" "${log}" 2>/dev/null; then
        echo "the NVIDIA driver is too old for the image's CUDA (docs/gpu.md names the drivers that work)."
    elif grep -q -E "port is already allocated|address already in use" "${log}" 2>/dev/null; then
        echo "a host port of ${PORT_BASE}..$((PORT_BASE + 4)) is taken: pass another --port-base."
    elif grep -q -i -E "out of memory|OOMKilled|std::bad_alloc" "${log}" 2>/dev/null; then
        echo "memory ran out (GPU or host; see the excerpt)."
    elif grep -q "Permission denied" "${log}" 2>/dev/null; then
        echo "a file was not readable or writable by uid 10001 (checkpoint files must be world-readable)."
    fi
    return 0
}

finish_step() {
    local id="$1" status="$2" note="${3:-}" why
    STEP_SECONDS[${id}]=$(($(date +%s) - STEP_START))
    if [ "${DRY_RUN}" = "1" ]; then
        status="not run (dry run)"
        note=""
    fi
    if [ "${status}" = "FAIL" ]; then
        why="$(hint "${LOG}")"
        [ -z "${why}" ] || note="${note:+${note}; }${why}"
    fi
    STATUS[${id}]="${status}"
    NOTE[${id}]="${note}"
    say "step ${id}: ${status} (${STEP_SECONDS[${id}]} s)${note:+: ${note}}"
    if [ "${status}" = "FAIL" ] && [ -s "${LOG}" ]; then
        echo "    --- last lines of ${LOG}:" >&2
        tail -n 15 "${LOG}" | sed 's/^/    /' >&2
    fi
    CURRENT_STEP=""
}

skip() {
    local id="$1" reason="$2"
    STEP_SECONDS[${id}]=0
    if [ "${DRY_RUN}" = "1" ]; then
        STATUS[${id}]="not run (dry run)"
        NOTE[${id}]="would be skipped: ${reason}"
    else
        STATUS[${id}]="SKIP"
        NOTE[${id}]="${reason}"
    fi
    say "step ${id}: ${STATUS[${id}]}: ${reason}"
}

# Runs a command with a time limit, its output into the step's log (with a
# progress line every 30 s), or prints it shell-quoted with --dry-run.
# Usage: run_logged <seconds> <command...>; stdin from RUN_STDIN.
run_logged() {
    local limit="$1" rc=0
    shift
    {
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    } >>"${LOG}"
    if [ "${DRY_RUN}" = "1" ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    timeout --kill-after=15 "${limit}" "$@" <"${RUN_STDIN}" >>"${LOG}" 2>&1 &
    RUN_PID=$!
    heartbeat &
    HEARTBEAT_PID=$!
    wait "${RUN_PID}" || rc=$?
    stop_heartbeat
    RUN_PID=""
    if [ "${rc}" -eq 124 ] || [ "${rc}" -eq 137 ]; then
        echo "gpu-smoke: stopped after its limit of ${limit} s" >>"${LOG}"
    fi
    return "${rc}"
}

# Every 30 s, the elapsed time and the last line of the step's log (run in the
# background while a command runs; stop_heartbeat ends it and its sleep).
heartbeat() {
    local waited=0 sleeper=""
    trap 'kill "${sleeper}" 2>/dev/null; exit 0' TERM
    while true; do
        sleep 30 &
        sleeper=$!
        wait "${sleeper}"
        waited=$((waited + 30))
        say "  ... ${waited} s: $(tail -n 1 "${LOG}" | cut -c1-100)"
    done
}

stop_heartbeat() {
    if [ -n "${HEARTBEAT_PID}" ]; then
        kill "${HEARTBEAT_PID}" 2>/dev/null || true
        wait "${HEARTBEAT_PID}" 2>/dev/null || true
        HEARTBEAT_PID=""
    fi
}

# docker run with the pods' security options, a name of this run (removed on
# exit) and a time limit; a container that outlives its limit is removed.
# Usage: docker_run <seconds> <name> <docker run options and command...>
docker_run() {
    local limit="$1" name="$2" rc=0
    shift 2
    CONTAINERS+=("${name}")
    run_logged "${limit}" docker run --name "${name}" "${SECURE[@]}" "$@" || rc=$?
    if [ "${DRY_RUN}" != "1" ] && { [ "${rc}" -eq 124 ] || [ "${rc}" -eq 137 ]; }; then
        docker rm -f "${name}" >/dev/null 2>&1 || true
    fi
    return "${rc}"
}

# A client container of the same image on the host's network, running one
# check of tools/gpu_smoke.py. Usage: client <seconds> <name> <check> [args...]
CLIENT_OPTS=()
client() {
    local limit="$1" name="$2"
    shift 2
    docker_run "${limit}" "${PREFIX}-${name}" --rm "${CLIENT_OPTS[@]}" --network host "${SCRATCH[@]}" -e SPECDEC_API_KEY \
        -v "${ENGINES_BF16}:/opt/specdec/engines:ro" -v "${SMOKE_PY}:${SMOKE_IN}:ro" \
        --entrypoint python3 "${IMAGE}" "${SMOKE_IN}" "$@"
}

# Status of a step from a check's exit code (77: skipped).
check_status() {
    case "$1" in
        0) echo PASS ;;
        77) echo SKIP ;;
        *) echo FAIL ;;
    esac
}

# The value of a `smoke: key=value` line in a log.
fact() {
    sed -n "s/^smoke: $2=//p" "$1" 2>/dev/null | tail -n 1 || true
}

# ---- step 1: environment ----------------------------------------------------------------
# Runs in the image, through NVIDIA's entrypoint (CUDA compatibility libraries).
ENV_PROBE="${RUN_DIR}/environment-probe.sh"
cat >"${ENV_PROBE}" <<'PROBE'
status=0
echo "== nvidia-smi (in the container)"
nvidia-smi || status=1
echo "== GPUs"
nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total --format=csv || status=1
echo "smoke: compute_cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' ')"
echo "smoke: gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "smoke: driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)"
echo "smoke: cuda_driver=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)"
echo "smoke: cuda_image=${CUDA_VERSION:-unknown}"
echo "== versions in the image"
env | grep -E '^(NVIDIA_TRITON_SERVER_VERSION|TRITON_SERVER_VERSION|CUDA_VERSION|CUDA_DRIVER_VERSION|TRT_VERSION|TENSORRT_VERSION|CUDNN_VERSION|NCCL_VERSION)=' | sort
python3 - <<'PY' || status=1
from importlib.metadata import PackageNotFoundError, version
for name in ("tensorrt_llm", "tensorrt", "torch", "transformers", "tokenizers", "datasets", "numpy",
             "tritonclient", "fastapi", "uvicorn", "triton-specdec"):
    try:
        print(f"smoke: package {name}={version(name)}")
    except PackageNotFoundError:
        print(f"smoke: package {name}=not installed")
PY
echo "== import tensorrt_llm"
python3 -c 'import tensorrt_llm; print("smoke: trtllm=" + tensorrt_llm.__version__)' 2>&1 | tail -n 5 || status=1
echo "== pip check, against the base image's own report (/opt/specdec/pip-check-base.txt)"
pip check >/tmp/pip-check.txt 2>&1 || true
cat /tmp/pip-check.txt
if [ -f /opt/specdec/pip-check-base.txt ]; then
    new="$(grep -v -x -F -f /opt/specdec/pip-check-base.txt /tmp/pip-check.txt | grep -v '^No broken requirements found' || true)"
else
    echo "(no base report in this image: every problem counts)"
    new="$(grep -v '^No broken requirements found' /tmp/pip-check.txt || true)"
fi
if [ -n "${new}" ]; then
    echo "smoke: pip_check=problems the base image does not have:"
    echo "${new}"
    status=1
else
    echo "smoke: pip_check=ok (nothing beyond the base image's own report)"
fi
echo "== build info"
found=0
for file in /opt/specdec/build-info.json /opt/specdec/image-build-info.json; do
    if [ -f "${file}" ]; then
        echo "${file}:"
        cat "${file}"
        found=1
    fi
done
[ "${found}" = 1 ] || echo "no build-info file in the image"
if [ -d /opt/specdec/TensorRT-LLM/examples ]; then
    echo "TensorRT-LLM examples: /opt/specdec/TensorRT-LLM/examples"
else
    echo "TensorRT-LLM examples: absent (build_engines.sh will clone them)"
fi
exit "${status}"
PROBE

step_environment() {
    local rc=0 failed=0
    begin 1
    if [ "${DRY_RUN}" != "1" ] && ! command -v docker >/dev/null 2>&1; then
        echo "docker: command not found" >>"${LOG}"
        finish_step 1 FAIL "docker is not installed on this host"
        return
    fi
    run_logged 30 docker version --format 'docker client {{.Client.Version}}, server {{.Server.Version}}' || rc=$?
    if [ "${rc}" -ne 0 ]; then
        finish_step 1 FAIL "the Docker daemon did not answer"
        return
    fi
    DOCKER_OK=1
    # shellcheck disable=SC2016 # a Go template for docker, not a shell expansion
    run_logged 30 docker info --format 'runtimes: {{range $name, $_ := .Runtimes}}{{$name}} {{end}}; default {{.DefaultRuntime}}' || true
    if [ "${DRY_RUN}" = "1" ] || command -v nvidia-smi >/dev/null 2>&1; then
        run_logged 30 nvidia-smi || failed=1
    else
        echo "(no nvidia-smi on the host; the container's follows)" >>"${LOG}"
    fi
    if command -v nvidia-ctk >/dev/null 2>&1; then
        run_logged 30 nvidia-ctk --version || true
    fi
    rc=0
    run_logged 30 docker image inspect --format 'image {{.Id}} created {{.Created}} labels {{json .Config.Labels}}' "${IMAGE}" || rc=$?
    if [ "${rc}" -ne 0 ]; then
        finish_step 1 FAIL "the image ${IMAGE} is not on this host"
        return
    fi
    IMAGE_OK=1
    if [ "${DRY_RUN}" != "1" ]; then
        IMAGE_ID="$(docker image inspect --format '{{.Id}}' "${IMAGE}" 2>/dev/null | cut -c1-19 || true)"
    fi
    rc=0
    # The probe (the run directory's environment-probe.sh) goes in on stdin.
    RUN_STDIN="${ENV_PROBE}"
    docker_run "$(budget 240)" "${PREFIX}-environment" --rm -i --gpus "${GPUS}" "${SCRATCH[@]}" \
        --entrypoint /opt/nvidia/nvidia_entrypoint.sh "${IMAGE}" bash -o pipefail -s || rc=$?
    RUN_STDIN=/dev/null
    [ "${rc}" -eq 0 ] || failed=1
    GPU_NAME="$(fact "${LOG}" gpu)"
    COMPUTE_CAP="$(fact "${LOG}" compute_cap)"
    DRIVER="$(fact "${LOG}" driver)"
    CUDA_DRIVER="$(fact "${LOG}" cuda_driver)"
    CUDA_IMAGE="$(fact "${LOG}" cuda_image)"
    TRTLLM_INSTALLED="$(fact "${LOG}" 'package tensorrt_llm')"
    if [ "${failed}" = 1 ]; then
        finish_step 1 FAIL "see the excerpt (nvidia-smi, the tensorrt_llm import or pip check)"
    else
        finish_step 1 PASS "${GPU_NAME:-?}, compute capability ${COMPUTE_CAP:-?}, driver ${DRIVER:-?}, TensorRT-LLM ${TRTLLM_INSTALLED:-?}"
    fi
}

# ---- step 2: engines ---------------------------------------------------------------------------
# Usage: build_engines <step> <dtype> <output dir> [extra docker options...] -- [extra build options...]
build_engines() {
    local id="$1" dtype="$2" output="$3" rc=0 docker_extra=() build_extra=() unreadable
    shift 3
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
        docker_extra+=("$1")
        shift
    done
    [ "$#" -eq 0 ] || shift
    build_extra=("$@")
    if [ "${DRY_RUN}" != "1" ]; then
        mkdir -p "${output}" "${BUILD_TMP}"
        # uid 10001 writes here (the engines, its HOME and scratch).
        chmod 0777 "${output}" "${BUILD_TMP}"
        unreadable="$(find "${TARGET_HF}/" "${DRAFT_HF}/" ! -perm -o+r 2>/dev/null | head -n 3 || true)"
        if [ -n "${unreadable}" ]; then
            echo "warning: not readable by other users (uid 10001 must read the checkpoints): ${unreadable}" >>"${LOG}"
        fi
    fi
    docker_run "$(budget 720)" "${PREFIX}-build-${dtype}" --rm --gpus "${GPUS}" "${LIMITS[@]}" \
        -v "${BUILD_TMP}:/tmp" -e HOME=/tmp -e TMPDIR=/tmp -e "CALIB_SIZE=${CALIB_SIZE}" \
        -v "${TARGET_HF}:/checkpoints/target:ro" -v "${DRAFT_HF}:/checkpoints/draft:ro" \
        -v "${output}:/opt/specdec/engines" "${docker_extra[@]}" \
        --entrypoint /opt/nvidia/nvidia_entrypoint.sh "${IMAGE}" \
        /opt/specdec/docker/build_engines.sh \
        --target-hf /checkpoints/target --draft-hf /checkpoints/draft \
        --output /opt/specdec/engines --model-repository /opt/specdec/model_repository \
        --work-dir "/tmp/build-${dtype}" --dtype "${dtype}" "${build_extra[@]}" || rc=$?
    if [ "${DRY_RUN}" = "1" ]; then
        # build_engines.sh's own dry run, for real: it checks these arguments
        # against the checkpoints' config.json and the model repository.
        say "  build_engines.sh --dry-run (${dtype}) checks the build's arguments"
        local host_extra=("${build_extra[@]}")
        if [ "${dtype}" = "fp8" ]; then
            host_extra=(--calib-dataset "${CALIB_DATASET:-${CALIB_DIR}}")
        fi
        if ! CALIB_SIZE="${CALIB_SIZE}" bash "${BUILD_SCRIPT}" --dry-run \
            --target-hf "${TARGET_HF}" --draft-hf "${DRAFT_HF}" --output "${output}" \
            --model-repository "${REPO_ROOT}/model_repository" --examples-dir /opt/specdec/TensorRT-LLM \
            --work-dir "/tmp/build-${dtype}" --dtype "${dtype}" "${host_extra[@]}"; then
            echo "gpu-smoke: error: build_engines.sh --dry-run refused the ${dtype} build (its message is above)" >&2
            DRY_RUN_FAILED=1
        fi
        finish_step "${id}" PASS
        return
    fi
    if [ "${rc}" -ne 0 ]; then
        finish_step "${id}" FAIL "build_engines.sh exited with ${rc}"
        return
    fi
    local missing=()
    for file in target/config.json draft/config.json tokenizer/tokenizer.json tokenizer/special_tokens.json build-info.json; do
        [ -f "${output}/${file}" ] || missing+=("${file}")
    done
    {
        echo "== ${output}"
        du -sh "${output}/target" "${output}/draft" 2>/dev/null || true
        cat "${output}/build-info.json" 2>/dev/null || true
        echo
    } >>"${LOG}"
    if [ "${#missing[@]}" -gt 0 ]; then
        finish_step "${id}" FAIL "the build exited 0 but left no ${missing[*]}"
        return
    fi
    finish_step "${id}" PASS "built in $(($(date +%s) - STEP_START)) s"
}

step_build_bf16() {
    begin 2a
    build_engines 2a bfloat16 "${ENGINES_BF16}"
}

fp8_capable() {
    awk -v c="$1" 'BEGIN { n = split(c, p, "."); exit !(n == 2 && (p[1] > 8 || (p[1] == 8 && p[2] >= 9))) }'
}

# A small local calibration set (datasets.load_dataset reads train.jsonl with a
# "text" column), so the FP8 build downloads nothing.
write_calibration_set() {
    local i
    mkdir -p "${CALIB_DIR}"
    for ((i = 0; i < CALIB_SIZE; i++)); do
        case $((i % 4)) in
            0) printf '{"text": "def scale_%d(values):\\n    return [v * %d for v in values]\\n"}\n' "${i}" "${i}" ;;
            1) printf '{"text": "The function returns the sum of the first %d numbers, computed in one pass."}\n' "${i}" ;;
            2) printf '{"text": "for index in range(%d):\\n    print(index, index ** 2)\\n"}\n' "${i}" ;;
            3) printf '{"text": "class Counter%d:\\n    def __init__(self):\\n        self.count = %d\\n"}\n' "${i}" "${i}" ;;
        esac
    done >"${CALIB_DIR}/train.jsonl"
    chmod -R a+rX "${CALIB_DIR}"
}

step_build_fp8() {
    if [ "${SKIP_FP8}" = "1" ]; then
        skip 2b "--skip-fp8"
        return
    fi
    if [ "${DRY_RUN}" != "1" ]; then
        if [ "${IMAGE_OK}" != "1" ]; then
            skip 2b "no image (step 1)"
            return
        fi
        if [ -z "${COMPUTE_CAP}" ] || [ "${COMPUTE_CAP}" = "?" ]; then
            skip 2b "the GPU's compute capability is unknown (step 1 failed)"
            return
        fi
        if ! fp8_capable "${COMPUTE_CAP}"; then
            skip 2b "compute capability ${COMPUTE_CAP} is below 8.9: FP8 needs Ada or Hopper (H100: 9.0)"
            return
        fi
        if [ "$(budget 600)" -lt 180 ]; then
            skip 2b "less than 3 minutes left of --timeout-minutes ${TIMEOUT_MINUTES} (rerun with more)"
            return
        fi
    fi
    begin 2b
    local docker_extra=() calib="${CALIB_DATASET}"
    if [ -z "${calib}" ]; then
        write_calibration_set
        calib="${CALIB_DIR}"
    fi
    docker_extra=(-v "${calib}:/calibration:ro")
    say "  FP8 calibration: ${calib} (${CALIB_SIZE} samples)"
    build_engines 2b fp8 "${ENGINES_FP8}" "${docker_extra[@]}" -- --calib-dataset /calibration
}

# ---- step 3: the server ------------------------------------------------------------------------
server_state() {
    docker inspect --format '{{.State.Status}} {{.RestartCount}}' "${SERVER}" 2>/dev/null || echo "absent 0"
}

step_server() {
    local rc=0 started limit state restarts waited=0
    begin 3
    SPECDEC_API_KEY="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
    SPECDEC_ADMIN_KEY="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
    export SPECDEC_API_KEY SPECDEC_ADMIN_KEY
    started="$(date +%s)"
    CONTAINERS+=("${SERVER}")
    SERVER_STARTED=1
    # Detached; a container that exits is restarted (twice at most), as
    # Kubernetes restarts one. The keys reach it through the environment only.
    run_logged 60 docker run -d --name "${SERVER}" "${SECURE[@]}" --restart on-failure:2 \
        --gpus "${GPUS}" "${LIMITS[@]}" "${SCRATCH[@]}" -e PYTHONDONTWRITEBYTECODE=1 \
        -e SPECDEC_API_KEY -e SPECDEC_ADMIN_KEY \
        -p "127.0.0.1:${HTTP_PORT}:8000" -p "127.0.0.1:${GRPC_PORT}:8001" -p "127.0.0.1:${METRICS_PORT}:8002" \
        -p "127.0.0.1:${WATCHDOG_PORT}:8003" -p "127.0.0.1:${OPENAI_PORT}:9000" \
        -v "${ENGINES_BF16}:/opt/specdec/engines:ro" "${IMAGE}" \
        --exit-timeout-secs=300 \
        --backend-config=python,shm-default-byte-size=16777216 \
        --backend-config=python,shm-growth-byte-size=16777216 || rc=$?
    if [ "${DRY_RUN}" = "1" ]; then
        run_logged 10 docker exec --user 10001:10001 "${SERVER}" python3 -c \
            "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=5)"
        say "  (repeated every 3 s until it answers 200, the container stops, or the step's limit)"
        finish_step 3 PASS
        return
    fi
    if [ "${rc}" -ne 0 ]; then
        finish_step 3 FAIL "docker run exited with ${rc}"
        return
    fi
    limit="$(budget 600)"
    while true; do
        if timeout 15 docker exec --user 10001:10001 "${SERVER}" python3 -c \
            "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=5)" \
            >/dev/null 2>&1; then
            READY_SECONDS=$(($(date +%s) - started))
            break
        fi
        read -r state restarts <<<"$(server_state)"
        if [ "${state}" != "running" ] || [ "${restarts}" -gt 0 ]; then
            docker logs --tail 80 "${SERVER}" >>"${LOG}" 2>&1 || true
            finish_step 3 FAIL "the container stopped while starting (state ${state}, restarts ${restarts}; its log is in the excerpt)"
            return
        fi
        waited=$(($(date +%s) - started))
        if [ "${waited}" -ge "${limit}" ]; then
            docker logs --tail 80 "${SERVER}" >>"${LOG}" 2>&1 || true
            finish_step 3 FAIL "not ready after ${waited} s"
            return
        fi
        if [ $((waited % 30)) -lt 3 ] && [ "${waited}" -ge 30 ]; then
            say "  ... waiting for /v2/health/ready: ${waited} s; $(docker logs --tail 1 "${SERVER}" 2>&1 | cut -c1-90)"
        fi
        sleep 3
    done
    {
        echo "ready after ${READY_SECONDS} s"
        echo "== the server's log (last 25 lines)"
        docker logs --tail 25 "${SERVER}" 2>&1
    } >>"${LOG}"
    finish_step 3 PASS "ready ${READY_SECONDS} s after docker run"
}

# ---- steps 4 to 8: checks through tools/gpu_smoke.py --------------------------------------
# Usage: client_step <step> <cap seconds> <check> [args...]
client_step() {
    local id="$1" cap="$2" rc=0 limit
    shift 2
    begin "${id}"
    limit="$(budget "${cap}")"
    client "${limit}" "step-${id}" "$@" --grpc "127.0.0.1:${GRPC_PORT}" || rc=$?
    case "$(check_status "${rc}")" in
        PASS) finish_step "${id}" PASS ;;
        SKIP) finish_step "${id}" SKIP "$(tail -n 1 "${LOG}" | cut -c1-300)" ;;
        *) finish_step "${id}" FAIL "tools/gpu_smoke.py $1 exited with ${rc}" ;;
    esac
}

step_openai() {
    local rc=0
    begin 7a
    # pip installs as uid 10001 into HOME=/tmp (the container's tmpfs), then
    # the check runs; 77 (skip) when the package cannot be installed.
    # shellcheck disable=SC2016 # the script runs in the container, with its own arguments
    docker_run "$(budget 240)" "${PREFIX}-step-7a" --rm --network host "${SCRATCH[@]}" -e SPECDEC_API_KEY \
        -v "${SMOKE_PY}:${SMOKE_IN}:ro" --entrypoint bash "${IMAGE}" -c \
        'pip install --user --quiet --no-warn-script-location "openai==$1" || { echo "could not install openai==$1 (no network?)"; exit 77; }; exec python3 "$2" openai --url "$3"' \
        bash "${OPENAI_VERSION}" "${SMOKE_IN}" "http://127.0.0.1:${OPENAI_PORT}/v1" || rc=$?
    case "$(check_status "${rc}")" in
        PASS) finish_step 7a PASS ;;
        SKIP) finish_step 7a SKIP "$(tail -n 1 "${LOG}" | cut -c1-300)" ;;
        *) finish_step 7a FAIL "the openai check exited with ${rc}" ;;
    esac
}

step_nvidia_client() {
    local rc=0 mount=() given=()
    begin 7b
    if [ -n "${NVIDIA_CLIENT_FILE}" ]; then
        mount=(-v "${NVIDIA_CLIENT_FILE}:/opt/specdec/smoke/nvidia/end_to_end_grpc_client.py:ro")
        given=(--client /opt/specdec/smoke/nvidia/end_to_end_grpc_client.py)
    fi
    docker_run "$(budget 180)" "${PREFIX}-step-7b" --rm --network host "${SCRATCH[@]}" -e SPECDEC_API_KEY \
        -v "${SMOKE_PY}:${SMOKE_IN}:ro" "${mount[@]}" --entrypoint python3 "${IMAGE}" "${SMOKE_IN}" \
        nvidia-client --grpc "127.0.0.1:${GRPC_PORT}" "${given[@]}" || rc=$?
    case "$(check_status "${rc}")" in
        PASS) finish_step 7b PASS ;;
        SKIP) finish_step 7b SKIP "$(tail -n 1 "${LOG}" | cut -c1-400)" ;;
        *) finish_step 7b FAIL "the NVIDIA client check exited with ${rc}" ;;
    esac
}

# ---- step 9: kill the draft's executor worker ------------------------------------------
step_kill_draft() {
    local rc=0 pid nspid restarts_before restarts_after state processes killed_at outcome limit
    begin 9
    client "$(budget 120)" step-9-before drafting --grpc "127.0.0.1:${GRPC_PORT}" || rc=$?
    if [ "${rc}" -ne 0 ] && [ "${DRY_RUN}" != "1" ]; then
        finish_step 9 FAIL "speculative requests did not draft before the kill"
        return
    fi
    processes="${RUN_DIR}/processes-before-kill.txt"
    if [ "${DRY_RUN}" = "1" ]; then
        run_logged 30 docker top "${SERVER}" -eo pid,args
        run_logged 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits
    else
        read -r state restarts_before <<<"$(server_state)"
        {
            echo "=== docker top"
            timeout 30 docker top "${SERVER}" -eo pid,args 2>&1 || true
            echo "=== nvidia-smi"
            if command -v nvidia-smi >/dev/null 2>&1; then
                timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>&1 || true
            fi
        } >"${processes}"
        if ! grep -q -E '^[0-9]+, *[0-9]+' "${processes}"; then
            # No host nvidia-smi (or it lists nothing): ask from a container
            # in the host's process namespace, so it reports host pids.
            echo "=== nvidia-smi" >>"${processes}"
            CONTAINERS+=("${PREFIX}-nvidia-smi")
            timeout 60 docker run --rm --name "${PREFIX}-nvidia-smi" "${SECURE[@]}" --pid host --gpus "${GPUS}" \
                --entrypoint nvidia-smi "${IMAGE}" --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
                >>"${processes}" 2>&1 || true
        fi
        cat "${processes}" >>"${LOG}"
    fi
    rc=0
    if [ "${DRY_RUN}" != "1" ]; then
        RUN_STDIN="${processes}"
    fi
    CLIENT_OPTS=(-i)
    client 60 step-9-pick pick-worker || rc=$?
    CLIENT_OPTS=()
    RUN_STDIN=/dev/null
    if [ "${DRY_RUN}" = "1" ]; then
        # shellcheck disable=SC2016 # expanded by the container's sh
        run_logged 20 docker exec --user 10001:10001 "${SERVER}" sh -c 'kill -9 "$1"' sh "<the worker's pid in the container>"
        client 330 step-9-recovery recovery --grpc "127.0.0.1:${GRPC_PORT}" --killed-at "<time of the kill>" \
            --deadline 300 --metrics "http://127.0.0.1:${WATCHDOG_PORT}/metrics"
        finish_step 9 PASS
        return
    fi
    pid="$(sed -n 's/^DRAFT_WORKER_PID=//p' "${LOG}" | tail -n 1)"
    if [ "${rc}" -ne 0 ] || [ -z "${pid}" ]; then
        finish_step 9 FAIL "could not tell the draft's executor worker (see the process table in the excerpt)"
        return
    fi
    # The worker's pid inside the container (the last NSpid field), so the kill
    # runs in the container as its own user: no privileges needed.
    nspid="$(awk '/^NSpid:/ { print $NF }' "/proc/${pid}/status" 2>/dev/null || true)"
    echo "draft worker: host pid ${pid}, container pid ${nspid:-unknown}: $(tr '\0' ' ' <"/proc/${pid}/cmdline" 2>/dev/null)" >>"${LOG}"
    if [ -z "${nspid}" ]; then
        finish_step 9 FAIL "cannot read /proc/${pid}/status on the host to find the worker's pid in the container"
        return
    fi
    killed_at="$(date +%s.%N)"
    say "  kill -9 of the draft's executor worker (container pid ${nspid}, host pid ${pid})"
    rc=0
    # shellcheck disable=SC2016 # expanded by the container's sh
    run_logged 20 docker exec --user 10001:10001 "${SERVER}" sh -c 'kill -9 "$1"' sh "${nspid}" || rc=$?
    if [ "${rc}" -ne 0 ]; then
        finish_step 9 FAIL "kill -9 ${nspid} in the container failed (exit ${rc})"
        return
    fi
    rc=0
    limit="$(budget 330)"
    client "${limit}" step-9-recovery recovery --grpc "127.0.0.1:${GRPC_PORT}" --killed-at "${killed_at}" \
        --deadline "$((limit > 60 ? limit - 30 : 30))" --metrics "http://127.0.0.1:${WATCHDOG_PORT}/metrics" || rc=$?
    read -r state restarts_after <<<"$(server_state)"
    if [ "${restarts_after}" -gt "${restarts_before}" ]; then
        outcome="the container restarted (restarts ${restarts_before} -> ${restarts_after}, now ${state})"
    else
        outcome="no container restart (state ${state}): the engine watchdog reloaded the draft in place"
    fi
    {
        echo "== ${outcome}"
        echo "== the server's log since the kill (watchdog and errors, last 30 lines)"
        docker logs --since "${killed_at%.*}" "${SERVER}" 2>&1 | grep -i -E "watchdog|error|draft|restart" | tail -n 30
    } >>"${LOG}"
    local seconds
    seconds="$(sed -n 's/^RECOVERY_SECONDS=//p' "${LOG}" | tail -n 1)"
    if [ "${rc}" -eq 0 ]; then
        finish_step 9 PASS "drafting again ${seconds} s after the kill; ${outcome}"
    else
        finish_step 9 FAIL "$(sed -n 's/^RECOVERY: //p' "${LOG}" | tail -n 1); ${outcome}"
    fi
}

# ---- the report ---------------------------------------------------------------------------------
write_report() {
    local id passed=0 failed=0 skipped=0 lines total note dir mounts=""
    total=$(($(date +%s) - START_EPOCH))
    for id in "${STEP_ORDER[@]}"; do
        case "${STATUS[${id}]:-}" in
            PASS) passed=$((passed + 1)) ;;
            FAIL) failed=$((failed + 1)) ;;
            SKIP) skipped=$((skipped + 1)) ;;
        esac
    done
    {
        echo "# GPU smoke test report"
        echo
        if [ "${DRY_RUN}" = "1" ]; then
            echo "Dry run of \`docker/gpu-smoke.sh\`: the arguments and checkpoints were checked and"
            echo "build_engines.sh --dry-run ran; no container ran, so no step has a result."
        else
            echo "Written by \`docker/gpu-smoke.sh\`; paste it into docs/gpu.md under \"The GPU smoke test\"."
        fi
        echo
        echo "| | |"
        echo "|---|---|"
        echo "| date (UTC) | $(date -u +%Y-%m-%dT%H:%M:%SZ) |"
        echo "| command | \`${COMMAND_LINE}\` |"
        echo "| repository | $(git --no-optional-locks -C "${REPO_ROOT}" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git --no-optional-locks -C "${REPO_ROOT}" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)') |"
        echo "| host | $(uname -sr), ${CPUS} CPUs for the server |"
        echo "| image | ${IMAGE} (${IMAGE_ID}) |"
        echo "| GPU | ${GPU_NAME:-?}, compute capability ${COMPUTE_CAP:-?} |"
        echo "| driver, CUDA | driver ${DRIVER:-?} (CUDA ${CUDA_DRIVER:-?}); image CUDA ${CUDA_IMAGE:-?} |"
        echo "| TensorRT-LLM | ${TRTLLM_INSTALLED:-?} |"
        echo "| target, draft | ${TARGET_HF}, ${DRAFT_HF} |"
        echo "| total time | ${total} s (limit ${TIMEOUT_MINUTES} min) |"
        if [ "${DRY_RUN}" = "1" ]; then
            echo "| result | not run (dry run) |"
        else
            echo "| result | ${passed} passed, ${failed} failed, ${skipped} skipped |"
        fi
        echo
        echo "| step | | result | seconds | note |"
        echo "|---|---|---|---|---|"
        for id in "${STEP_ORDER[@]}"; do
            note="${NOTE[${id}]:-}"
            echo "| ${id} | ${TITLE[${id}]} | ${STATUS[${id}]:-not reached} | ${STEP_SECONDS[${id}]:-} | ${note//|/\\|} |"
        done
        for id in "${STEP_ORDER[@]}"; do
            echo
            echo "## ${id}. ${TITLE[${id}]}: ${STATUS[${id}]:-not reached}"
            echo
            echo "${WHAT[${id}]}"
            if [ -n "${NOTE[${id}]:-}" ]; then
                echo
                echo "**${NOTE[${id}]}**"
            fi
            if [ "${DRY_RUN}" != "1" ] && [ -s "${LOG_DIR}/step-${id}.log" ]; then
                lines=40
                [ "${STATUS[${id}]:-}" != "FAIL" ] || lines=60
                [ "${id}" != "1" ] || lines=90
                echo
                echo "Last ${lines} lines of its log (${LOG_DIR}/step-${id}.log):"
                echo
                echo '````text'
                # (the last line ends with a newline, so the fence closes on its own line)
                tail -n "${lines}" "${LOG_DIR}/step-${id}.log" | awk 1
                echo '````'
            fi
        done
        echo
        echo "---"
        echo
        echo "Logs: ${LOG_DIR}; the server's full log: ${RUN_DIR}/server.log."
        for dir in engines-bf16 engines-fp8 build-tmp; do
            [ ! -d "${RUN_DIR}/${dir}" ] || mounts+=" -v ${RUN_DIR}/${dir}:/owned/${dir}"
        done
        if [ -n "${mounts}" ]; then
            echo "The engines and scratch files the containers wrote belong to uid 10001; empty those directories with"
            echo "\`docker run --rm --user 10001:10001${mounts} --entrypoint find ${IMAGE} /owned -mindepth 2 -delete\`,"
            echo "then \`rm -rf ${RUN_DIR}\`."
        else
            echo "Remove the run directory with \`rm -rf ${RUN_DIR}\`."
        fi
    } >"${REPORT}"
    REPORT_WRITTEN=1
}

cleanup() {
    local rc=$? name failed=0 id
    trap - EXIT INT TERM
    # The command that was running when the run stopped (its timeout process,
    # which passes the signal on), then the containers.
    stop_heartbeat
    if [ -n "${RUN_PID}" ]; then
        kill "${RUN_PID}" 2>/dev/null || true
    fi
    if [ -n "${CURRENT_STEP}" ]; then
        echo "gpu-smoke: the run stopped during this step (interrupted, or an error in the script: exit ${rc})" >>"${LOG}"
        finish_step "${CURRENT_STEP}" FAIL "the run stopped during this step (exit ${rc})"
    fi
    if [ "${DRY_RUN}" != "1" ]; then
        if [ "${SERVER_STARTED}" = "1" ]; then
            docker logs "${SERVER}" >"${RUN_DIR}/server.log" 2>&1 || true
        fi
        if [ "${#CONTAINERS[@]}" -gt 0 ]; then
            for name in "${CONTAINERS[@]}"; do
                docker rm -f "${name}" >/dev/null 2>&1 || true
            done
        fi
    fi
    [ "${REPORT_WRITTEN}" = "1" ] || write_report
    for id in "${STEP_ORDER[@]}"; do
        [ "${STATUS[${id}]:-}" != "FAIL" ] || failed=1
    done
    say "report: ${REPORT}"
    if [ "${DRY_RUN}" = "1" ]; then
        [ "${DRY_RUN_FAILED}" = "0" ] || exit 1
        exit 0
    fi
    [ "${rc}" -eq 0 ] || [ "${rc}" -eq 1 ] || exit "${rc}"
    exit "${failed}"
}

# ---- the run ---------------------------------------------------------------------------------------
DRY_RUN_FAILED=0
READY_SECONDS=""
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "${DRY_RUN}" = "1" ]; then
    say "dry run: nothing runs; every docker command is printed as '+ ...'"
fi
say "run directory ${RUN_DIR}; report ${REPORT}; limit ${TIMEOUT_MINUTES} min"
say "image ${IMAGE}; target ${TARGET_HF}; draft ${DRAFT_HF}; GPUs ${GPUS}"

step_environment
if [ "${DRY_RUN}" != "1" ] && { [ "${DOCKER_OK}" != "1" ] || [ "${IMAGE_OK}" != "1" ]; }; then
    for id in 2a 3 4 5 6 7a 7b 8 9 2b; do
        skip "${id}" "no Docker or no image (step 1)"
    done
    exit 1
fi

step_build_bf16
if [ "${DRY_RUN}" = "1" ] || [ "${STATUS[2a]:-}" = "PASS" ]; then
    if [ "${DRY_RUN}" = "1" ] || [ "$(budget 600)" -ge 120 ]; then
        step_server
    else
        skip 3 "less than 2 minutes left of --timeout-minutes ${TIMEOUT_MINUTES}"
    fi
else
    skip 3 "no engines (step 2a failed)"
fi

server_ready=0
if [ "${DRY_RUN}" = "1" ] || [ "${STATUS[3]:-}" = "PASS" ]; then
    server_ready=1
fi
for id in 4 5 6 7a 7b 8 9; do
    if [ "${server_ready}" != "1" ]; then
        skip "${id}" "the server did not become ready (step 3)"
        continue
    fi
    if [ "${DRY_RUN}" != "1" ] && [ "$(budget 600)" -lt 30 ]; then
        skip "${id}" "--timeout-minutes ${TIMEOUT_MINUTES} reached"
        continue
    fi
    case "${id}" in
        4) client_step 4 120 engine-calls ;;
        5) client_step 5 300 agreement ;;
        6) client_step 6 300 distribution ;;
        7a) step_openai ;;
        7b) step_nvidia_client ;;
        8) client_step 8 240 concurrency ;;
        9) step_kill_draft ;;
    esac
done

# The server is done with: stop it, so the FP8 build has the GPU to itself.
if [ "${DRY_RUN}" != "1" ] && [ "${SERVER_STARTED}" = "1" ]; then
    say "stopping the server"
    docker logs "${SERVER}" >"${RUN_DIR}/server.log" 2>&1 || true
    timeout 60 docker rm -f "${SERVER}" >/dev/null 2>&1 || true
    SERVER_STARTED=0
fi
step_build_fp8
# The exit status comes from the steps' results (cleanup, on EXIT).
:
