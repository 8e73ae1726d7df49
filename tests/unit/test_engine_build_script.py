"""docker/build_engines.sh builds engines the server can use: the target's maximum
draft length covers the coordinator's speculation_window (a target built without
draft support fails at the first speculative request, tensorrtllm_backend#473),
the limits cover the coordinator's context, both engines gather float32 logits,
and the tensor-parallel sizes split the models' attention heads evenly. Runs the
script with --dry-run, which prints every command without a GPU, on small fake
Hugging Face directories (a config.json each). The TensorRT-LLM release rule
lives in one library, docker/trtllm-release.sh, which the script, the entrypoint
and the image build of docker/Dockerfile.trtllm all source; their version checks
run against a fake python3 that reports the installed version."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._config_helpers import (
    BUILD_SCRIPT,
    COORDINATOR,
    MODEL_REPOSITORY,
    ROOT,
    data_type_name,
    engine_names,
    model_config,
    parameter,
    profiles,
    script_default,
)

BASH = shutil.which("bash")
ENTRYPOINT = ROOT / "docker" / "trtllm-entrypoint.sh"
RELEASE_LIB = ROOT / "docker" / "trtllm-release.sh"
DOCKERFILE = ROOT / "docker" / "Dockerfile.trtllm"
PINNED_TRTLLM = script_default("TRTLLM_VERSION")

# Attention heads and KV heads of the pair the trtllm profile serves, as in their
# config.json: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).
HEADS = {"target": (12, 2), "draft": (14, 2)}


def speculation_windows() -> dict[str, int]:
    return {p: int(parameter(model_config(COORDINATOR, p), "speculation_window")) for p in profiles()}


def context_limits() -> dict[str, int]:
    return {p: int(parameter(model_config(COORDINATOR, p), "max_context_tokens")) for p in profiles()}


def test_default_max_draft_len_covers_speculation_window():
    max_draft_len = int(script_default("MAX_DRAFT_LEN"))
    windows = speculation_windows()
    assert {"cpu", "trtllm"} <= set(windows)
    for profile, window in windows.items():
        assert max_draft_len >= window, f"MAX_DRAFT_LEN {max_draft_len} < speculation_window {window} ({profile})"


def test_default_lengths_cover_the_coordinator_context():
    max_input_len = int(script_default("MAX_INPUT_LEN"))
    max_seq_len = int(script_default("MAX_SEQ_LEN"))
    max_draft_len = int(script_default("MAX_DRAFT_LEN"))
    for profile, context in context_limits().items():
        assert max_input_len >= context, (profile, max_input_len, context)
    # A verify request carries the context plus k draft tokens and asks for k+1.
    assert max_seq_len >= max_input_len + max_draft_len + 1
    for role, name in engine_names("trtllm").items():
        declared = int(parameter(model_config(name, "trtllm"), "max_context_tokens"))
        assert max(context_limits().values()) <= declared <= max_input_len, (role, declared)


def write_checkpoint(directory: Path, heads: int | None, kv_heads: int | None) -> None:
    """A fake Hugging Face checkpoint: only the config.json the script reads."""
    config: dict[str, int] = {"vocab_size": 151936}
    if heads is not None:
        config["num_attention_heads"] = heads
    if kv_heads is not None:
        config["num_key_value_heads"] = kv_heads
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def checkpoints(tmp_path):
    for role, (heads, kv_heads) in HEADS.items():
        write_checkpoint(tmp_path / f"{role}-hf", heads, kv_heads)
    return tmp_path


def fake_bin(tmp_path: Path, trtllm_version: str | None = None) -> Path:
    """A PATH directory whose python3 is this interpreter, or, when trtllm_version
    is given, one that reports that tensorrt_llm version (and a trtllm-build that
    must never run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = ""
    if trtllm_version is not None:
        fake = f"""case "$*" in *'version("tensorrt_llm")'*) echo {shlex.quote(trtllm_version)}; exit 0 ;; esac\n"""
        (bin_dir / "trtllm-build").write_text("#!/bin/sh\necho 'trtllm-build ran' >&2\nexit 99\n")
        (bin_dir / "trtllm-build").chmod(0o755)
    (bin_dir / "python3").write_text(f"#!/bin/sh\n{fake}exec {shlex.quote(sys.executable)} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    return bin_dir


def build(tmp_path, *extra: str, trtllm_version: str | None = None) -> subprocess.CompletedProcess:
    assert BASH, "bash is needed to run docker/build_engines.sh"
    command = [
        BASH, str(BUILD_SCRIPT),
        "--target-hf", str(tmp_path / "target-hf"),
        "--draft-hf", str(tmp_path / "draft-hf"),
        "--output", str(tmp_path / "engines"),
        "--examples-dir", str(tmp_path / "TensorRT-LLM"),
        "--model-repository", str(MODEL_REPOSITORY),
        *extra,
    ]
    env = {"PATH": f"{fake_bin(tmp_path, trtllm_version)}:/usr/bin:/bin"}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def dry_run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return build(tmp_path, "--dry-run", *extra)


def commands(result: subprocess.CompletedProcess, program: str) -> list[list[str]]:
    lines = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    return [words for words in map(shlex.split, lines) if words and words[0] == program]


def flag(words: list[str], name: str) -> str:
    assert name in words, f"{name} missing from: {shlex.join(words)}"
    return words[words.index(name) + 1]


def build_of(result, tmp_path, engine: str) -> list[str]:
    builds = [w for w in commands(result, "trtllm-build") if flag(w, "--output_dir") == str(tmp_path / "engines" / engine)]
    assert len(builds) == 1, result.stdout
    return builds[0]


def test_dry_run_builds_a_target_that_accepts_the_window(checkpoints):
    result = dry_run(checkpoints)
    assert result.returncode == 0, result.stderr
    target = build_of(result, checkpoints, "target")
    assert flag(target, "--speculative_decoding_mode") == "draft_tokens_external"
    assert int(flag(target, "--max_draft_len")) >= max(speculation_windows().values())
    assert flag(target, "--use_paged_context_fmha") == "enable"
    assert flag(target, "--paged_kv_cache") == "enable"
    assert int(flag(target, "--max_batch_size")) == model_config(engine_names("trtllm")["target"], "trtllm").max_batch_size

    draft = build_of(result, checkpoints, "draft")
    assert "--gather_generation_logits" in draft
    assert flag(draft, "--use_paged_context_fmha") == "enable"
    assert "--speculative_decoding_mode" not in draft


def test_dry_run_refuses_a_draft_len_below_the_window(checkpoints):
    too_small = min(speculation_windows().values()) - 1
    result = dry_run(checkpoints, "--max-draft-len", str(too_small))
    assert result.returncode != 0
    assert "speculation_window" in result.stderr
    assert not commands(result, "trtllm-build")


def test_dry_run_fp8_and_tensor_parallel(checkpoints):
    result = dry_run(checkpoints, "--dtype", "fp8", "--tp-size", "2")
    assert result.returncode == 0, result.stderr
    quantize = [w for w in commands(result, "python3") if w[1].endswith("quantization/quantize.py")]
    assert len(quantize) == 2
    target_quantize = next(w for w in quantize if flag(w, "--model_dir").endswith("target-hf"))
    assert flag(target_quantize, "--qformat") == "fp8"
    assert flag(target_quantize, "--kv_cache_dtype") == "fp8"
    assert flag(target_quantize, "--tp_size") == "2"
    target = build_of(result, checkpoints, "target")
    assert flag(target, "--use_fp8_context_fmha") == "enable"
    assert flag(target, "--workers") == "2"


def test_fp8_calibration_data_from_a_local_directory_or_the_hub(checkpoints):
    """quantize.py reads a local directory (train split, text column) or
    downloads cnn_dailymail: the script says which, and refuses a path that is
    not a directory before anything runs."""
    from_hub = dry_run(checkpoints, "--dtype", "fp8")
    assert from_hub.returncode == 0, from_hub.stderr
    assert "Hugging Face Hub" in from_hub.stderr
    assert all("--calib_dataset" not in w for w in commands(from_hub, "python3"))

    calibration = checkpoints / "calibration"
    calibration.mkdir()
    (calibration / "train.jsonl").write_text('{"text": "def add(a, b):\\n    return a + b\\n"}\n')
    local = dry_run(checkpoints, "--dtype", "fp8", "--calib-dataset", str(calibration))
    assert local.returncode == 0, local.stderr
    assert "Hugging Face Hub" not in local.stderr
    quantize = [w for w in commands(local, "python3") if w[1].endswith("quantization/quantize.py")]
    assert [flag(w, "--calib_dataset") for w in quantize] == [str(calibration)] * 2

    missing = dry_run(checkpoints, "--dtype", "fp8", "--calib-dataset", str(checkpoints / "nowhere"))
    assert missing.returncode != 0
    assert "--calib-dataset" in missing.stderr and "not a directory" in missing.stderr
    assert not commands(missing, "python3")


def test_dry_run_bf16_converts_with_the_family_script(checkpoints):
    result = dry_run(checkpoints, "--draft-tp-size", "1", "--tp-size", "2")
    assert result.returncode == 0, result.stderr
    converts = [w for w in commands(result, "python3") if w[1].endswith("convert_checkpoint.py")]
    assert len(converts) == 2
    target_convert = next(w for w in converts if flag(w, "--model_dir").endswith("target-hf"))
    assert flag(target_convert, "--dtype") == "bfloat16"
    assert flag(target_convert, "--tp_size") == "2"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--dtype", "int3"), "dtype"),
        (("--max-seq-len", "100"), "max-seq-len"),
        (("--tp-size", "zero"), "tp-size"),
    ],
)
def test_dry_run_rejects_bad_arguments(checkpoints, args, message):
    result = dry_run(checkpoints, *args)
    assert result.returncode != 0
    assert message in result.stderr


def converts_of(result) -> dict[str, list[str]]:
    converts = [w for w in commands(result, "python3") if w[1].endswith("convert_checkpoint.py")]
    return {role: next(w for w in converts if flag(w, "--model_dir").endswith(f"{role}-hf")) for role in ("target", "draft")}


def test_draft_weight_only_is_off_by_default(checkpoints):
    assert script_default("DRAFT_WEIGHT_ONLY") == "none"
    result = dry_run(checkpoints)
    assert result.returncode == 0, result.stderr
    for role, words in converts_of(result).items():
        assert "--use_weight_only" not in words, role


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_dry_run_weight_only_quantizes_the_draft_only(checkpoints, precision):
    result = dry_run(checkpoints, "--draft-weight-only", precision)
    assert result.returncode == 0, result.stderr
    converts = converts_of(result)
    assert "--use_weight_only" in converts["draft"]
    assert flag(converts["draft"], "--weight_only_precision") == precision
    assert flag(converts["draft"], "--dtype") == "bfloat16"  # activations stay bfloat16
    # the target defines the output: never quantized by this option
    assert "--use_weight_only" not in converts["target"]
    assert "--weight_only_precision" not in converts["target"]
    assert "--gather_generation_logits" in build_of(result, checkpoints, "draft")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--draft-weight-only", "int3"), "--draft-weight-only must be none, int8 or int4"),
        (("--draft-weight-only", "int8", "--draft-dtype", "fp8"), "needs a bfloat16 or float16 draft"),
    ],
)
def test_dry_run_rejects_bad_weight_only_settings(checkpoints, args, message):
    result = dry_run(checkpoints, *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert not commands(result, "trtllm-build")


# ---- logits: float32, gathered by both engines ------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "fp8"])
def test_dry_run_pins_float32_logits_on_both_engines(checkpoints, dtype):
    # The configs declare FP32 generation_logits/draft_logits; the tensorrtllm
    # backend refuses an engine whose logits dtype differs, at request time.
    for role in ("target", "draft"):
        config = model_config(engine_names("trtllm")[role], "trtllm")
        logits = [t for t in [*config.input, *config.output] if t.name in ("generation_logits", "draft_logits")]
        assert {t.name for t in logits} == {"generation_logits", "draft_logits"}, role
        assert {data_type_name(t.data_type) for t in logits} == {"TYPE_FP32"}, role
    result = dry_run(checkpoints, "--dtype", dtype)
    assert result.returncode == 0, result.stderr
    for engine in ("target", "draft"):
        words = build_of(result, checkpoints, engine)
        assert flag(words, "--logits_dtype") == "float32", engine
        assert "--gather_generation_logits" in words, engine


def test_the_target_always_gathers_generation_logits(checkpoints):
    # Draft-target speculative decoding can hang in TensorRT-LLM when the target
    # engine does not gather generation logits: the option to skip them is gone.
    result = dry_run(checkpoints, "--no-target-logits")
    assert result.returncode != 0
    assert "--no-target-logits is not supported" in result.stderr
    assert "hang" in result.stderr
    assert not commands(result, "trtllm-build")
    assert "TARGET_GATHER_LOGITS" not in BUILD_SCRIPT.read_text()
    usage = subprocess.run([BASH, str(BUILD_SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0
    assert "--no-target-logits" not in usage.stdout


# ---- tensor parallelism must split the attention heads evenly ----------------------


def printed_commands(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("+ ")]


@pytest.mark.parametrize(
    ("args", "role", "option"),
    [
        (("--tp-size", "4"), "target", "--tp-size 4"),  # divides 12 heads, not 2 KV heads
        (("--tp-size", "3"), "target", "--tp-size 3"),
        (("--draft-tp-size", "4"), "draft", "--draft-tp-size 4"),  # divides neither 14 nor 2
        (("--draft-tp-size", "7"), "draft", "--draft-tp-size 7"),  # divides 14 heads, not 2 KV heads
    ],
)
def test_dry_run_refuses_a_tp_size_that_does_not_divide_the_heads(checkpoints, args, role, option):
    result = dry_run(checkpoints, *args)
    assert result.returncode != 0
    heads, kv_heads = HEADS[role]
    message = result.stderr
    assert option in message
    assert f"{role} model {checkpoints / f'{role}-hf'}" in message
    assert f"num_attention_heads {heads}" in message
    assert f"num_key_value_heads {kv_heads}" in message
    # refused before anything is run or printed: no conversion, no build
    assert not printed_commands(result), result.stdout


def test_dry_run_accepts_a_tp_size_that_divides_the_heads(checkpoints):
    result = dry_run(checkpoints, "--tp-size", "2", "--draft-tp-size", "2")
    assert result.returncode == 0, result.stderr
    assert flag(converts_of(result)["draft"], "--tp_size") == "2"
    assert flag(build_of(result, checkpoints, "draft"), "--workers") == "2"


def test_kv_heads_default_to_the_attention_heads(checkpoints):
    # No num_key_value_heads in config.json: one KV head per attention head.
    write_checkpoint(checkpoints / "draft-hf", 14, None)
    assert dry_run(checkpoints, "--draft-tp-size", "7").returncode == 0
    result = dry_run(checkpoints, "--draft-tp-size", "4")
    assert result.returncode != 0
    assert "num_attention_heads 14, num_key_value_heads 14" in result.stderr


def test_a_config_without_head_counts_is_not_refused(checkpoints):
    write_checkpoint(checkpoints / "target-hf", None, None)
    result = dry_run(checkpoints, "--tp-size", "2")
    assert result.returncode == 0, result.stderr
    assert "no num_attention_heads" in result.stderr


# ---- TensorRT-LLM version: the pinned release, post-releases and local builds ----

SAME_RELEASE = ["0.17.0", "0.17", "0.17.0.post1", "0.17.0post2", "0.17.0+abc", "0.17.0.post1+cu128.g5f3b1c2"]
OTHER_RELEASES = ["0.16.0", "0.18.0", "0.17.1", "0.17.0rc1", "0.17.0.dev2025010700", "1.0.0", "garbage", ""]


def shell_function(path: Path, name: str) -> str:
    match = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", path.read_text(), re.MULTILINE | re.DOTALL)
    assert match, f"{path.name} has no function {name}"
    return match.group(0)


def source_release_lib() -> str:
    """Shell code that loads the release library the way the scripts do."""
    return f". {shlex.quote(str(RELEASE_LIB))}\n"


def test_the_pinned_release_is_0_17_0():
    assert PINNED_TRTLLM == "0.17.0"


def test_release_of_a_version():
    """trtllm_release gives the release that every check compares."""
    versions = SAME_RELEASE + OTHER_RELEASES
    program = source_release_lib()
    program += 'for v in "$@"; do printf "%s=%s\\n" "$v" "$(trtllm_release "$v" || echo REFUSED)"; done\n'
    run = subprocess.run([BASH, "-euo", "pipefail", "-c", program, "bash", *versions],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    releases = dict(line.split("=", 1) for line in run.stdout.splitlines())
    assert {v: releases[v] for v in SAME_RELEASE} == dict.fromkeys(SAME_RELEASE, "0.17")
    assert all(releases[v] != "0.17" for v in OTHER_RELEASES), releases
    for version in ("0.17.0rc1", "0.17.0.dev2025010700", "garbage", ""):
        assert releases[version] == "REFUSED", version


def test_the_release_library_only_defines_functions():
    # Sourced into scripts running under set -euo pipefail and into a RUN step:
    # it must neither print, nor change the shell's options, nor fail to load.
    program = ('before="$-:$(shopt -po)"; ' + source_release_lib()
               + '[ "$-:$(shopt -po)" = "${before}" ] || { echo "options changed" >&2; exit 1; }\n'
               + "declare -F | sed 's/^declare -f //'\n")
    for options in (["-euo", "pipefail"], []):
        run = subprocess.run([BASH, *options, "-c", program], capture_output=True, text=True, timeout=30,
                             env={"PATH": "/usr/bin:/bin"})
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["trtllm_release"], run.stdout
        assert run.stderr == ""


@pytest.mark.parametrize("script", [BUILD_SCRIPT, ENTRYPOINT], ids=["build_engines", "entrypoint"])
def test_both_scripts_source_the_one_release_rule(script):
    text = script.read_text()
    assert not re.search(r"^\s*trtllm_release\(\)", text, re.MULTILINE), f"{script.name} defines its own copy"
    assert 'TRTLLM_RELEASE_LIB="$(dirname "${BASH_SOURCE[0]}")/trtllm-release.sh"' in text
    assert 'source "${TRTLLM_RELEASE_LIB}"' in text
    # loaded after die (its error message) and before the first use
    assert shell_function(script, "die")
    assert text.index("\ndie() {") < text.index('source "${TRTLLM_RELEASE_LIB}"') < text.index("trtllm_release \"")


@pytest.mark.parametrize("script", [BUILD_SCRIPT, ENTRYPOINT], ids=["build_engines", "entrypoint"])
def test_a_missing_release_library_is_a_clear_error(tmp_path, script):
    # The script alone, without docker/trtllm-release.sh next to it.
    alone = tmp_path / "alone" / script.name
    alone.parent.mkdir()
    shutil.copy(script, alone)
    run = subprocess.run([BASH, str(alone), "--help"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert run.returncode != 0
    assert f"{alone.parent}/trtllm-release.sh is missing" in run.stderr
    assert "must be next to this script" in run.stderr
    # with the library next to it, the copy finds it wherever it is run from
    shutil.copy(RELEASE_LIB, alone.parent / RELEASE_LIB.name)
    run = subprocess.run([BASH, str(alone), "--help"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert "trtllm-release.sh is missing" not in run.stderr


@pytest.mark.parametrize(("cwd", "path"), [(ROOT, "docker/build_engines.sh"), (ROOT / "docker", "build_engines.sh")])
def test_the_library_is_found_relative_to_the_script(cwd, path):
    run = subprocess.run([BASH, path, "--help"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"}, cwd=cwd)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: build_engines.sh")


@pytest.mark.parametrize("installed", SAME_RELEASE)
def test_build_accepts_post_releases_of_the_pinned_release(checkpoints, installed):
    result = build(checkpoints, trtllm_version=installed)
    # past the version check: it goes on to look for the conversion scripts
    assert "is installed, but" not in result.stderr
    assert "no convert_checkpoint.py" in result.stderr, result.stderr
    assert "trtllm-build ran" not in result.stderr


@pytest.mark.parametrize("installed", OTHER_RELEASES)
def test_build_refuses_another_release(checkpoints, installed):
    result = build(checkpoints, trtllm_version=installed)
    assert result.returncode != 0
    assert f"tensorrt_llm {installed} is installed, but the serving image has TensorRT-LLM {PINNED_TRTLLM}" in result.stderr
    assert "post-releases and local builds" in result.stderr
    assert not (checkpoints / "engines").exists()  # refused before anything ran


def check_engine_release(tmp_path: Path, built: str, installed: str) -> subprocess.CompletedProcess:
    """The entrypoint's engine/image check on a build-info.json naming `built`,
    with a python3 that reports `installed` as the image's tensorrt_llm."""
    info = tmp_path / "build-info.json"
    info.write_text(json.dumps({"tensorrt_llm_version": built}))
    program = shell_function(ENTRYPOINT, "die") + source_release_lib() + shell_function(ENTRYPOINT, "check_engine_release")
    program += 'check_engine_release "$1"\necho release-ok\n'
    env = {"PATH": f"{fake_bin(tmp_path, installed)}:/usr/bin:/bin"}
    return subprocess.run([BASH, "-euo", "pipefail", "-c", program, "bash", str(info)],
                          capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize(
    ("built", "installed"),
    [("0.17.0", "0.17.0"), ("0.17.0", "0.17.0.post1"), ("0.17.0.post1", "0.17.0"), ("0.17.0", "0.17.0+abc")],
)
def test_entrypoint_accepts_the_same_release(tmp_path, built, installed):
    run = check_engine_release(tmp_path, built, installed)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "release-ok"


@pytest.mark.parametrize(
    ("built", "installed"),
    [("0.17.0", "0.18.0"), ("0.17.0", "0.16.0"), ("0.16.0", "0.17.0"), ("0.17.0", "0.17.0rc1")],
)
def test_entrypoint_refuses_another_release(tmp_path, built, installed):
    run = check_engine_release(tmp_path, built, installed)
    assert run.returncode != 0
    assert f"engines were built with TensorRT-LLM {built}, this image has {installed}, a different release" in run.stderr
    assert "release-ok" not in run.stdout


def test_entrypoint_runs_the_release_check():
    text = ENTRYPOINT.read_text()
    assert 'check_engine_release "${ENGINE_DIR}/build-info.json"' in text
    assert text.index("check_engine_release \"${ENGINE_DIR}") < text.index("\nmpirun --allow-run-as-root")


# ---- the image build checks the base image by the same rule -------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and
    comment lines dropped, as docker build reads them."""
    instructions, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or (not current and not line.strip()):
            continue
        if line.endswith("\\"):
            current += line[:-1]
            continue
        keyword, _, arguments = (current + line).strip().partition(" ")
        instructions.append((keyword.upper(), arguments))
        current = ""
    return instructions


def image_release_check() -> tuple[int, str]:
    """The index and the command of the RUN step that checks the base image."""
    found = [(i, args) for i, (keyword, args) in enumerate(dockerfile_instructions(DOCKERFILE))
             if keyword == "RUN" and "trtllm_release" in args]
    assert len(found) == 1, found
    return found[0]


def test_the_image_holds_the_library_next_to_both_scripts():
    instructions = dockerfile_instructions(DOCKERFILE)
    copies = [(i, args.split()) for i, (keyword, args) in enumerate(instructions)
              if keyword == "COPY" and "docker/trtllm-entrypoint.sh" in args.split()]
    assert len(copies) == 1, copies
    index, words = copies[0]
    assert words[-1] == "/opt/specdec/docker/"
    assert set(words[:-1]) == {"docker/build_engines.sh", "docker/trtllm-entrypoint.sh", "docker/trtllm-release.sh"}
    check_index, command = image_release_check()
    assert index < check_index, "the library is copied after the step that sources it"
    assert command.startswith(". /opt/specdec/docker/trtllm-release.sh")
    chmod = next(args for keyword, args in instructions if keyword == "RUN" and "chmod" in args)
    assert "chmod 0644 /opt/specdec/docker/trtllm-release.sh" in chmod


def test_the_image_pins_the_release_of_the_build_script():
    args = dict(args.partition("=")[::2] for keyword, args in dockerfile_instructions(DOCKERFILE) if keyword == "ARG")
    assert args["TRTLLM_VERSION"] == PINNED_TRTLLM


def image_check(tmp_path: Path, installed: str, pinned: str = PINNED_TRTLLM) -> subprocess.CompletedProcess:
    """The base-image check of Dockerfile.trtllm, run by its SHELL with the library
    from this checkout, a python3 that reports `installed` and a pip that records
    that it ran (the install after the check)."""
    _, command = image_release_check()
    command = command.replace("/opt/specdec/docker/trtllm-release.sh", shlex.quote(str(RELEASE_LIB)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(
        f"""#!/bin/sh\ncase "$*" in *'version("tensorrt_llm")'*) echo {shlex.quote(installed)} ;; esac\nexit 0\n""")
    (bin_dir / "pip").write_text("#!/bin/sh\necho pip-ran\n")
    for name in ("python3", "pip"):
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TRTLLM_VERSION": pinned}
    return subprocess.run([BASH, "-o", "pipefail", "-c", command], capture_output=True, text=True,
                          timeout=30, env=env, cwd=tmp_path)


@pytest.mark.parametrize("installed", SAME_RELEASE)
def test_the_image_build_accepts_the_pinned_release(tmp_path, installed):
    run = image_check(tmp_path, installed)
    assert run.returncode == 0, run.stderr
    assert "pip-ran" in run.stdout


@pytest.mark.parametrize("installed", OTHER_RELEASES)
def test_the_image_build_refuses_another_release(tmp_path, installed):
    run = image_check(tmp_path, installed)
    assert run.returncode != 0
    assert f"base image has TensorRT-LLM {installed}, expected {PINNED_TRTLLM}" in run.stderr
    assert "pip-ran" not in run.stdout


def test_the_image_build_refuses_a_pin_that_is_no_release(tmp_path):
    run = image_check(tmp_path, "0.17.0", pinned="0.17.0rc1")
    assert run.returncode != 0
    assert "TRTLLM_VERSION 0.17.0rc1 is not a release version" in run.stderr
    assert "pip-ran" not in run.stdout


def test_a_build_for_more_or_longer_sequences_names_the_configs_to_raise(checkpoints):
    """The trtllm configs size Triton's batch and the KV cache (in tokens) for the
    default build; a build beyond them says which setting to raise, and to what."""
    default = dry_run(checkpoints)
    assert default.returncode == 0, default.stderr
    assert "max_tokens_in_paged_kv_cache" not in default.stderr and "max_batch_size" not in default.stderr

    longer = dry_run(checkpoints, "--max-seq-len", "9216")
    assert longer.returncode == 0, longer.stderr
    needed = int(script_default("MAX_BATCH_SIZE")) * 9216
    for role in ("target", "draft"):
        assert f"the {role}'s KV cache" in longer.stderr
    assert f"set max_tokens_in_paged_kv_cache to {needed}" in longer.stderr

    wider = dry_run(checkpoints, "--max-batch-size", "128")
    assert wider.returncode == 0, wider.stderr
    assert "max_batch_size 64, this build --max-batch-size 128" in wider.stderr
