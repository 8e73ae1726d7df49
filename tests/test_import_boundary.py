"""The coordinator package is a pure core plus one Triton adapter: the loop,
the drafters, the policies and the maths import neither Triton nor torch, so
they are tested in milliseconds and run unchanged behind any server. The CPU
engine (cpu_engine/), the launcher (launcher/) and the tools (tools/) live
outside the package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "coordinator"
ADAPTERS = {"triton_bls", "triton_nvidia"}  # the Triton shims of the coordinator and tensorrt_llm_bls models
FORBIDDEN = ("torch", "transformers", "triton_python_backend_utils", "tritonclient", "tritonserver")


def core_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ADAPTERS | {"__init__"})


def imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def forbidden(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in FORBIDDEN)


def test_the_package_holds_only_the_core_and_its_adapter():
    assert not [p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert {"loop", "policy", "drafters", "costmodel", "api"} <= set(core_modules())


def test_no_core_module_imports_triton_or_torch_anywhere_in_its_code():
    found = {module: forbidden(imported(PACKAGE / f"{module}.py")) for module in core_modules()}
    assert {m: names for m, names in found.items() if names} == {}


def test_importing_the_core_pulls_in_neither_triton_nor_torch():
    modules = ", ".join(f"coordinator.{m}" for m in core_modules())
    code = (f"import sys, importlib\nfor m in '{modules}'.split(', '): importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


def test_the_checks_would_catch_a_forbidden_import(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text("def later():\n    import torch.nn\n    from tritonclient.grpc import x\n")
    assert forbidden(imported(sample)) == ["torch.nn", "tritonclient.grpc"]


# -- the GPU image ---------------------------------------------------------------

LOCAL_PACKAGES = {"coordinator", "cpu_engine", "frontend", "launcher", "selfheal", "tools"}


def image_packages(dockerfile: Path) -> set[str]:
    """The project packages a Dockerfile copies (``COPY name ./name``)."""
    copied = {line.split()[1] for line in dockerfile.read_text().splitlines()
              if line.startswith("COPY ") and len(line.split()) == 3 and line.split()[2] == f"./{line.split()[1]}"}
    return copied & LOCAL_PACKAGES


def imported_at_load(path: Path) -> set[str]:
    """The modules a file imports when it is imported (not those inside functions)."""
    names = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def missing_from_image(packages: set[str]) -> dict[str, list[str]]:
    found = {}
    for package in sorted(packages):
        for path in sorted((ROOT / package).rglob("*.py")):
            outside = sorted(n for n in imported_at_load(path)
                             if n.split(".")[0] in LOCAL_PACKAGES - packages)
            if outside:
                found[str(path.relative_to(ROOT))] = outside
    return found


def test_the_gpu_image_holds_every_project_package_its_modules_import():
    """docker/Dockerfile.trtllm copies some packages (not the CPU engine, not the
    launcher); a module of those that imports another at load would fail the
    image's own import check at build time, or the watchdog at start."""
    packages = image_packages(ROOT / "docker" / "Dockerfile.trtllm")
    assert {"coordinator", "frontend", "selfheal"} <= packages and "cpu_engine" not in packages
    assert missing_from_image(packages) == {}


def test_the_image_check_would_catch_an_import_at_load(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text("from launcher import readiness\nclass A:\n    import cpu_engine\n"
                      "def later():\n    import cpu_engine.engine\n")
    assert imported_at_load(sample) == {"launcher", "cpu_engine"}
