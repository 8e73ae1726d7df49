"""Triton entry point of the CPU reference engine (cpu profile)."""

import os
import sys

# The Python backend stub ignores PYTHONPATH; the launcher passes the import paths here.
for _path in reversed(os.environ.get("SPECDEC_PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)

from cpu_engine.threads import apply_spin_count  # noqa: E402  (imports no torch)

# libgomp reads its spin count once, when torch loads it (the import below):
# each model's own setting goes into this stub's environment first.
apply_spin_count(os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), os.environ)

from cpu_engine.triton_model import TritonPythonModel  # noqa: E402,F401
