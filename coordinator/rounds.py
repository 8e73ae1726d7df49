"""What one round of the loop did: the report the loop hands to the policy,
the cost model, the request's statistics and the metrics.

Each of them reads the facts it needs from the report; none reaches into
another's state. A round is either speculative (``drafted`` > 0: the drafts of
``drafter`` verified in one target call) or a chunk of plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a round decoded plainly (Round.plain_reason), first cause first: the
# request asked for no speculation (speculation_window 0, or the control arm);
# one token is left (nothing to draft before it); the draft failed; the load
# governor holds speculation back at this load; the draft's catch-up on the
# prompt was priced as not paying, or is still running;
# the first round of a request is plain; rolling acceptance fell below
# fallback_threshold; the cost model predicts no window beats plain decoding;
# the drafter had nothing to propose (prompt lookup found no match).
PLAIN_REASONS = ("not_requested", "last_token", "draft_failed", "load_governor", "catch_up_not_worth_it",
                 "draft_catching_up", "first_round", "low_acceptance", "cost_model", "nothing_proposed")

@dataclass(frozen=True)
class Round:
    tokens: list[int]  # emitted this round, end token excluded
    drafted: int
    accepted: int
    finished: bool  # end token reached or token budget spent
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    drafter: str = ""  # which drafter proposed this round's drafts ("" for a plain round)
    context: int = 0  # tokens in the sequence before the round (the cost model's context bucket)
    # Cost samples: the timings of calls that did a steady round's work only
    # (None where a call also caught up on a prefill, or was not timed).
    draft_sample: float | None = None
    target_sample: float | None = None
    # The policy's state once it has taken the round in (SpeculationPolicy.observe).
    mode: str = "speculating"
    held_back: bool | None = None  # the load governor holds speculation back (None: no governor)
    # Why a plain round did not speculate (PLAIN_REASONS; "" for a speculative round).
    plain_reason: str = ""
    # How other candidates' proposals at the same context would have fared against
    # this round's tokens, (drafter, accepted, rejected) each: evidence for a free
    # drafter the round did not use (Proposal.alternatives).
    alternatives: tuple[tuple[str, int, bool], ...] = ()
    log_probs: tuple[float, ...] | None = None  # each token's, when the request asked for them

    @property
    def speculative(self) -> bool:
        return self.drafted > 0

    @property
    def rejected(self) -> bool:
        """A draft token was rejected (the round ended on the target's own token)."""
        return self.accepted < self.drafted
