"""Speculative decoding on Triton: the coordinator's pure core and its Triton adapter.

Pure modules (no Triton, no torch; tests/test_import_boundary.py keeps them
so): the public contract (api), the engine contract, config, request,
sampling, text, drafters, policy, cost model, governor, loop, generation,
metrics. Adapter: ``triton_bls`` (the BLS model). The CPU reference engine
(cpu_engine/), the local launcher (launcher/) and the client, benchmarks and
soak (tools/) live outside the package.
"""
