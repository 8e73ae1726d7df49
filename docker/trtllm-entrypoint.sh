#!/usr/bin/env bash
# Entry point of the trtllm-profile image: checks the mounted engines, then starts
# Triton with the trtllm configs (model_repository/<model>/configs/trtllm.pbtxt)
# and, next to it, the OpenAI-compatible API (frontend/) on SPECDEC_OPENAI_PORT
# (9000; 0 = none) and the engine watchdog (selfheal/; SPECDEC_WATCHDOG=0: none),
# as specdec-serve does in the cpu profile.
#
# Engines are mounted at ${SPECDEC_ENGINE_DIR} (default /opt/specdec/engines) as
# written by docker/build_engines.sh: target/, draft/, tokenizer/, build-info.json.
# Extra arguments are passed to tritonserver (e.g. --log-verbose=1).
set -euo pipefail

ENGINE_DIR="${SPECDEC_ENGINE_DIR:-/opt/specdec/engines}"
MODEL_REPOSITORY="${SPECDEC_MODEL_REPOSITORY:-/opt/specdec/model_repository}"
export SPECDEC_TOKENIZER_DIR="${SPECDEC_TOKENIZER_DIR:-${ENGINE_DIR}/tokenizer}"
OPENAI_PORT="${SPECDEC_OPENAI_PORT:-9000}"
WATCHDOG_PORT="${SPECDEC_WATCHDOG_PORT:-8003}"
# Seconds an engine may stay down (its reload included) before the watchdog's
# /livez fails and the container is restarted: a reload that hangs never
# ends on its own (Triton keeps a decoupled model unloading while calls to it
# are open, triton-inference-server/server#7626). Loading an engine takes
# seconds to a couple of minutes; 0: no limit.
ENGINE_DOWN_LIMIT="${SPECDEC_ENGINE_DOWN_LIMIT:-180}"

die() {
    echo "specdec-trtllm: error: $*" >&2
    exit 1
}

# The TensorRT-LLM release rule (trtllm_release), shared with build_engines.sh;
# it sits next to this script in the image (/opt/specdec/docker/).
TRTLLM_RELEASE_LIB="$(dirname "${BASH_SOURCE[0]}")/trtllm-release.sh"
[ -f "${TRTLLM_RELEASE_LIB}" ] \
    || die "${TRTLLM_RELEASE_LIB} is missing: docker/trtllm-release.sh must be next to this script"
# shellcheck source=trtllm-release.sh source-path=SCRIPTDIR
source "${TRTLLM_RELEASE_LIB}"

# The tensorrtllm configs point at /opt/specdec/engines/{target,draft}.
if [ "${ENGINE_DIR}" != "/opt/specdec/engines" ]; then
    die "engines must be mounted at /opt/specdec/engines (the path in configs/trtllm.pbtxt)"
fi
for engine in target draft; do
    [ -f "${ENGINE_DIR}/${engine}/config.json" ] \
        || die "no ${engine} engine in ${ENGINE_DIR}/${engine}: build it with docker/build_engines.sh and mount the output at ${ENGINE_DIR}"
done
for file in tokenizer.json special_tokens.json; do
    [ -f "${SPECDEC_TOKENIZER_DIR}/${file}" ] \
        || die "no ${file} in ${SPECDEC_TOKENIZER_DIR} (written by docker/build_engines.sh)"
done
case "${OPENAI_PORT}" in
    "" | *[!0-9]*) die "SPECDEC_OPENAI_PORT must be a port number (0: no OpenAI API), got '${OPENAI_PORT}'" ;;
esac
case "${WATCHDOG_PORT}" in
    "" | *[!0-9]*) die "SPECDEC_WATCHDOG_PORT must be a port number (0: no watchdog metrics), got '${WATCHDOG_PORT}'" ;;
esac
case "${ENGINE_DOWN_LIMIT}" in
    "" | *[!0-9]*) die "SPECDEC_ENGINE_DOWN_LIMIT must be a whole number of seconds (0: no limit), got '${ENGINE_DOWN_LIMIT}'" ;;
esac

# Engines load only in the TensorRT-LLM release that built them; a post-release
# or local build of that release (0.17.0.post1, 0.17.0+local) counts as the same.
# Usage: check_engine_release <build-info.json>
check_engine_release() {
    local built installed release
    built="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["tensorrt_llm_version"])' "$1")" \
        || die "cannot read tensorrt_llm_version from $1"
    installed="$(python3 -c 'from importlib.metadata import version; print(version("tensorrt_llm"))')" \
        || die "the tensorrt_llm Python package is not installed"
    release="$(trtllm_release "${built}")" \
        || die "$1 names TensorRT-LLM '${built}', which is not a release version: rebuild the engines"
    if [ "$(trtllm_release "${installed}" || true)" != "${release}" ]; then
        die "engines were built with TensorRT-LLM ${built}, this image has ${installed}, a different release" \
            "(an engine loads only in the release that built it; post-releases and local builds of that release" \
            "are accepted): rebuild them with docker/build_engines.sh inside this image"
    fi
}

if [ -f "${ENGINE_DIR}/build-info.json" ]; then
    check_engine_release "${ENGINE_DIR}/build-info.json"
fi

# Triton's admin APIs answer only requests carrying the header
# `specdec-admin-key: <key>`; health and metadata stay open, and inference
# needs the API key (below). Every
# model loads at start (--model-control-mode=explicit --load-model=*); loading
# and unloading are model-repository calls, so only the key opens them: the
# engine watchdog below reloads a dead engine with it. The
# key comes from SPECDEC_ADMIN_KEY (Kubernetes: the Secret triton-specdec-admin);
# without it a random key is made for this run and shown nowhere, which closes
# the admin APIs. The list equals RESTRICTED_APIS in launcher/launch.py
# (the cpu image's launcher; tests/unit/test_security_config.py keeps them equal).
RESTRICTED_APIS="model-repository,model-config,shared-memory,statistics,trace,logging"
ADMIN_KEY_HEADER="specdec-admin-key"
admin_key="${SPECDEC_ADMIN_KEY:-}"
unset SPECDEC_ADMIN_KEY  # tritonserver's flags get it; the models' environment does not
if [ -z "${admin_key}" ]; then
    admin_key="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
fi
case "${admin_key}" in
    *[!A-Za-z0-9._~+/-]*) die "SPECDEC_ADMIN_KEY may only contain letters, digits and ._~+/- (e.g. openssl rand -hex 32)" ;;
esac
if [ "${#admin_key}" -lt 16 ] || [ "${#admin_key}" -gt 256 ]; then
    die "SPECDEC_ADMIN_KEY must be 16 to 256 characters long"
fi
restricted="${RESTRICTED_APIS}:${ADMIN_KEY_HEADER}=${admin_key}"

# Inference (HTTP infer/generate, gRPC) answers only requests carrying the
# header `specdec-api-key: <key>`; the OpenAI frontend asks its clients for the
# same key (Authorization: Bearer) and passes it on. The key comes from
# SPECDEC_API_KEY (Kubernetes: the Secret triton-specdec-api) or from the file
# SPECDEC_API_KEY_FILE names (the Secret mounted as a volume); without either
# the container refuses to start unless SPECDEC_ALLOW_OPEN_INFERENCE=1 (a
# gateway in front authenticates callers). A setting that is set but empty,
# both at once, or a file that cannot be read stops it by name. As INFERENCE_APIS and check_access in
# launcher/launch.py (tests/unit/test_security_config.py keeps them equal).
INFERENCE_APIS="inference"
API_KEY_HEADER="specdec-api-key"
if [ -n "${SPECDEC_API_KEY_FILE+set}" ]; then
    [ -z "${SPECDEC_API_KEY+set}" ] || die "set SPECDEC_API_KEY or SPECDEC_API_KEY_FILE, not both"
    [ -n "${SPECDEC_API_KEY_FILE}" ] || die "SPECDEC_API_KEY_FILE is set but empty: name the file that holds the key, or unset it"
    [ -r "${SPECDEC_API_KEY_FILE}" ] || die "SPECDEC_API_KEY_FILE: cannot read ${SPECDEC_API_KEY_FILE}"
    api_key="$(tr -d '[:space:]' < "${SPECDEC_API_KEY_FILE}")"
    [ -n "${api_key}" ] || die "SPECDEC_API_KEY_FILE: ${SPECDEC_API_KEY_FILE} is empty; it must hold the key"
else
    if [ -n "${SPECDEC_API_KEY+set}" ] && [ -z "${SPECDEC_API_KEY//[[:space:]]/}" ]; then
        die "SPECDEC_API_KEY is set but empty: set a key (e.g. openssl rand -hex 32), or unset it"
    fi
    api_key="${SPECDEC_API_KEY:-}"
fi
unset SPECDEC_API_KEY SPECDEC_API_KEY_FILE  # tritonserver's flags, the frontend and the watchdog get it; the models do not
inference_flags=()
if [ -n "${api_key}" ]; then
    case "${api_key}" in
        *[!A-Za-z0-9._~+/-]*) die "SPECDEC_API_KEY may only contain letters, digits and ._~+/- (e.g. openssl rand -hex 32)" ;;
    esac
    if [ "${#api_key}" -lt 16 ] || [ "${#api_key}" -gt 256 ]; then
        die "SPECDEC_API_KEY must be 16 to 256 characters long"
    fi
    [ "${api_key}" != "${admin_key}" ] \
        || die "SPECDEC_API_KEY must differ from SPECDEC_ADMIN_KEY: every client holds the API key, and the admin key opens model loading"
    inference_restricted="${INFERENCE_APIS}:${API_KEY_HEADER}=${api_key}"
    inference_flags=("--http-restricted-api=${inference_restricted}" "--grpc-restricted-protocol=${inference_restricted}")
elif [ "${SPECDEC_ALLOW_OPEN_INFERENCE:-}" != "1" ]; then
    die "SPECDEC_API_KEY is not set: inference would be open to everyone who can reach the ports;" \
        "set it (Kubernetes: the Secret triton-specdec-api), or SPECDEC_ALLOW_OPEN_INFERENCE=1 if a gateway in front authenticates callers"
fi

# Two TensorRT-LLM models in one server need orchestrator mode: each model's
# executor runs in a worker process spawned through MPI (as NVIDIA's
# launch_triton_server.py --multi-model does), hence mpirun -n 1.
export TRTLLM_ORCHESTRATOR=1
export TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1
# The orchestrator and its workers talk through OpenMPI, here as the
# unprivileged user with every capability dropped and a read-only root
# filesystem (k8s/base/deployment.yaml). OpenMPI's session directory goes to
# TMPDIR (/tmp, writable). Its shared-memory transport copies large messages
# with process_vm_readv (CMA), which needs ptrace rights over the peer: the
# workers are spawned by OpenMPI's daemon, not by tritonserver, so with the
# usual Yama ptrace_scope 1 and no CAP_SYS_PTRACE (a non-root process gets no
# added capability in Kubernetes anyway) the copy would fail. Without it,
# messages go through the /dev/shm segment in two copies instead of one.
export TMPDIR="${TMPDIR:-/tmp}"
export OMPI_MCA_btl_vader_single_copy_mechanism=none

cuda_pools=()
gpu_count="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
for ((gpu = 0; gpu < gpu_count; gpu++)); do
    cuda_pools+=("--cuda-memory-pool-byte-size=${gpu}:0")
done

# tritonserver, the OpenAI frontend and the engine watchdog run side by side;
# a signal goes to all (Triton drains in-flight streams, uvicorn finishes its
# open responses), and whichever exits first stops the others: a pod whose
# OpenAI port died would otherwise pass the probes, which ask Triton, and the
# watchdog exits when reloading an engine did not keep it up, so the container
# restarts whole.
children=()

# The Python-backend stubs' regions in /dev/shm (prefix specdec_trtllm_, below): Triton
# removes them when it unloads a model, not when it exits on its exit timeout
# (after an engine crash it waits for calls that will never be answered). The
# pod's /dev/shm volume outlives the container, so a restart would inherit them;
# nothing else in this pod uses the prefix.
remove_shm_regions() {
    rm -f /dev/shm/specdec_trtllm_*
}
remove_shm_regions

stop_children() {
    local pid
    for pid in "${children[@]}"; do
        kill -TERM "${pid}" 2>/dev/null || true
    done
}
trap stop_children TERM INT

mpirun --allow-run-as-root -n 1 \
    tritonserver \
    --model-repository="${MODEL_REPOSITORY}" \
    --model-config-name=trtllm \
    --model-control-mode=explicit \
    --load-model='*' \
    --http-restricted-api="${restricted}" \
    --grpc-restricted-protocol="${restricted}" \
    "${inference_flags[@]}" \
    --disable-auto-complete-config \
    --http-port=8000 \
    --grpc-port=8001 \
    --metrics-port=8002 \
    --pinned-memory-pool-byte-size=0 \
    --enable-peer-access=false \
    "${cuda_pools[@]}" \
    --backend-config=python,shm-region-prefix-name=specdec_trtllm_ \
    "$@" &
children+=("$!")

# The tokenizer directory build_engines.sh wrote holds the chat template too;
# the frontend listens once the coordinator is ready (engines load for minutes).
# It gets the API key in its environment, never on its command line.
if [ "${OPENAI_PORT}" != "0" ]; then
    SPECDEC_API_KEY="${api_key}" python3 -m frontend.openai_server --host 0.0.0.0 --port "${OPENAI_PORT}" --grpc-url 127.0.0.1:8001 \
        --tokenizer-dir "${SPECDEC_TOKENIZER_DIR}" --wait-for-server 3600 &
    children+=("$!")
fi

# The engine watchdog: a one-token probe straight to target and draft every
# 5 s; an engine that fails two in a row (an executor or orchestrator process
# died, or it stopped answering for 30 s) is loaded again through the
# model-repository API (the target unloaded first, so the server is not ready
# meanwhile; the draft in place). Its /livez on the watchdog port is the
# Kubernetes liveness probe: tritonserver live, and no engine down for longer
# than SPECDEC_ENGINE_DOWN_LIMIT. Only this process gets the admin key, in its own
# environment (the watchdog drops it and the API key, which its probes send, from
# there at start).
if [ "${SPECDEC_WATCHDOG:-1}" != "0" ]; then
    SPECDEC_ADMIN_KEY="${admin_key}" SPECDEC_API_KEY="${api_key}" python3 -m selfheal.watchdog --detect probe --probe-interval 5 \
        --probe-timeout 30 --load-timeout 600 --down-limit "${ENGINE_DOWN_LIMIT}" --wait-for-server 3600 \
        --metrics-address 0.0.0.0 --metrics-port "${WATCHDOG_PORT}" &
    children+=("$!")
fi

status=0
wait -n || status=$?
stop_children
wait || true
remove_shm_regions
exit "${status}"
