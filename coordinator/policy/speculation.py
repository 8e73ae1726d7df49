"""How many tokens to draft next: the per-request speculation policy.

The rule, round by round (``window()`` before a round, ``record*()`` after):

1. Fallback (``fallback_threshold``). The acceptance judged is the per-token
   acceptance a (the chance that a drafted token is accepted when the ones
   before it were: accepted / (accepted + rejections)), estimated as rule 3
   does from the request's most recent ``history_tokens`` drafted tokens and
   the server-wide prior. Once at least ``min_evidence`` tokens were drafted
   and the estimate falls below ``fallback_threshold``, the request decodes
   with the target alone. Per token, not accepted / drafted: a window of 8
   at a = 0.75 accepts 34 % of its tokens on average and one early rejection
   takes a single round's share to 0-12 %, so a ratio over drafted tokens
   would stop the long windows that pay most, on one round.
2. Probing. While decoding plainly the request drafts one probe round of
   ``probe_window`` tokens after every ``probe_interval`` plain rounds. When
   the probes have gathered ``min_evidence`` drafted tokens, speculation
   resumes if their per-token acceptance is at least ``fallback_threshold +
   hysteresis``; otherwise the evidence is dropped and the interval doubles
   (up to ``max_probe_interval``), so a useless draft costs ever less.
3. Window (``adaptive``). The per-token acceptance a is estimated from the
   request's recent rounds, starting from the server-wide estimate worth
   ``prior_trials`` trials (after a few rounds the request's own evidence
   dominates); the cost model predicts the speed-up of every window
   1..``max_window`` from a and the engine costs measured at the request's
   context length and the current load, and the best one is drafted. When no
   window is predicted to beat plain decoding the request decodes plainly and
   probes every ``probe_interval`` plain rounds with the window predicted to
   do best, so the estimate that stopped it is measured again; it resumes as
   soon as a window is predicted to pay (no back-off: the draft is not the
   problem). Not on thin evidence: while the request has drafted fewer than
   ``min_evidence`` tokens and the server's estimate rests on fewer than
   ``min_evidence`` rounds (a fresh server), it drafts the window predicted
   to do best. Without ``adaptive`` the window is ``max_window``.
4. A failing draft engine switches the request to plain decoding for good
   (no probes): the request completes on the target alone.
5. The first round is a plain target step (``first_round_plain``): the
   prompt's prefill is then the only work before the first token, so time to
   first token is that of plain decoding; the draft catches up in round two.
6. Load (``governor``, coordinator/policy/governor.py): while the server has measured
   that plain decoding serves more tokens per second at the current load, the
   request decodes plainly (held back, not a fallback: it speculates again as
   soon as the server's regime at its load does).
7. Drafters (coordinator/drafters/). Where a request's drafter could
   propose with more than one (a hybrid: prompt lookup where the text repeats
   itself, the draft model everywhere), ``plan`` prices each by its own
   acceptance and cost and takes the one predicted to serve more tokens per
   second. How well prompt lookup does depends on the text, so other
   requests' acceptance is a poor guide: where it is the preferred
   candidate (the draft model would first catch up on the context) it is
   tried until the request has drafted ``min_evidence`` tokens with it;
   elsewhere its proposal is scored against every round the draft model
   drafts (``Round.alternatives``), so it earns its rounds on evidence that
   cost nothing. Rules 1, 2 and
   4 are about the draft model: a drafter that runs no model (prompt lookup)
   costs only its verification rows when it is wrong, so it is priced by the
   cost model alone (rule 3) and keeps drafting while the draft model has
   fallen back or failed; where no window of it is predicted to pay, it
   probes every ``probe_interval`` offers (and every offer until the request
   has drafted ``min_evidence`` tokens with it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from coordinator.policy.costmodel import CostModel
from coordinator.drafters import registry
from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.policy.governor import LoadGovernor
from coordinator.rounds import Round

UNBOUNDED = 2**31 - 1  # plain steps planned when the request never speculates


class Mode(str, Enum):
    SPECULATING = "speculating"
    FALLBACK = "fallback"  # rolling acceptance below fallback_threshold
    UNPROFITABLE = "unprofitable"  # the cost model predicts no window beats plain
    DRAFT_FAILED = "draft_failed"


@dataclass(frozen=True)
class PolicySettings:
    """The rule's tuning values (the numbered rule above names each). The
    server sets them with coordinator parameters of the same names
    (coordinator/settings.py); the defaults are here and nowhere else."""

    history_tokens: int = 32  # drafted tokens the rolling acceptance looks back over
    min_evidence: int = 8  # drafted tokens before the rolling acceptance (or the probes) may decide
    probe_window: int = 2  # tokens a fallback probe drafts
    probe_interval: int = 8  # plain rounds between probes
    max_probe_interval: int = 64  # the longest interval after back-offs
    hysteresis: float = 0.1  # probes resume speculation at fallback_threshold + this
    prior_acceptance: float = 0.5  # a drafter's acceptance until the server has measured any
    prior_trials: float = 4.0  # weight of the server-wide acceptance in a request's estimate, in trials

    def check(self) -> list[str]:
        """What is out of range, in words (empty: nothing)."""
        problems = [f"{name} must be at least 1, got {getattr(self, name)}"
                    for name in ("history_tokens", "min_evidence", "probe_window", "probe_interval")
                    if getattr(self, name) < 1]
        if self.max_probe_interval < self.probe_interval:
            problems.append(f"max_probe_interval must be at least probe_interval ({self.probe_interval}), "
                            f"got {self.max_probe_interval}")
        if not 0.0 <= self.hysteresis <= 1.0:
            problems.append(f"hysteresis must be between 0 and 1, got {self.hysteresis}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            problems.append(f"prior_acceptance must be between 0 and 1, got {self.prior_acceptance}")
        if self.prior_trials < 0.0:
            problems.append(f"prior_trials must be at least 0, got {self.prior_trials}")
        return problems


@dataclass
class SpeculationPolicy:
    max_window: int
    fallback_threshold: float
    costs: CostModel = field(default_factory=CostModel)
    adaptive: bool = True
    settings: PolicySettings = field(default_factory=PolicySettings)
    first_round_plain: bool = True
    governor: LoadGovernor | None = None

    mode: Mode = Mode.SPECULATING  # the draft model's state (a free drafter has none: rule 7)
    reason: str = ""  # why the request last stopped speculating ("" if it never did)
    # recent rounds per drafter: (drafted, accepted, rejected)
    _history: dict[str, deque] = field(default_factory=dict, repr=False)
    _plain_rounds: int = 0  # since the last probe
    _plain_streak: int = 0  # plain tokens since the last round that drafted
    _interval: int = 0
    _probe_drafted: int = 0
    _probe_accepted: int = 0
    _probe_rejected: int = 0
    _rounds: int = 0
    _free_refusals: int = 0  # offers of a free drafter predicted not to pay, in a row
    _context: int = 0  # tokens in the sequence at the latest decision (selects the cost cell)

    def __post_init__(self) -> None:
        self._interval = self.settings.probe_interval

    # -- decisions ---------------------------------------------------------
    def plan(self, context: int, candidates: Sequence[str]) -> tuple[str, int]:
        """(drafter, window) for the next round of a sequence of ``context``
        tokens, among the drafters the request's drafter could use here
        (``candidates``, its preferred first): the one predicted to serve the
        most tokens per second; a window of 0 is a plain target step."""
        choice, best_k, best = (candidates[0] if candidates else DRAFT_MODEL), 0, 0.0
        for name in candidates:
            k, speedup = self._offer(context, name)
            if (k > 0 and registry.is_free(name) and name == candidates[0]
                    and self._drafted(name) < self.settings.min_evidence):
                # Free to try, and how well it does depends on the text far more than on
                # other requests: where it is the drafter preferred here (the others would
                # first catch up, or there are none), the request measures it before the
                # server prior decides. Where another is preferred, it learns from the
                # rounds the other drafts (Round.alternatives).
                return name, k
            if k > 0 and (best_k == 0 or speedup > best + 1e-9):
                choice, best_k, best = name, k, speedup
        return choice, best_k

    def window(self, context: int = 0, drafter: str = DRAFT_MODEL) -> int:
        """Tokens ``drafter`` should draft in the next round (0: a plain target
        step) for a sequence of ``context`` tokens."""
        return self._offer(context, drafter)[0]

    def _offer(self, context: int, drafter: str) -> tuple[int, float]:
        """(window, predicted speed-up) of ``drafter`` for the next round (speed-up 1
        where the window is not the cost model's choice: fixed windows and probes)."""
        self._context = context
        if self.max_window <= 0 or self.first_round_pending:
            return 0, 1.0
        if self.held_back:
            self.reason = self.governor.why_plain(self.costs.streams)
            return 0, 1.0
        free = registry.is_free(drafter)
        if not free:
            if self.mode is Mode.DRAFT_FAILED:
                return 0, 1.0
            if self.mode is not Mode.SPECULATING:
                if self._plain_rounds < self._interval:
                    return 0, 1.0
                if self.mode is Mode.UNPROFITABLE:
                    return self.costs.likeliest_window(self.acceptance_estimate(drafter), self.max_window, context,
                                                       drafter=drafter), 1.0
                return min(self.settings.probe_window, self.max_window), 1.0
        if not self.adaptive:
            return self.max_window, 1.0
        alpha = self.acceptance_estimate(drafter)
        k, speedup = self.costs.best_window(alpha, self.max_window, context, drafter=drafter)
        if k > 0:
            if free:
                self._free_refusals = 0
            return k, speedup
        if not free:
            if self._thin_evidence(drafter):
                return self.costs.likeliest_window(alpha, self.max_window, context, drafter=drafter), 1.0
            self._enter(Mode.UNPROFITABLE, self._unprofitable_reason(alpha, context, drafter))
            return 0, 1.0
        self._free_refusals += 1
        if (self._drafted(drafter) < self.settings.min_evidence  # not measured on this request's text yet
                or self._free_refusals % self.settings.probe_interval == 0):  # measure the estimate that refuses it
            return self.costs.likeliest_window(alpha, self.max_window, context, drafter=drafter), 1.0
        return 0, 1.0

    def _unprofitable_reason(self, alpha: float, context: int, drafter: str) -> str:
        """Why no window pays, with the numbers that priced it: a wrong cost or acceptance shows."""
        k = self.costs.likeliest_window(alpha, self.max_window, context, drafter=drafter)
        speedup = self.costs.predictions(alpha, self.max_window, context, drafter=drafter)[k - 1]
        drafting = self.costs.draft_cost(k, context, drafter=drafter)
        return (f"no speculation window is predicted to beat plain decoding (per-token acceptance {alpha:.2f}; "
                f"the best, {k}, {speedup:.2f}x: a drafted token costs {drafting:.2f} plain steps, "
                f"verifying {self.costs.verify_cost(k, context):.2f})")

    def _thin_evidence(self, drafter: str) -> bool:
        """Whether the acceptance that prices ``drafter`` rests on too little to stop it:
        fewer than ``min_evidence`` drafted tokens of the request's own while the server's
        estimate has fewer than ``min_evidence`` rounds behind it. A fresh server's first
        request, one drafted token rejected, took the server's estimate to 0 and its own
        near it, stopped, and spent its 64 tokens probing one token at a time (on a
        2-vCPU Xeon with AMX: 1.17x plain at one stream, where later requests served 1.7x)."""
        return (self._drafted(drafter) < self.settings.min_evidence
                and self.costs.acceptance_rounds(drafter) < self.settings.min_evidence)

    def catch_up_pays(self, context: int, remaining: int) -> bool:
        """Whether the draft model catching up on ``context`` tokens (its prompt
        prefill) is predicted to save more than it costs over the ``remaining``
        tokens; True while either cost is unmeasured (the request measures it).
        A fixed-window request gets the draft it asked for."""
        per_token = self.costs.draft_prefill_seconds(context)
        saving = self._draft_model_saving(context, remaining)
        if per_token is None or saving is None:
            return True
        cost = per_token * context
        if saving > cost * self._waiting() or self.costs.explore_prefill(context):
            return True
        self.reason = (f"draft model not used: catching up on {context} tokens (~{cost:.1f} s{self._shared(cost)}) "
                       f"is predicted to save less over the {remaining} tokens left (~{saving:.1f} s)")
        return False

    def _waiting(self) -> int:
        """Requests whose decoding waits while the draft's catch-up runs: its
        forwards take the cores (the GPU) that every stream's target step needs,
        and the engines take turns, so each stream decoding pays its time."""
        return max(1, self.costs.streams)

    def _shared(self, cost: float) -> str:
        waiting = self._waiting()
        return f", waited out by the {waiting} requests decoding: ~{cost * waiting:.1f} s" if waiting > 1 else ""

    def rest_of_catch_up_pays(self, context: int, tokens_left: int, remaining: int, per_token: float) -> bool:
        """Whether a catch-up under way, ``tokens_left`` of its ``context`` tokens still to go,
        still pays over the ``remaining`` tokens, at the ``per_token`` seconds its own calls
        so far took: its own evidence, where the first catch-ups of a fresh
        server have no price yet and would otherwise run until their request ends."""
        saving = self._draft_model_saving(context, remaining)
        if saving is None:
            return True
        cost = per_token * tokens_left
        if saving > cost * self._waiting():
            return True
        self.reason = (f"draft model not used: the rest of its catch-up on {context} tokens ({tokens_left} tokens, "
                       f"~{cost:.1f} s{self._shared(cost)}) is predicted to save less over the {remaining} tokens "
                       f"left (~{saving:.1f} s)")
        return False

    def _draft_model_saving(self, context: int, remaining: int) -> float | None:
        """Seconds the draft model is predicted to save over ``remaining`` tokens at
        ``context`` (None: not priced, a fixed window or nothing measured yet)."""
        plain = self.costs.plain_seconds(context)
        if self.max_window <= 0 or not self.adaptive or plain is None:
            return None
        _, speedup = self.costs.best_window(self.acceptance_estimate(DRAFT_MODEL), self.max_window, context)
        return remaining * plain * (1.0 - 1.0 / speedup)

    def acceptance_estimate(self, drafter: str = DRAFT_MODEL) -> float:
        """Per-token acceptance a of ``drafter``: the request's recent rounds plus a server-wide prior."""
        prior = self.costs.server_acceptance(self.settings.prior_acceptance, drafter)
        mine = self._history.get(drafter, ())
        accepted = sum(a for _, a, _ in mine)
        trials = accepted + sum(r for _, _, r in mine)
        return (accepted + self.settings.prior_trials * prior) / (trials + self.settings.prior_trials)

    def _drafted(self, drafter: str) -> int:
        return sum(d for d, _, _ in self._history.get(drafter, ()))

    def recent_acceptance(self, drafter: str = DRAFT_MODEL) -> float | None:
        """The per-token acceptance estimate once ``drafter`` drafted ``min_evidence`` tokens (else None)."""
        if self._drafted(drafter) < self.settings.min_evidence:
            return None
        return self.acceptance_estimate(drafter)

    @property
    def first_round_pending(self) -> bool:
        """The request's first round is still to come and is a plain step (rule 5)."""
        return self.first_round_plain and self._rounds == 0

    @property
    def held_back(self) -> bool:
        """The server measured plain decoding faster at the current load (coordinator/policy/governor.py)."""
        return self.governor is not None and not self.governor.speculation_allowed(self.costs.streams)

    @property
    def prompt_prefilling(self) -> bool:
        """Another request's prompt is prefilling on the target (its first token still to come)."""
        return self.governor is not None and self.governor.prompts_prefilling > 0

    @property
    def draft_model_failed(self) -> bool:
        """The draft engine failed this request: the target decodes alone."""
        return self.mode is Mode.DRAFT_FAILED

    @property
    def speculating(self) -> bool:
        return self.mode is Mode.SPECULATING

    def plain_rounds_planned(self, free_drafter: bool = False, draft_model: bool = True) -> int:
        """Plain steps the policy will ask for before it may decide otherwise
        (the loop asks the target for them in one call). ``free_drafter``: the
        request may draft with a free drafter, which is offered after every
        call; ``draft_model`` False: the draft model is out for the rest of the
        request (its catch-up on the prompt was priced away).

        A free drafter alone gets calls as long as the plain streak so far (1,
        1, 2, 4, ... tokens): a text that has not repeated itself, or whose
        repeats were priced not to pay, for n tokens is unlikely to in the next
        few, and every call costs a round trip plus, while other requests keep
        the engine busy, the rest of the forward under way. The streak
        depends on the text alone, not on timing or load, so a seeded request's
        rounds fall the same way whatever runs beside it.

        A request the load governor holds back asks for calls as long as plain
        decoding's (the loop caps every call at ``plain_stretch_tokens``): its
        server measured or forecast plain decoding faster at this load, and a
        shorter call would only add round trips, each missing the forward that
        starts meanwhile. When the regime turns to speculation, the call under
        way ends first."""
        draft_model_out = self.mode is Mode.DRAFT_FAILED or not draft_model
        if self.max_window <= 0 or (draft_model_out and not free_drafter) or self.held_back:
            return UNBOUNDED
        if self.mode is Mode.SPECULATING and not draft_model_out:
            return 1
        draft_due = UNBOUNDED if draft_model_out else max(1, self._interval - self._plain_rounds)
        return min(draft_due, max(1, self._plain_streak)) if free_drafter else draft_due

    # -- observations ------------------------------------------------------
    def observe(self, round_: Round) -> Round:
        """Take in one round's report; the report with the policy's state after it."""
        if round_.speculative:
            self.record(round_.drafted, round_.accepted, round_.drafter or DRAFT_MODEL)
            for drafter, accepted, rejected in round_.alternatives:
                self._remember(accepted + int(rejected), accepted, drafter)
        else:
            self.record_plain(len(round_.tokens))
        return replace(round_, mode=self.mode.value, held_back=None if self.governor is None else self.held_back)

    def record(self, drafted: int, accepted: int, drafter: str = DRAFT_MODEL) -> None:
        """A round verified ``drafted`` tokens of ``drafter``, ``accepted`` of them."""
        self._rounds += 1
        if drafted <= 0:
            return
        self._plain_streak = 0
        self._remember(drafted, accepted, drafter)
        if registry.is_free(drafter) or self.mode is Mode.DRAFT_FAILED:
            return
        if self.mode is Mode.SPECULATING:
            rate = self.recent_acceptance(drafter)
            if rate is not None and rate < self.fallback_threshold:
                self._enter(
                    Mode.FALLBACK,
                    f"per-token acceptance {rate:.2f} below fallback_threshold {self.fallback_threshold:g}",
                )
            return
        self._after_probe(drafted, accepted, drafter)

    def _remember(self, drafted: int, accepted: int, drafter: str) -> None:
        """Add ``drafted`` tried tokens of ``drafter``, ``accepted`` of them, to its recent history."""
        if drafted <= 0:
            return
        history = self._history.setdefault(drafter, deque())
        history.append((drafted, accepted, int(accepted < drafted)))
        while sum(d for d, _, _ in history) - history[0][0] >= self.settings.history_tokens:
            history.popleft()

    def record_plain(self, tokens: int = 1) -> None:
        """Plain target decoding emitted ``tokens`` tokens."""
        self._rounds += 1
        self._plain_rounds += tokens
        self._plain_streak += tokens

    def draft_failed(self, error: BaseException) -> None:
        self._enter(Mode.DRAFT_FAILED, f"draft model failed: {error}")
        if self.governor is not None:
            self.governor.disrupted()

    # -- state changes -----------------------------------------------------
    def _enter(self, mode: Mode, reason: str) -> None:
        self.mode = mode
        self.reason = reason
        self._plain_rounds = 0
        self._interval = self.settings.probe_interval
        self._probe_drafted = self._probe_accepted = self._probe_rejected = 0

    def _after_probe(self, drafted: int, accepted: int, drafter: str) -> None:
        self._plain_rounds = 0
        if self.mode is Mode.UNPROFITABLE:
            # The probe refreshed the estimates; resume if any window now pays.
            if self.costs.best_window(self.acceptance_estimate(drafter), self.max_window, self._context,
                                      drafter=drafter)[0] > 0:
                self.mode = Mode.SPECULATING
            return
        self._probe_drafted += drafted
        self._probe_accepted += accepted
        self._probe_rejected += int(accepted < drafted)
        if self._probe_drafted < self.settings.min_evidence:
            return
        per_token = self._probe_accepted / (self._probe_accepted + self._probe_rejected)
        if per_token >= self.fallback_threshold + self.settings.hysteresis:
            self.mode = Mode.SPECULATING
            # start afresh from the probes' evidence, not the rounds that caused the fallback
            history = self._history.get(drafter, deque())
            probes = self._probe_drafted
            while history and sum(d for d, _, _ in history) > probes:
                history.popleft()
        else:
            self._back_off()
        self._probe_drafted = self._probe_accepted = self._probe_rejected = 0

    def _back_off(self) -> None:
        self._interval = min(self._interval * 2, self.settings.max_probe_interval)
