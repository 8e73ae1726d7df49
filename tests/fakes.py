"""Deterministic toy engines for testing the loop without models or Triton."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from trtllm_emulation import calls
from coordinator.engines.contract import EngineOutput
from coordinator.sampling.penalties import for_engine_call
from coordinator.sampling.params import SamplingParams

VOCAB = 50


def toy_logits(context: Sequence[int], salt: int = 0) -> np.ndarray:
    """A fixed pseudo-random next-token distribution for a context."""
    rng = np.random.default_rng([salt, len(context), *context[-3:]])
    return rng.normal(0.0, 3.0, VOCAB)


class ToyEngine:
    """Implements the loop's Engine protocol with the tensorrtllm backend's
    semantics (trtllm_emulation/calls.py, as the CPU engine does).

    Two variations the coordinator must also get right: ``returns_end_token``
    (an engine that returns and counts the end token) and
    ``continues_after_verify`` (an engine that, after verifying the drafts,
    keeps decoding plainly until ``request_output_len`` tokens or the end)."""

    def __init__(self, logits_fn: Callable[[Sequence[int]], np.ndarray] = toy_logits, end_id: int | None = None,
                 *, returns_end_token: bool = False, continues_after_verify: bool = False):
        self.logits_fn = logits_fn
        self.end_id = end_id
        self.returns_end_token = returns_end_token
        self.continues_after_verify = continues_after_verify
        self.calls: list[tuple[int, int]] = []  # (max_new_tokens, number of draft tokens)
        self.seeds: list[int] = []
        self.fail_with: Exception | None = None
        self.received_draft_logits: list[np.ndarray] = []
        self.streamed: list[int] = []  # max_new_tokens of each streamed plain call

    async def generate(
        self, input_ids, max_new_tokens, sampling: SamplingParams, draft_tokens=(), draft_logits=None,
        return_logits=False,
    ):
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append((max_new_tokens, len(draft_tokens)))
        self.seeds.append(sampling.seed)
        end_id = None if self.returns_end_token else self.end_id
        context = list(input_ids)
        sampling = for_engine_call(sampling, len(context))  # what the engine call's inputs carry
        if draft_tokens:
            rows = np.stack([self.logits_fn(context + list(draft_tokens[:i])) for i in range(len(draft_tokens) + 1)])
            if draft_logits is not None:
                self.received_draft_logits.append(np.asarray(draft_logits))
            call = calls.verify(rows, draft_tokens, draft_logits, max_new_tokens, sampling, end_id,
                                           input_ids=context)
            tokens, logit_rows = list(call.tokens), list(call.logits)
            own = len(tokens) - call.fed
            if self.continues_after_verify and own > 0 and len(tokens) < max_new_tokens:
                # a separate stream for the continuation, still from this call's seed alone
                more = self._plain(context + tokens, max_new_tokens - len(tokens),
                                   replace(sampling, seed=(sampling.seed + 1) % 2**64), end_id)
                tokens += more.tokens
                logit_rows += more.logits
        else:
            call = self._plain(context, max_new_tokens, sampling, end_id)
            tokens, logit_rows = list(call.tokens), list(call.logits)
        if self.returns_end_token and self.end_id in tokens:
            tokens = tokens[: tokens.index(self.end_id) + 1]
            logit_rows = logit_rows[: len(tokens)]
        log_probs = None
        if sampling.log_probs:
            log_probs = list(call.log_probs or [])
            if draft_tokens and self.continues_after_verify and len(tokens) > len(log_probs):
                log_probs += list(more.log_probs or [])
            log_probs = log_probs[: len(tokens)]
        return EngineOutput(tokens, np.stack(logit_rows) if return_logits and logit_rows else None, log_probs)

    async def stream(self, input_ids, max_new_tokens, sampling: SamplingParams):
        """Plain decoding in one call, a token at a time (as a streaming engine answers)."""
        self.streamed.append(max_new_tokens)
        output = await self.generate(input_ids, max_new_tokens, sampling)
        for i, token in enumerate(output.tokens):
            yield EngineOutput([token], None, None if output.log_probs is None else output.log_probs[i:i + 1])

    def _plain(self, context, max_new_tokens, sampling, end_id):
        fed: list[int] = []

        def step(token):  # the logits after feeding ``token`` (the first is the context's last)
            fed.append(token)
            return self.logits_fn(context + fed[1:])

        return calls.generate(step, context[-1], max_new_tokens, sampling, end_id, input_ids=context)


def noisy(logits_fn, flip_every: int, salt: int = 7):
    """A draft that agrees with ``logits_fn`` except at every ``flip_every``-th context length."""

    def draft_logits(context):
        if flip_every and len(context) % flip_every == 0:
            return toy_logits(context, salt)
        return logits_fn(context)

    return draft_logits
