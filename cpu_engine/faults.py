"""Test-only fault injection for the CPU engine models (``target``, ``draft``).

The reliability tests need a draft that raises or answers late and a target
that raises, inside a real server. Rules come from the environment of the
server process, and are honoured only when *both* are set:

* ``SPECDEC_ALLOW_FAULT_INJECTION=1``
* ``SPECDEC_FAULT_INJECTION="<model>:<action>@seed=<n>[;...]"`` where action is
  ``raise`` or ``sleep=<seconds>``, e.g.
  ``draft:raise@seed=9223372036854775809;draft:sleep=6@seed=9223372036854775810``.

A rule fires for the engine calls of a coordinator request whose
``random_seed`` is ``n``: the coordinator sends each call a seed derived
from the request's seed, the call's position and its role
(``coordinator.sampling.params.call_seed``), which the injector recomputes from the
call's input length; an engine request sent directly with seed ``n`` fires
it too. The coordinator draws the seed of a request that sets none below
2^63, so seeds from 2^63 up (required here) only reach a rule when a client
sends one on purpose: every other request on the same server is served
normally.

Nothing in this repository's launch paths, images or manifests sets these
variables (tests/unit/test_faults.py checks it); setting
``SPECDEC_FAULT_INJECTION`` without the second variable makes the engine
refuse to load, so a stray setting is loud, never silently active.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.sampling.params import ROLES, call_seed

FAULTS_VAR = "SPECDEC_FAULT_INJECTION"
ALLOW_VAR = "SPECDEC_ALLOW_FAULT_INJECTION"
MIN_FAULT_SEED = 2**63  # requests without a seed get one below this


class FaultConfigError(ValueError):
    """The fault-injection variables are malformed or not allowed."""


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` rule (test only)."""


@dataclass(frozen=True)
class FaultRule:
    model: str
    action: str  # "raise" or "sleep"
    seconds: float
    seed: int


def parse_rules(environ: Mapping[str, str]) -> list[FaultRule]:
    """All rules from the environment ([] when fault injection is not set)."""
    spec = environ.get(FAULTS_VAR, "").strip()
    if not spec:
        return []
    if environ.get(ALLOW_VAR, "").strip() != "1":
        raise FaultConfigError(
            f"{FAULTS_VAR} is set but {ALLOW_VAR} is not 1: fault injection is a test-only switch; "
            f"unset {FAULTS_VAR} (or set both to run the reliability tests)"
        )
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            head, trigger = part.split("@", 1)
            model, action = head.split(":", 1)
            key, seed_text = trigger.split("=", 1)
            if key.strip() != "seed":
                raise ValueError(f"unknown trigger {key!r}")
            seed = int(seed_text)
            action = action.strip()
            seconds = 0.0
            if action.startswith("sleep="):
                seconds = float(action.split("=", 1)[1])
                action = "sleep"
            if action not in ("raise", "sleep") or not seconds >= 0:
                raise ValueError(f"unknown action {action!r}")
        except ValueError as error:
            raise FaultConfigError(
                f"{FAULTS_VAR}: cannot parse {part!r} ({error}); expected <model>:raise@seed=<n> "
                "or <model>:sleep=<seconds>@seed=<n>"
            ) from None
        if not MIN_FAULT_SEED <= seed < 2**64:
            raise FaultConfigError(f"{FAULTS_VAR}: seed {seed} must be in [2^63, 2^64) so that no ordinary "
                                   "request can trigger it")
        rules.append(FaultRule(model.strip(), action, seconds, seed))
    return rules


class FaultInjector:
    """The rules of one model; ``apply(seed)`` before serving a request."""

    def __init__(self, model: str, rules: list[FaultRule], sleep=time.sleep):
        self.model = model
        self.rules = {r.seed: r for r in rules if r.model == model}
        self.sleep = sleep

    @classmethod
    def from_environment(cls, model: str, environ: Mapping[str, str]) -> FaultInjector:
        return cls(model, parse_rules(environ))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def rule_for(self, seed: int, position: int) -> FaultRule | None:
        """The rule of a call with ``seed`` whose first new token is at ``position``."""
        rule = self.rules.get(seed)
        if rule is not None:
            return rule
        for request_seed, rule in self.rules.items():
            if any(seed == call_seed(request_seed, position, role) for role in ROLES):
                return rule
        return None

    def apply(self, seed: int, position: int = 0) -> None:
        rule = self.rule_for(seed, position)
        if rule is None:
            return
        if rule.action == "sleep":
            self.sleep(rule.seconds)
        else:
            raise InjectedFault(f"injected fault (test only, {FAULTS_VAR})")
