"""The loop's Engine protocol over an in-process CPU engine (no Triton), for
tests that run the real coordinator loop on real (tiny) models."""

from __future__ import annotations

import numpy as np

from cpu_engine.engine import CausalLMEngine, EngineRequest
from coordinator.engines.contract import EngineOutput
from coordinator.sampling.penalties import for_engine_call
from coordinator.sampling.params import SamplingParams


class LocalEngine:
    def __init__(self, engine: CausalLMEngine, end_id: int | None = None):
        self.engine = engine
        self.end_id = end_id

    async def generate(self, input_ids, max_new_tokens, sampling: SamplingParams, draft_tokens=(),
                       draft_logits=None, return_logits=False):
        sampling = for_engine_call(sampling, len(input_ids))  # what the call's inputs carry
        result = self.engine.run(EngineRequest(
            np.asarray(input_ids, dtype=np.int32), max_new_tokens, sampling=sampling, end_id=self.end_id,
            draft_tokens=np.asarray(draft_tokens, dtype=np.int32) if len(draft_tokens) else None,
            draft_logits=draft_logits, return_logits=return_logits,
        ))
        return EngineOutput(result.tokens, result.logits, result.log_probs)

    async def stream(self, input_ids, max_new_tokens, sampling: SamplingParams):
        """Plain decoding in one call, its tokens one at a time as the engine generates them."""
        streamed: list[EngineOutput] = []
        sampling = for_engine_call(sampling, len(input_ids))

        def on_tokens(call, tokens):
            log_probs = None if call.plain.log_probs is None else call.plain.log_probs[-len(tokens):]
            streamed.append(EngineOutput(list(tokens), None, log_probs))

        call = self.engine.submit(
            EngineRequest(np.asarray(input_ids, dtype=np.int32), max_new_tokens, sampling=sampling,
                          end_id=self.end_id),
            on_tokens=on_tokens)
        while not call.finished:
            self.engine.step()
            while streamed:
                yield streamed.pop(0)
        self.engine.result(call)  # raises the call's error, if any
