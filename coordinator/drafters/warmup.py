"""The draft model's catch-up on a prompt, run in the background while the
target decodes plainly, and the decision whether it pays at all.

For a greedy request the draft prefills the prompt after the first round,
so its prefill delays neither the first token nor a speculative round. It
goes in calls of at most CATCH_UP_CHUNK tokens (the first shorter on a long
prompt: coordinator/drafters/draft_model.py ``catch_up_ends``), and a request
that ends first, or whose calls so far show the rest cannot pay, issues no
further call. Which rounds speculate then depends on timing, which greedy
output does not; a sampled request never warms up in the background (its
draft prefills in its first speculative round), so its schedule depends
only on its seed and a seeded request repeats its text.

Before the draft model first catches up on a prompt the policy prices that
catch-up (measured seconds per token of earlier warm-ups) against what
speculation is predicted to save over the tokens left: a long prompt with a
short completion decodes without the draft model. The greedy warm-up has no
deadline (it delays no token): the request drafts once it is done.

Nor does it start while another request's prompt is prefilling on the
target: the draft's forwards would take the cores (or the GPU) that prompt's
first token waits on, and in a burst of arrivals each request's warm-up
would stretch every later one's time to first token. The request asks again
after its next plain stretch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from coordinator.drafters.base import Drafter
from coordinator.drafters.registry import DRAFT_MODEL
from coordinator.engines.deadline import drop_result
from coordinator.sampling.params import SamplingParams, call_seed


class CatchUpPricing(Protocol):
    """What the warm-up asks of the request's policy (coordinator/policy/speculation.py)."""

    max_window: int
    costs: object  # the cost model: observe_draft_prefill(tokens, seconds, context)
    held_back: bool  # the load governor holds speculation back
    prompt_prefilling: bool  # another request waits for its first token on the target's prefill
    draft_model_failed: bool

    def catch_up_pays(self, context: int, remaining: int) -> bool: ...

    def rest_of_catch_up_pays(self, context: int, tokens_left: int, remaining: int, per_token: float) -> bool: ...


class DraftWarmUp:
    """One request's background catch-up of the draft model; ``remaining()`` is
    how many tokens the request may still produce."""

    def __init__(self, drafter: Drafter, policy: CatchUpPricing, remaining: Callable[[], int],
                 clock: Callable[[], float]):
        self.drafter, self.policy, self.remaining, self.clock = drafter, policy, remaining, clock
        self.task: asyncio.Future | None = None
        self.started = False  # at most once per request
        self.verdict: bool | None = None  # whether the catch-up pays (priced once; None: not yet)
        self.request_over = False  # no further engine call once set
        self.deferred = False  # wanted, but another request's prompt is prefilling: the draft model waits

    def pays(self, context_length: int) -> bool:
        """Whether the draft model catching up on the context pays (priced on first ask)."""
        if self.verdict is None:
            self.verdict = self.policy.catch_up_pays(context_length, self.remaining())
        return self.verdict

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def ready(self) -> bool:
        """False while the draft is still prefilling (after letting a warm-up that is about to finish finish)."""
        if self.running:
            await asyncio.sleep(0)
        return not self.running

    def failure(self) -> BaseException | None:
        """The warm-up's error, handed out once (the warm-up does not restart)."""
        task = self.task
        if task is None or not task.done() or task.cancelled() or task.exception() is None:
            return None
        self.task = None
        return task.exception()

    def start_if_wanted(self, context: Sequence[int], sampling: SamplingParams) -> None:
        """After a plain stretch: start the catch-up on ``context`` where the request will draft with the model."""
        policy = self.policy
        if (self.started or not sampling.greedy or policy.max_window <= 0 or self.remaining() <= 0
                or policy.draft_model_failed or policy.held_back
                or DRAFT_MODEL not in self.drafter.uses or not self.pays(len(context))):
            return
        self.deferred = policy.prompt_prefilling
        if self.deferred:
            return
        self.started = True
        work = self.drafter.warm_up(context, call_seed(sampling.seed, len(context), "draft"),
                                    wanted=self._wanted(len(context)))
        if work is not None:
            self.task = asyncio.ensure_future(self._timed(work, len(context)))

    async def _timed(self, work, at: int) -> None:
        """Run the warm-up and price it by the time it ran: an upper bound of what it
        costs the request (the target decodes meanwhile, the slower where they share
        cores), so the pricing errs towards plain decoding, never towards a loss. A
        warm-up stopped early is priced by the part it did."""
        started = self.clock()
        done = await work
        if done:
            self.policy.costs.observe_draft_prefill(done, self.clock() - started, at)

    def _wanted(self, tokens: int) -> Callable[[int], bool]:
        """Asked before each call of the catch-up on ``tokens`` tokens: the request is
        still running, and the rest still pays at the rate its calls so far went."""
        started = self.clock()

        def wanted(done: int) -> bool:
            if self.request_over or self.policy.held_back:  # the server measured plain decoding faster at this load
                return False
            if done == 0 or self.policy.rest_of_catch_up_pays(tokens, tokens - done, self.remaining(),
                                                              (self.clock() - started) / done):
                return True
            self.verdict = False  # the draft model sits out the rest of the request
            return False

        return wanted

    def close(self) -> None:
        """The request is over: no further call; a running warm-up's answer is dropped."""
        self.request_over = True
        if self.running:
            self.task.add_done_callback(drop_result)
