"""Speculative decoding on Triton: the coordinator's pure core and its thin adapters.

Pure modules (no Triton, no torch): contract, config, request, sampling, text,
policy, loop. Adapters: ``triton_bls`` (the BLS model), ``cpu_engine`` (the CPU
reference engine), ``serving`` (local launcher), ``client`` (CLI).
"""
