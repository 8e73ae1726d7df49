"""CPU reference engine: a transformers causal LM behind the tensorrtllm
backend's tensor contract, with prefix KV-cache reuse across rounds."""
