#!/usr/bin/env bash
# Builds the TensorRT-LLM engines of the trtllm profile from two Hugging Face
# checkpoints (same tokenizer, same vocabulary): the target and the draft.
#
# Run it on a GPU node inside the serving image (docker/Dockerfile.trtllm), so the
# engines are built by exactly the TensorRT-LLM version that will load them:
#
#   docker run --rm --gpus all --shm-size=2g --user "$(id -u):$(id -g)" \
#     -v /models:/models:ro -v /srv/specdec/engines:/opt/specdec/engines \
#     --entrypoint /opt/nvidia/nvidia_entrypoint.sh specdec-trtllm:0.1.0 \
#     /opt/specdec/docker/build_engines.sh \
#     --target-hf /models/Qwen2.5-Coder-1.5B-Instruct \
#     --draft-hf /models/Qwen2.5-Coder-0.5B-Instruct \
#     --output /opt/specdec/engines
#
# It writes <output>/target, <output>/draft (engines), <output>/tokenizer
# (tokenizer.json + special_tokens.json for the coordinator) and
# <output>/build-info.json, the layout the trtllm configs expect.
#
# What it guarantees (a target engine built without draft support fails at the
# first speculative request, tensorrtllm_backend#473):
#   target: --speculative_decoding_mode draft_tokens_external and --max_draft_len
#           >= the coordinator's speculation_window (read from the model repository),
#           --gather_generation_logits (draft-target runs can hang without it),
#           --use_paged_context_fmha enable (KV-cache reuse between rounds);
#   draft:  --gather_generation_logits (its probabilities make lossless sampling
#           possible), --use_paged_context_fmha enable;
#   both:   --logits_dtype float32 (the configs declare FP32 logits), and a tensor
#           parallel size that divides the model's attention and KV head counts
#           (read from each checkpoint's config.json; refused before converting).
# --dry-run prints every command instead of running it (no GPU needed); it still
# reads the checkpoints' config.json and refuses what a real build would.
set -euo pipefail

# ---- defaults (every one can also be given as a flag; see usage) ----------
# Largest number of draft tokens the target engine accepts per request. Must be
# >= speculation_window in model_repository/coordinator/configs/*.pbtxt.
MAX_DRAFT_LEN="${MAX_DRAFT_LEN:-8}"
# Sequences in flight per engine; equal to max_batch_size in configs/trtllm.pbtxt.
MAX_BATCH_SIZE="${MAX_BATCH_SIZE:-64}"
# Longest request the coordinator sends (its max_context_tokens).
MAX_INPUT_LEN="${MAX_INPUT_LEN:-4096}"
# Input plus output: max_input_len + max_draft_len + 1 at least; rounded up.
MAX_SEQ_LEN="${MAX_SEQ_LEN:-4608}"
# Tokens per engine step over all sequences (prefill chunks plus k+1 per round).
MAX_NUM_TOKENS="${MAX_NUM_TOKENS:-8192}"
# bfloat16 (A100 and H100), float16, or fp8 (H100/Hopper and newer only).
DTYPE="${DTYPE:-bfloat16}"
DRAFT_DTYPE="${DRAFT_DTYPE:-}"
# Weight-only quantization of the draft's GEMMs: none, int8 or int4 (activations
# stay in --draft-dtype; convert_checkpoint.py --use_weight_only). Only the draft:
# the target verifies every draft token, so the draft's precision changes the
# acceptance rate, never the output. Off by default: the CPU engine's draft runs
# int4 weights (model_repository/draft/configs/cpu.pbtxt has the measurements),
# but on a GPU a 0.5B draft's step is mostly launch latency at small batch, and
# this option has not been run on a GPU here: measure acceptance and tokens/s first.
DRAFT_WEIGHT_ONLY="${DRAFT_WEIGHT_ONLY:-none}"
# Tensor parallelism of each engine (GPUs per engine).
TP_SIZE="${TP_SIZE:-1}"
DRAFT_TP_SIZE="${DRAFT_TP_SIZE:-1}"
# Directory name of the model family in TensorRT-LLM's examples (qwen, llama, ...).
MODEL_FAMILY="${MODEL_FAMILY:-qwen}"
# The TensorRT-LLM release inside the pinned serving image (docker/VERSIONS.md);
# post-releases and local builds of it (0.17.0.post1, 0.17.0+local) are accepted.
TRTLLM_VERSION="${TRTLLM_VERSION:-0.17.0}"
# A checkout of TensorRT-LLM at that release; cloned into the work dir if unset.
TRTLLM_EXAMPLES_DIR="${TRTLLM_EXAMPLES_DIR:-}"
# Where the coordinator's configs are, to check speculation_window.
MODEL_REPOSITORY="${MODEL_REPOSITORY:-}"
# FP8 calibration data: a local directory that datasets.load_dataset reads
# with a "train" split and a "text" column (e.g. train.jsonl, one {"text": ...}
# per line); default: quantize.py's own, cnn_dailymail from the Hugging Face Hub.
CALIB_DATASET="${CALIB_DATASET:-}"
CALIB_SIZE="${CALIB_SIZE:-512}"
WORK_DIR="${WORK_DIR:-}"
KEEP_CHECKPOINTS="${KEEP_CHECKPOINTS:-0}"
DRY_RUN="${DRY_RUN:-0}"

TARGET_HF=""
DRAFT_HF=""
OUTPUT_DIR=""

usage() {
    cat <<EOF
usage: $(basename "$0") --target-hf DIR --draft-hf DIR --output DIR [options]

  --target-hf DIR         Hugging Face checkpoint of the target (large) model
  --draft-hf DIR          Hugging Face checkpoint of the draft (small) model
  --output DIR            where target/, draft/, tokenizer/ are written
  --dtype D               bfloat16 | float16 | fp8            (default ${DTYPE})
  --draft-dtype D         dtype of the draft if different     (default: --dtype)
  --draft-weight-only P   none | int8 | int4: weight-only quantized draft
                          GEMMs (bfloat16/float16 draft only)  (default ${DRAFT_WEIGHT_ONLY})
  --tp-size N             tensor parallelism of the target    (default ${TP_SIZE})
  --draft-tp-size N       tensor parallelism of the draft     (default ${DRAFT_TP_SIZE})
  --max-draft-len N       target's maximum draft length       (default ${MAX_DRAFT_LEN})
  --max-batch-size N      in-flight sequences per engine      (default ${MAX_BATCH_SIZE})
  --max-input-len N       longest request in tokens           (default ${MAX_INPUT_LEN})
  --max-seq-len N         longest request plus output         (default ${MAX_SEQ_LEN})
  --max-num-tokens N      tokens per engine step              (default ${MAX_NUM_TOKENS})
  --model-family NAME     TensorRT-LLM examples/<NAME>        (default ${MODEL_FAMILY})
  --examples-dir DIR      TensorRT-LLM checkout (v${TRTLLM_VERSION}); cloned if absent
  --model-repository DIR  model repository to check speculation_window against
  --calib-dataset DIR     FP8 calibration dataset (local)
  --work-dir DIR          scratch space for converted checkpoints
  --keep-checkpoints      keep the converted checkpoints
  --dry-run               print the commands, run nothing
EOF
}

die() {
    echo "build_engines: error: $*" >&2
    exit 1
}

log() {
    echo "build_engines: $*" >&2
}

# The TensorRT-LLM release rule (trtllm_release), shared with the entrypoint; it
# sits next to this script, here and in the image (/opt/specdec/docker/).
TRTLLM_RELEASE_LIB="$(dirname "${BASH_SOURCE[0]}")/trtllm-release.sh"
[ -f "${TRTLLM_RELEASE_LIB}" ] \
    || die "${TRTLLM_RELEASE_LIB} is missing: docker/trtllm-release.sh must be next to this script"
# shellcheck source=trtllm-release.sh source-path=SCRIPTDIR
source "${TRTLLM_RELEASE_LIB}"

# Runs a command, or prints it (shell-quoted) with --dry-run.
run() {
    if [ "${DRY_RUN}" = "1" ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

require_value() {
    if [ "$#" -lt 2 ] || [ -z "$2" ]; then
        die "$1 needs a value"
    fi
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        --target-hf) require_value "$@"; TARGET_HF="$2"; shift 2 ;;
        --draft-hf) require_value "$@"; DRAFT_HF="$2"; shift 2 ;;
        --output) require_value "$@"; OUTPUT_DIR="$2"; shift 2 ;;
        --dtype) require_value "$@"; DTYPE="$2"; shift 2 ;;
        --draft-dtype) require_value "$@"; DRAFT_DTYPE="$2"; shift 2 ;;
        --draft-weight-only) require_value "$@"; DRAFT_WEIGHT_ONLY="$2"; shift 2 ;;
        --tp-size) require_value "$@"; TP_SIZE="$2"; shift 2 ;;
        --draft-tp-size) require_value "$@"; DRAFT_TP_SIZE="$2"; shift 2 ;;
        --max-draft-len) require_value "$@"; MAX_DRAFT_LEN="$2"; shift 2 ;;
        --max-batch-size) require_value "$@"; MAX_BATCH_SIZE="$2"; shift 2 ;;
        --max-input-len) require_value "$@"; MAX_INPUT_LEN="$2"; shift 2 ;;
        --max-seq-len) require_value "$@"; MAX_SEQ_LEN="$2"; shift 2 ;;
        --max-num-tokens) require_value "$@"; MAX_NUM_TOKENS="$2"; shift 2 ;;
        --model-family) require_value "$@"; MODEL_FAMILY="$2"; shift 2 ;;
        --examples-dir) require_value "$@"; TRTLLM_EXAMPLES_DIR="$2"; shift 2 ;;
        --model-repository) require_value "$@"; MODEL_REPOSITORY="$2"; shift 2 ;;
        --calib-dataset) require_value "$@"; CALIB_DATASET="$2"; shift 2 ;;
        --no-target-logits)
            die "--no-target-logits is not supported: the target always gathers generation logits, because draft-target speculative decoding in TensorRT-LLM can hang when the target engine does not" ;;
        --work-dir) require_value "$@"; WORK_DIR="$2"; shift 2 ;;
        --keep-checkpoints) KEEP_CHECKPOINTS=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

DRAFT_DTYPE="${DRAFT_DTYPE:-${DTYPE}}"

# ---- validate the arguments ----------------------------------------------------
[ -n "${TARGET_HF}" ] || { usage >&2; die "--target-hf is required"; }
[ -n "${DRAFT_HF}" ] || { usage >&2; die "--draft-hf is required"; }
[ -n "${OUTPUT_DIR}" ] || { usage >&2; die "--output is required"; }
for checkpoint in "${TARGET_HF}" "${DRAFT_HF}"; do
    [ -f "${checkpoint}/config.json" ] || die "${checkpoint} is not a Hugging Face checkpoint (no config.json)"
done

is_positive_int() {
    case "$1" in
        '' | *[!0-9]*) return 1 ;;
        *) [ "$1" -gt 0 ] ;;
    esac
}
for pair in "max-draft-len:${MAX_DRAFT_LEN}" "max-batch-size:${MAX_BATCH_SIZE}" \
    "max-input-len:${MAX_INPUT_LEN}" "max-seq-len:${MAX_SEQ_LEN}" \
    "max-num-tokens:${MAX_NUM_TOKENS}" "tp-size:${TP_SIZE}" \
    "draft-tp-size:${DRAFT_TP_SIZE}" "calib-size:${CALIB_SIZE}"; do
    is_positive_int "${pair#*:}" || die "--${pair%%:*} must be a positive integer, got '${pair#*:}'"
done
for dtype in "${DTYPE}" "${DRAFT_DTYPE}"; do
    case "${dtype}" in
        bfloat16 | float16 | fp8) ;;
        *) die "dtype must be bfloat16, float16 or fp8, got '${dtype}'" ;;
    esac
done
case "${DRAFT_WEIGHT_ONLY}" in
    none | int8 | int4) ;;
    *) die "--draft-weight-only must be none, int8 or int4, got '${DRAFT_WEIGHT_ONLY}'" ;;
esac
if [ -n "${CALIB_DATASET}" ]; then
    [ -d "${CALIB_DATASET}" ] \
        || die "--calib-dataset ${CALIB_DATASET} is not a directory: give a local dataset directory with a train split and a text column (e.g. train.jsonl)"
    [ "${DTYPE}" = "fp8" ] || [ "${DRAFT_DTYPE}" = "fp8" ] \
        || log "warning: --calib-dataset is used only by fp8 builds; this build is ${DTYPE}/${DRAFT_DTYPE}"
elif [ "${DTYPE}" = "fp8" ] || [ "${DRAFT_DTYPE}" = "fp8" ]; then
    log "fp8 calibration downloads cnn_dailymail from the Hugging Face Hub (HTTPS); without network, pass --calib-dataset DIR"
fi
if [ "${DRAFT_WEIGHT_ONLY}" != "none" ] && [ "${DRAFT_DTYPE}" = "fp8" ]; then
    die "--draft-weight-only ${DRAFT_WEIGHT_ONLY} needs a bfloat16 or float16 draft (--draft-dtype), not fp8"
fi
[ "${MAX_SEQ_LEN}" -ge $((MAX_INPUT_LEN + MAX_DRAFT_LEN + 1)) ] \
    || die "--max-seq-len (${MAX_SEQ_LEN}) must be >= max-input-len + max-draft-len + 1 ($((MAX_INPUT_LEN + MAX_DRAFT_LEN + 1)))"
[ "${MAX_NUM_TOKENS}" -ge "${MAX_INPUT_LEN}" ] \
    || die "--max-num-tokens (${MAX_NUM_TOKENS}) must be >= --max-input-len (${MAX_INPUT_LEN}) (no chunked context)"

# Tensor parallelism gives each GPU whole attention heads and whole KV heads, so
# the TP size must divide both counts of the model (Qwen2.5-Coder-0.5B: 14 and 2;
# 1.5B: 12 and 2). Refused here, before anything is converted and with --dry-run
# too, instead of deep inside the conversion.

# Prints "<num_attention_heads> <num_key_value_heads>" of a Hugging Face
# config.json (no num_key_value_heads: one KV head per attention head, as in
# transformers), or nothing when it has no num_attention_heads.
attention_heads() {
    python3 - "$1" <<'PY'
import json
import sys

with open(sys.argv[1], encoding="utf-8") as f:
    config = json.load(f)
heads = config.get("num_attention_heads")
if heads is None:
    sys.exit(0)
kv_heads = config.get("num_key_value_heads") or heads
for value in (heads, kv_heads):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        sys.exit(f"num_attention_heads {heads!r} / num_key_value_heads {kv_heads!r} are not positive integers")
print(heads, kv_heads)
PY
}

# Usage: check_tp_split <role> <hf dir> <tp size> <option>
check_tp_split() {
    local role="$1" hf="$2" tp="$3" option="$4" counts heads kv_heads
    command -v python3 >/dev/null 2>&1 || die "python3 is needed to read ${hf}/config.json"
    counts="$(attention_heads "${hf}/config.json")" \
        || die "cannot read the attention head counts of the ${role} from ${hf}/config.json"
    if [ -z "${counts}" ]; then
        log "warning: no num_attention_heads in ${hf}/config.json; ${option} not checked against the ${role}'s heads"
        return 0
    fi
    read -r heads kv_heads <<<"${counts}"
    if [ $((heads % tp)) -ne 0 ] || [ $((kv_heads % tp)) -ne 0 ]; then
        die "${option} ${tp} does not divide the attention heads of the ${role} model ${hf}" \
            "(num_attention_heads ${heads}, num_key_value_heads ${kv_heads}): every GPU must hold whole heads;" \
            "use a tensor-parallel size that divides both"
    fi
}
check_tp_split target "${TARGET_HF}" "${TP_SIZE}" --tp-size
check_tp_split draft "${DRAFT_HF}" "${DRAFT_TP_SIZE}" --draft-tp-size

# The coordinator's server-wide settings must fit the engines: a window above the
# target's max_draft_len, or a context above max_input_len, fails at request time.
# Reads `parameters { key: "<name>" value { string_value: "<n>" } }` blocks.
config_parameter() {
    awk -v key="$2" '
        $0 ~ "key: *\"" key "\"" { found = 1 }
        found && /string_value:/ {
            if (match($0, /string_value: *"[^"]*"/)) {
                value = substr($0, RSTART, RLENGTH)
                sub(/^string_value: *"/, "", value)
                sub(/"$/, "", value)
                print value
            }
            exit
        }' "$1"
}

if [ -z "${MODEL_REPOSITORY}" ]; then
    script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    for candidate in "${script_dir}/../model_repository" /opt/specdec/model_repository; do
        if [ -d "${candidate}/coordinator/configs" ]; then
            MODEL_REPOSITORY="${candidate}"
            break
        fi
    done
fi
if [ -n "${MODEL_REPOSITORY}" ]; then
    for config in "${MODEL_REPOSITORY}"/coordinator/configs/*.pbtxt; do
        [ -f "${config}" ] || continue
        window="$(config_parameter "${config}" speculation_window)"
        if [ -n "${window}" ] && [ "${window}" -gt "${MAX_DRAFT_LEN}" ]; then
            die "--max-draft-len ${MAX_DRAFT_LEN} is below speculation_window ${window} in ${config}"
        fi
        context="$(config_parameter "${config}" max_context_tokens)"
        if [ -n "${context}" ] && [ "${context}" -gt "${MAX_INPUT_LEN}" ]; then
            die "--max-input-len ${MAX_INPUT_LEN} is below max_context_tokens ${context} in ${config}"
        fi
    done
    # The engines' configs size Triton's batch and the KV cache for the default
    # build; a build for more sequences or longer ones needs them raised too.
    for role in target draft; do
        config="${MODEL_REPOSITORY}/${role}/configs/trtllm.pbtxt"
        [ -f "${config}" ] || continue
        batch="$(awk '/^max_batch_size:/ { print $2; exit }' "${config}")"
        if [ -n "${batch}" ] && [ "${batch}" != "${MAX_BATCH_SIZE}" ]; then
            log "warning: ${config} has max_batch_size ${batch}, this build --max-batch-size ${MAX_BATCH_SIZE}: set them equal"
        fi
        tokens="$(config_parameter "${config}" max_tokens_in_paged_kv_cache)"
        needed=$((MAX_BATCH_SIZE * MAX_SEQ_LEN))
        if [ -n "${tokens}" ] && [ "${tokens}" -lt "${needed}" ]; then
            log "warning: ${config} sizes the ${role}'s KV cache at ${tokens} tokens, fewer than" \
                "${MAX_BATCH_SIZE} sequences of ${MAX_SEQ_LEN} (${needed}): set max_tokens_in_paged_kv_cache to ${needed}" \
                "there, or fewer sequences will run at their longest"
        fi
    done
else
    log "warning: no model repository found; speculation_window not checked"
fi

# ---- environment: the TensorRT-LLM that will serve these engines ----------------
# trtllm_release comes from docker/trtllm-release.sh (sourced above).
# Usage: check_trtllm_version <installed version> <pinned version>
check_trtllm_version() {
    local installed="$1" pinned="$2" release
    release="$(trtllm_release "${pinned}")" \
        || die "TRTLLM_VERSION '${pinned}' is not a release version (like 0.17.0)"
    if [ "$(trtllm_release "${installed}" || true)" != "${release}" ]; then
        die "tensorrt_llm ${installed} is installed, but the serving image has TensorRT-LLM ${pinned}" \
            "(post-releases and local builds of it, like ${pinned}.post1 or ${pinned}+local, are accepted;" \
            "other releases and pre-releases are not): an engine loads only in the release that built it." \
            "Run this inside the serving image (or set TRTLLM_VERSION to override)"
    fi
}

BUILT_WITH="${TRTLLM_VERSION}"
if [ "${DRY_RUN}" != "1" ]; then
    command -v trtllm-build >/dev/null 2>&1 || die "trtllm-build not found: run this inside the serving image"
    installed="$(python3 -c 'from importlib.metadata import version; print(version("tensorrt_llm"))')" \
        || die "the tensorrt_llm Python package is not installed"
    check_trtllm_version "${installed}" "${TRTLLM_VERSION}"
    BUILT_WITH="${installed}"
    if [ "${DTYPE}" = "fp8" ] || [ "${DRAFT_DTYPE}" = "fp8" ]; then
        capability="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' ')"
        case "${capability}" in
            8.9 | 9.* | 1[0-9].*) ;;
            *) die "fp8 needs compute capability >= 8.9 (H100: 9.0); this GPU reports '${capability}' (A100 is 8.0: use bfloat16)" ;;
        esac
        python3 -c 'import datasets' 2>/dev/null \
            || die "fp8 calibration needs the 'datasets' package, which the serving image (docker/Dockerfile.trtllm) installs: run this inside that image"
    fi
fi

WORK_DIR="${WORK_DIR:-${OUTPUT_DIR}/.build}"
run mkdir -p "${OUTPUT_DIR}" "${WORK_DIR}"
# Run as a non-root user with `docker run --user`, HOME may not be writable;
# transformers and ModelOpt keep caches there.
if [ ! -w "${HOME:-/nonexistent}" ]; then
    export HOME="${WORK_DIR}"
fi

if [ -z "${TRTLLM_EXAMPLES_DIR}" ]; then
    TRTLLM_EXAMPLES_DIR="${WORK_DIR}/TensorRT-LLM"
    if [ ! -d "${TRTLLM_EXAMPLES_DIR}/examples" ]; then
        command -v git >/dev/null 2>&1 || [ "${DRY_RUN}" = "1" ] \
            || die "git not found: clone TensorRT-LLM v${TRTLLM_VERSION} yourself and pass --examples-dir"
        run env GIT_LFS_SKIP_SMUDGE=1 git clone --quiet --depth 1 --branch "v${TRTLLM_VERSION}" \
            https://github.com/NVIDIA/TensorRT-LLM.git "${TRTLLM_EXAMPLES_DIR}"
    fi
fi

# The examples moved to examples/models/core/<family> in later releases.
CONVERT_SCRIPT=""
for candidate in "${TRTLLM_EXAMPLES_DIR}/examples/${MODEL_FAMILY}" \
    "${TRTLLM_EXAMPLES_DIR}/examples/models/core/${MODEL_FAMILY}"; do
    if [ -f "${candidate}/convert_checkpoint.py" ]; then
        CONVERT_SCRIPT="${candidate}/convert_checkpoint.py"
        break
    fi
done
if [ -z "${CONVERT_SCRIPT}" ]; then
    [ "${DRY_RUN}" = "1" ] || die "no convert_checkpoint.py for '${MODEL_FAMILY}' under ${TRTLLM_EXAMPLES_DIR}/examples"
    CONVERT_SCRIPT="${TRTLLM_EXAMPLES_DIR}/examples/${MODEL_FAMILY}/convert_checkpoint.py"
fi
QUANTIZE_SCRIPT="${TRTLLM_EXAMPLES_DIR}/examples/quantization/quantize.py"

# ---- tokenizer for the coordinator, and a vocabulary check ----------------------
# The draft's logits are compared position by position with the target's, so the
# two checkpoints must share one vocabulary.
run python3 - "${TARGET_HF}" "${DRAFT_HF}" "${OUTPUT_DIR}/tokenizer" <<'PY'
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from coordinator.request.end_tokens import chat_template_text, end_token_ids

target_dir, draft_dir, out_dir = (Path(p) for p in sys.argv[1:4])
target_cfg = json.loads((target_dir / "config.json").read_text())
draft_cfg = json.loads((draft_dir / "config.json").read_text())
if target_cfg.get("vocab_size") != draft_cfg.get("vocab_size"):
    sys.exit(f"vocab_size differs: target {target_cfg.get('vocab_size')} vs draft {draft_cfg.get('vocab_size')}")

target_tok = AutoTokenizer.from_pretrained(target_dir)
draft_tok = AutoTokenizer.from_pretrained(draft_dir)
if target_tok.get_vocab() != draft_tok.get_vocab():
    sys.exit("the target and draft tokenizers differ; speculative decoding needs one vocabulary")
if not target_tok.is_fast:
    sys.exit("the target has no fast tokenizer (tokenizer.json); the coordinator needs one")

# The pair's end ids as specdec-serve computes them for the cpu profile, in the
# same order (coordinator/request/end_tokens.py): the first is the engines'
# end_id, the others their stop words.
def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


template_file = target_dir / "chat_template.jinja"
eos = end_token_ids(
    target_tok.get_vocab(), eos_token=target_tok.eos_token,
    generation_config=read_json(target_dir / "generation_config.json"), model_config=target_cfg,
    chat_template=chat_template_text(read_json(target_dir / "tokenizer_config.json"),
                                     template_file.read_text() if template_file.is_file() else None))
if not eos:
    sys.exit("no eos token id in the target checkpoint")
pad = target_tok.pad_token_id if target_tok.pad_token_id is not None else eos[0]

out_dir.mkdir(parents=True, exist_ok=True)
target_tok.save_pretrained(out_dir)
if not (out_dir / "tokenizer.json").exists():
    sys.exit(f"save_pretrained wrote no tokenizer.json into {out_dir}")
(out_dir / "special_tokens.json").write_text(json.dumps({"eos_token_ids": eos, "pad_token_id": int(pad)}) + "\n")
print(f"tokenizer: {out_dir} (eos {eos}, pad {pad})")
PY

# ---- checkpoint conversion -------------------------------------------------------
# Usage: convert <hf dir> <checkpoint dir> <dtype> <tp size> [<weight-only precision>|none]
convert() {
    local hf="$1" checkpoint="$2" dtype="$3" tp="$4" weight_only="${5:-none}"
    if [ "${dtype}" = "fp8" ]; then
        # FP8 weights and FP8 KV cache through ModelOpt post-training quantization;
        # activations stay bfloat16.
        local calib=()
        if [ -n "${CALIB_DATASET}" ]; then
            calib=(--calib_dataset "${CALIB_DATASET}")
        fi
        run python3 "${QUANTIZE_SCRIPT}" \
            --model_dir "${hf}" \
            --output_dir "${checkpoint}" \
            --dtype bfloat16 \
            --qformat fp8 \
            --kv_cache_dtype fp8 \
            --calib_size "${CALIB_SIZE}" \
            --tp_size "${tp}" \
            "${calib[@]}"
    else
        local quantization=()
        if [ "${weight_only}" != "none" ]; then
            # int8/int4 weights, one scale per output channel; GEMMs dequantize
            # on the fly (TensorRT-LLM's weight-only matmul plugin).
            quantization=(--use_weight_only --weight_only_precision "${weight_only}")
        fi
        run python3 "${CONVERT_SCRIPT}" \
            --model_dir "${hf}" \
            --output_dir "${checkpoint}" \
            --dtype "${dtype}" \
            --tp_size "${tp}" \
            "${quantization[@]}"
    fi
}

# Flags shared by both engines. Logits stay float32 whatever the engine's dtype:
# the target and draft configs declare generation_logits and draft_logits as
# TYPE_FP32, and the tensorrtllm backend checks the engine's logits dtype against
# the config (model_instance_state.cc), so a float16 or bfloat16 logits engine
# would fail at request time.
common_build_flags() {
    local dtype="$1" tp="$2"
    printf '%s\n' \
        --logits_dtype float32 \
        --gemm_plugin auto \
        --remove_input_padding enable \
        --paged_kv_cache enable \
        --use_paged_context_fmha enable \
        --max_batch_size "${MAX_BATCH_SIZE}" \
        --max_input_len "${MAX_INPUT_LEN}" \
        --max_seq_len "${MAX_SEQ_LEN}" \
        --max_num_tokens "${MAX_NUM_TOKENS}" \
        --max_beam_width 1 \
        --workers "${tp}"
    if [ "${dtype}" = "fp8" ]; then
        # FP8 attention in the context phase (Hopper; needs the FP8 KV cache).
        printf '%s\n' --use_fp8_context_fmha enable
    fi
}

TARGET_CKPT="${WORK_DIR}/target-checkpoint"
DRAFT_CKPT="${WORK_DIR}/draft-checkpoint"

log "converting the target (${DTYPE}, tp ${TP_SIZE})"
convert "${TARGET_HF}" "${TARGET_CKPT}" "${DTYPE}" "${TP_SIZE}"
log "converting the draft (${DRAFT_DTYPE}, weight-only ${DRAFT_WEIGHT_ONLY}, tp ${DRAFT_TP_SIZE})"
convert "${DRAFT_HF}" "${DRAFT_CKPT}" "${DRAFT_DTYPE}" "${DRAFT_TP_SIZE}" "${DRAFT_WEIGHT_ONLY}"

# The target gathers generation logits too: the coordinator may ask for them
# (return_generation_logits is part of the engine contract), and draft-target
# speculative decoding in TensorRT-LLM can hang when the target does not.
mapfile -t target_flags < <(common_build_flags "${DTYPE}" "${TP_SIZE}")
log "building the target engine (max_draft_len ${MAX_DRAFT_LEN})"
run trtllm-build \
    --checkpoint_dir "${TARGET_CKPT}" \
    --output_dir "${OUTPUT_DIR}/target" \
    --speculative_decoding_mode draft_tokens_external \
    --max_draft_len "${MAX_DRAFT_LEN}" \
    --gather_generation_logits \
    "${target_flags[@]}"

mapfile -t draft_flags < <(common_build_flags "${DRAFT_DTYPE}" "${DRAFT_TP_SIZE}")
log "building the draft engine"
run trtllm-build \
    --checkpoint_dir "${DRAFT_CKPT}" \
    --output_dir "${OUTPUT_DIR}/draft" \
    --gather_generation_logits \
    "${draft_flags[@]}"

# ---- check what was built, and record it ------------------------------------------
run python3 - "${OUTPUT_DIR}" "${MAX_DRAFT_LEN}" "${BUILT_WITH}" "${DTYPE}" "${DRAFT_DTYPE}" "${TP_SIZE}" "${DRAFT_TP_SIZE}" \
    "${DRAFT_WEIGHT_ONLY}" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
max_draft_len = int(sys.argv[2])


def find(tree, key):
    """First value of `key` anywhere in a nested engine config.json."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = find(item, key)
            if found is not None:
                return found
    return None


target = json.loads((out / "target" / "config.json").read_text())
draft = json.loads((out / "draft" / "config.json").read_text())
problems = []
if (find(target, "max_draft_len") or 0) < max_draft_len:
    problems.append(f"target max_draft_len {find(target, 'max_draft_len')} < {max_draft_len}")
for name, cfg in (("target", target), ("draft", draft)):
    if find(cfg, "use_paged_context_fmha") is False:
        problems.append(f"{name} engine has no paged context FMHA (KV-cache reuse)")
    if find(cfg, "gather_generation_logits") is False:
        problems.append(f"{name} engine does not gather generation logits")
    if find(cfg, "logits_dtype") not in (None, "float32"):
        problems.append(f"{name} engine has {find(cfg, 'logits_dtype')} logits, the configs declare float32")
if problems:
    sys.exit("engine check failed: " + "; ".join(problems))

info = {
    "tensorrt_llm_version": sys.argv[3],
    "target": {"dtype": sys.argv[4], "tp_size": int(sys.argv[6]), "max_draft_len": max_draft_len},
    "draft": {"dtype": sys.argv[5], "tp_size": int(sys.argv[7]), "weight_only": sys.argv[8]},
}
(out / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
print(f"engines ready in {out}")
PY

if [ "${KEEP_CHECKPOINTS}" != "1" ]; then
    run rm -rf "${TARGET_CKPT}" "${DRAFT_CKPT}"
fi
log "done: mount ${OUTPUT_DIR} at /opt/specdec/engines"
