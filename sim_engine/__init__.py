"""The sim profile's engines: ``target`` and ``draft`` as Triton models that
speak the tensorrtllm backend's contract with TensorRT-LLM's semantics
(trtllm_emulation/calls.py), batch in flight, and take the time a GPU would
(a latency table, sim_engine/presets.py) by sleeping instead of computing.
Their tokens come from a cheap deterministic synthetic language model
(sim_engine/lm.py). No torch, no model weights."""
