"""The hybrid drafter: prompt lookup where the context's last ``min_match``
tokens occurred before (a long match: the text is copying), the draft model
otherwise; the policy takes the one predicted to serve more tokens per second
(coordinator/policy/speculation.py). Short matches are left to the draft
model: in code that is not copying, a 3-token match predicts the next token
about as often as a coin, and the draft model then has text to catch up on.
Where the draft model is ready, it drafts and prompt lookup's proposal is
scored against what the target emitted, so prompt lookup earns its rounds
with evidence that cost nothing; where the draft model would first have to
catch up on the context, prompt lookup is preferred and tried first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from coordinator.drafters import draft_model, prompt_lookup
from coordinator.drafters.base import DrafterEntry, Proposal
from coordinator.drafters.draft_model import ModelDrafter
from coordinator.drafters.prompt_lookup import PromptLookupDrafter

NAME = "hybrid"

@dataclass
class HybridDrafter:
    """Prompt lookup or the draft model where ``lookup`` finds a match (the
    policy picks), the draft model elsewhere."""

    model: ModelDrafter
    lookup: PromptLookupDrafter  # searching for long matches only (its ENTRY)
    name: str = NAME
    uses: tuple[str, ...] = (prompt_lookup.NAME, draft_model.NAME)
    _last: str = ""  # the drafter of the latest proposal
    # (context, its length, where the match's continuation starts): a round asks for
    # the candidates and then the alternative on one context; one search serves both
    _matched: tuple = field(default=(None, -1, 0), repr=False)

    def _match(self, context: Sequence[int], k: int) -> list[int]:
        """prompt lookup's ``match(context, k)`` tokens."""
        seen, length, follow = self._matched
        if seen is not context or length != len(context):
            n, follow = self.lookup.find(context)
            follow = follow if n else len(context)
            self._matched = (context, len(context), follow)
        return [int(t) for t in context[follow: follow + k]]

    def candidates(self, context: Sequence[int]) -> tuple[str, ...]:
        if not self._match(context, 1):
            return (self.model.name,)
        if len(context) - self.model.seen > self.model.catch_up_after:  # the draft model is cold here
            return self.lookup.name, self.model.name
        return self.model.name, self.lookup.name

    async def propose(self, context: Sequence[int], k: int, seed: int, distribution: bool,
                      using: str | None = None) -> Proposal:
        using = using or self.candidates(context)[0]
        self._last = using
        if using == self.lookup.name:
            return await self.lookup.propose(context, k, seed, distribution)
        proposal = await self.model.propose(context, k, seed, distribution)
        alternative = self._match(context, k + 1)  # the round emits k + 1 tokens at most
        return replace(proposal, alternatives=((self.lookup.name, alternative),)) if alternative else proposal

    def warm_up(self, context: Sequence[int], seed: int,
                wanted: Callable[[int], bool] = lambda done: True) -> Awaitable[int] | None:
        # Where prompt lookup has a match the text is likely copying: the draft
        # model's prefill would only take cores from the target; it catches up
        # when it is first needed.
        if self.candidates(context)[0] == self.lookup.name:
            return None
        return self.model.warm_up(context, seed, wanted)

    def verified(self, context_length: int) -> None:
        if self._last == self.model.name:  # the draft model has not seen what prompt lookup proposed
            self.model.verified(context_length)


ENTRY = DrafterEntry(NAME, build=lambda options: HybridDrafter(
    options.model(), PromptLookupDrafter(max_ngram=options.min_match, min_ngram=options.min_match)))
