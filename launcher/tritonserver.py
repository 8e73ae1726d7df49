"""Find the Triton 2.51 server shipped in the ``nvidia-pytriton`` wheel and lay
out a backend directory for it, so a real tritonserver runs without Docker.

The Python backend's stub embeds the system's libpython 3.x in isolated mode,
so model code cannot rely on PYTHONPATH: the launcher passes the project's
import paths in ``SPECDEC_PYTHONPATH`` and each ``model.py`` adds them."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


class TritonNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    """A tritonserver from the nvidia-pytriton wheel, runnable without Docker."""

    binary: Path  # bin/tritonserver
    backend_dir: Path  # --backend-directory: the wheel's Python backend with the stub for this Python
    library_dir: Path  # the wheel's shared libraries (LD_LIBRARY_PATH)


def locate(cache_dir: Path) -> TritonInstall:
    """The tritonserver binary plus a backend dir with the right Python stub."""
    try:
        import pytriton
    except ImportError as error:
        raise TritonNotFound("nvidia-pytriton is not installed; run `make serve` or pip install it") from error
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / python / "triton_python_backend_stub"
    for path in (binary, root / "backends" / "python" / "libtriton_python.so", stub):
        if not path.exists():
            raise TritonNotFound(f"{path} is missing from nvidia-pytriton")
    libs = root.parent.parent / "nvidia_pytriton.libs"
    version = metadata.version("nvidia-pytriton")
    backend_dir = cache_dir / "triton" / f"pytriton-{version}-py{python}" / "backends"
    python_backend = backend_dir / "python"
    if not (python_backend / "triton_python_backend_stub").exists():
        staging = backend_dir.with_name(backend_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(root / "backends" / "python", staging / "python")
        shutil.copy2(stub, staging / "python" / "triton_python_backend_stub")
        shutil.rmtree(backend_dir, ignore_errors=True)
        staging.rename(backend_dir)
    return TritonInstall(binary=binary, backend_dir=backend_dir, library_dir=libs)
