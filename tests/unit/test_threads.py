"""Each engine stub's OpenMP spin count (cpu_engine/threads.py, the model.py shims)."""

import ast
from pathlib import Path

import pytest

from cpu_engine.threads import apply_spin_count, spin_count_variable

ROOT = Path(__file__).resolve().parents[2]


def test_the_models_own_spin_count_becomes_libgomps():
    env = {"SPECDEC_TARGET_GOMP_SPINCOUNT": "100000"}
    assert apply_spin_count("target", env) == "100000" and env["GOMP_SPINCOUNT"] == "100000"
    draft = {"SPECDEC_TARGET_GOMP_SPINCOUNT": "100000"}
    assert apply_spin_count("draft", draft) is None and "GOMP_SPINCOUNT" not in draft  # the draft sleeps at once


def test_a_spin_count_set_for_every_process_wins():
    env = {"SPECDEC_TARGET_GOMP_SPINCOUNT": "100000", "GOMP_SPINCOUNT": "0"}
    assert apply_spin_count("target", env) == "0" and env["GOMP_SPINCOUNT"] == "0"


def test_a_bad_spin_count_names_its_variable():
    assert spin_count_variable("my-draft.v2") == "SPECDEC_MY_DRAFT_V2_GOMP_SPINCOUNT"
    with pytest.raises(ValueError, match="SPECDEC_DRAFT_GOMP_SPINCOUNT must be a whole number of spins, got '1e5'"):
        apply_spin_count("draft", {"SPECDEC_DRAFT_GOMP_SPINCOUNT": "1e5"})


@pytest.mark.parametrize("model", ["target", "draft"])
def test_the_shim_applies_the_spin_count_before_torch_can_load(model):
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the shim must call
    apply_spin_count before it imports the engine, and threads.py imports no torch."""
    shim = ast.parse((ROOT / "model_repository" / model / "1" / "model.py").read_text())
    order = [node.module if isinstance(node, ast.ImportFrom) else
             ast.unparse(node.value.func) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) else None
             for node in shim.body]
    assert order.index("apply_spin_count") < order.index("cpu_engine.triton_model")
    threads = ast.parse((ROOT / "cpu_engine" / "threads.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(threads) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(threads)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"torch", "numpy", "transformers"}
