"""One request from prompt to text chunks: tokenise, run the loop, detokenise,
apply stop words, keep the statistics. What the Triton model sends is a
direct mapping of the chunks this yields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from coordinator.config import CoordinatorSettings
from coordinator.loop import Engine, speculative_decode
from coordinator.policy import SpeculationPolicy
from coordinator.request import GenerationRequest, check_context
from coordinator.text import CompletionText
from coordinator.tokenizer import Codec


@dataclass
class Stats:
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    fallback_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class Chunk:
    text: str
    final: bool
    stats: Stats


async def generate_text(
    request: GenerationRequest,
    codec: Codec,
    *,
    draft: Engine,
    target: Engine,
    settings: CoordinatorSettings,
) -> AsyncIterator[Chunk]:
    """Yield text deltas; the last chunk has ``final`` set and carries the stats."""
    prompt_ids = codec.encode(request.prompt)
    check_context(len(prompt_ids), request.max_tokens, settings)
    policy = SpeculationPolicy(request.speculation_window, settings.fallback_threshold)
    text = CompletionText(codec.decode, request.stop_words)
    stats = Stats()
    rounds = speculative_decode(
        prompt_ids,
        request.max_tokens,
        draft=draft,
        target=target,
        policy=policy,
        sampling=request.sampling,
        end_ids=codec.special.eos_token_ids,
    )
    async with aclosing(rounds):
        async for round_ in rounds:
            stats.rounds += 1
            stats.draft_tokens += round_.drafted
            stats.accepted_draft_tokens += round_.accepted
            stats.completion_tokens += len(round_.tokens)
            stats.fallback_reason = policy.reason
            delta = text.append(round_.tokens, final=round_.finished)
            if text.stopped or round_.finished:
                yield Chunk(delta, True, stats)
                return
            if delta:
                yield Chunk(delta, False, stats)
    yield Chunk(text.append([], final=True), True, stats)  # budget of 0 rounds cannot happen; kept for safety
