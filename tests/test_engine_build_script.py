"""docker/build_engines.sh builds engines the server can use: the target's maximum
draft length covers the coordinator's speculation_window (a target built without
draft support fails at the first speculative request, tensorrtllm_backend#473),
and the limits cover the coordinator's context. Runs the script with --dry-run,
which prints every command without a GPU."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import pytest

from tests._config_helpers import (
    BUILD_SCRIPT,
    COORDINATOR,
    MODEL_REPOSITORY,
    engine_names,
    model_config,
    parameter,
    profiles,
    script_default,
)

BASH = shutil.which("bash")


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


@pytest.fixture
def checkpoints(tmp_path):
    for name in ("target-hf", "draft-hf"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    return tmp_path


def dry_run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    assert BASH, "bash is needed to run docker/build_engines.sh"
    command = [
        BASH, str(BUILD_SCRIPT),
        "--target-hf", str(tmp_path / "target-hf"),
        "--draft-hf", str(tmp_path / "draft-hf"),
        "--output", str(tmp_path / "engines"),
        "--examples-dir", str(tmp_path / "TensorRT-LLM"),
        "--model-repository", str(MODEL_REPOSITORY),
        "--dry-run", *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})


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


def test_dry_run_bf16_converts_with_the_family_script(checkpoints):
    result = dry_run(checkpoints, "--draft-tp-size", "1", "--tp-size", "4")
    assert result.returncode == 0, result.stderr
    converts = [w for w in commands(result, "python3") if w[1].endswith("convert_checkpoint.py")]
    assert len(converts) == 2
    target_convert = next(w for w in converts if flag(w, "--model_dir").endswith("target-hf"))
    assert flag(target_convert, "--dtype") == "bfloat16"
    assert flag(target_convert, "--tp_size") == "4"


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
