"""CPU reference engine: a transformers causal LM behind the tensorrtllm
backend's tensor contract, with prefix KV-cache reuse across rounds."""

import os

# MKL's strict reproducible mode: a float32 row's result no longer depends on
# how many rows share the matrix multiplication or where it sits among them
# (cpu_engine/rows.py measures it at start-up), so greedy speculation stays
# byte-identical to plain decoding without padding every forward to one fixed
# size. MKL reads this once, at its first call: it must be set before torch
# multiplies anything, which importing this package first does. A value
# already in the environment wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
