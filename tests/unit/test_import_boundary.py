"""The coordinator package is a pure core plus its Triton adapters: the loop,
the drafters, the policies and the maths import neither Triton nor torch, so
they are tested in milliseconds and run unchanged behind any server. The
adapters live in ``coordinator/triton/`` alone. The engines' TensorRT-LLM
emulation (trtllm_emulation/) is pure too: the CPU engine and the tests'
fakes run it. The CPU engine (cpu_engine/), the launcher (launcher/) and the
tools (tools/) live outside the package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "coordinator"
ADAPTERS = PACKAGE / "triton"  # the Triton shims of the coordinator and tensorrt_llm_bls models
PURE_PACKAGES = (PACKAGE, ROOT / "trtllm_emulation")
FORBIDDEN = ("torch", "transformers", "triton_python_backend_utils", "tritonclient", "tritonserver")
# The folders of the coordinator, in the order a request meets them.
FLOW = ("request", "policy", "drafters", "engines", "verification", "decoding", "response", "sampling", "triton")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_files() -> list[Path]:
    return sorted(p for package in PURE_PACKAGES for p in package.rglob("*.py")
                  if ADAPTERS not in p.parents and "__pycache__" not in p.parts)


def core_modules() -> list[str]:
    return [module_name(p) for p in core_files()]


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


def test_the_package_holds_the_flow_in_folders_and_its_adapters_in_one():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(FLOW)
    assert not [p.name for p in PACKAGE.glob("*.py") if p.stem not in {"__init__", "settings", "rounds"}]
    assert {"coordinator.decoding.loop", "coordinator.policy.speculation", "coordinator.drafters.registry",
            "coordinator.policy.costmodel", "coordinator.request.api", "coordinator.engines.contract",
            "coordinator.verification.rules", "trtllm_emulation.calls"} <= set(core_modules())


def test_no_core_module_imports_triton_or_torch_anywhere_in_its_code():
    found = {module_name(path): forbidden(imported(path)) for path in core_files()}
    assert {m: names for m, names in found.items() if names} == {}


def test_the_coordinator_does_not_import_the_engines_emulation():
    """The emulation is what engines do; the coordinator only talks to engines."""
    found = {module_name(path): sorted(n for n in imported(path) if n.startswith("trtllm_emulation"))
             for path in PACKAGE.rglob("*.py")}
    assert {m: names for m, names in found.items() if names} == {}


def test_importing_the_core_pulls_in_neither_triton_nor_torch():
    modules = ", ".join(core_modules())
    code = (f"import sys, importlib\nfor m in '{modules}'.split(', '): importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


def test_the_checks_would_catch_a_forbidden_import(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text("def later():\n    import torch.nn\n    from tritonclient.grpc import x\n")
    assert forbidden(imported(sample)) == ["torch.nn", "tritonclient.grpc"]


# -- the GPU image ---------------------------------------------------------------

LOCAL_PACKAGES = {"coordinator", "cpu_engine", "frontend", "launcher", "selfheal", "sim_engine", "tools",
                  "trtllm_emulation"}


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
