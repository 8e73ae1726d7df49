"""Speculative decoding on Triton: the coordinator's pure core and its Triton adapters.

Folders in the order a request meets them: ``request`` (inputs, validation,
tokenizer), ``policy`` (window, cost model, load governor), ``drafters`` (one
file each, declared in ``drafters/registry.py``), ``engines`` (the contract
with ``target`` and ``draft``), ``verification`` (the acceptance rule and
reading its outcome), ``decoding`` (the loop, one request end to end),
``response`` (text and metrics); ``sampling`` holds the maths they share.
All of them are pure (no Triton, no torch; tests/unit/test_import_boundary.py
keeps them so). Adapters: ``triton/`` alone.
"""
