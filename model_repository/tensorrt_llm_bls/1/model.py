"""Triton entry point of tensorrt_llm_bls (NVIDIA's interface in front of the coordinator)."""

import os
import sys

# The Python backend stub ignores PYTHONPATH; the launcher passes the import paths here.
for _path in reversed(os.environ.get("SPECDEC_PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)

from coordinator.triton.tensorrt_llm_bls_model import TritonPythonModel  # noqa: E402,F401
