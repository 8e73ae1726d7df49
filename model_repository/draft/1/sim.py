"""Triton entry point of the simulated GPU engine (sim profile; configs/sim.pbtxt names this file)."""

import os
import sys

# The Python backend stub ignores PYTHONPATH; the launcher passes the import paths here.
for _path in reversed(os.environ.get("SPECDEC_PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)

from sim_engine.triton_model import TritonPythonModel  # noqa: E402,F401
