"""The CPU engine's test-only fault injection: off unless explicitly allowed,
triggered only by reserved seeds, and set nowhere in the shipped launch paths."""

from __future__ import annotations

import pytest

from cpu_engine.faults import (
    ALLOW_VAR,
    FAULTS_VAR,
    MIN_FAULT_SEED,
    FaultConfigError,
    FaultInjector,
    InjectedFault,
    parse_rules,
)
from coordinator.sampling.params import call_seed
from tests._config_helpers import ROOT

SEED = MIN_FAULT_SEED + 1


def test_nothing_set_means_no_rules():
    assert parse_rules({}) == []
    assert not FaultInjector.from_environment("draft", {ALLOW_VAR: "1"})


def test_rules_without_the_allow_switch_refuse_to_load():
    with pytest.raises(FaultConfigError, match=f"{ALLOW_VAR} is not 1"):
        parse_rules({FAULTS_VAR: f"draft:raise@seed={SEED}"})
    with pytest.raises(FaultConfigError):
        parse_rules({FAULTS_VAR: f"draft:raise@seed={SEED}", ALLOW_VAR: "true"})


@pytest.mark.parametrize(
    "spec,message",
    [
        ("draft:explode@seed=9223372036854775809", "unknown action"),
        ("draft:raise", "cannot parse"),
        ("draft:raise@prompt=x", "unknown trigger"),
        ("draft:sleep=-1@seed=9223372036854775809", "unknown action"),
        ("draft:raise@seed=42", "must be in [2^63, 2^64)"),
    ],
)
def test_malformed_rules_are_refused(spec, message):
    with pytest.raises(FaultConfigError) as error:
        parse_rules({FAULTS_VAR: spec, ALLOW_VAR: "1"})
    assert message in str(error.value)


def test_rules_fire_only_for_their_model_and_seed():
    env = {FAULTS_VAR: f"draft:raise@seed={SEED}; draft:sleep=2.5@seed={SEED + 1}; target:raise@seed={SEED + 2}",
           ALLOW_VAR: "1"}
    slept = []
    draft = FaultInjector("draft", parse_rules(env), sleep=slept.append)
    target = FaultInjector.from_environment("target", env)
    draft.apply(7)
    draft.apply(SEED + 2)  # the target's rule
    with pytest.raises(InjectedFault, match="test only"):
        draft.apply(SEED)
    draft.apply(SEED + 1)
    assert slept == [2.5]
    with pytest.raises(InjectedFault):
        target.apply(SEED + 2)
    target.apply(SEED)


def test_rules_fire_for_the_seeds_the_coordinator_derives_for_each_call():
    """The coordinator sends every engine call its own seed (call_seed of the
    request's seed, position and role); a rule keyed by the request's seed fires
    for those calls, and only for them."""
    env = {FAULTS_VAR: f"draft:raise@seed={SEED}", ALLOW_VAR: "1"}
    draft = FaultInjector.from_environment("draft", env)
    for position in (1, 17, 300):
        with pytest.raises(InjectedFault):
            draft.apply(call_seed(SEED, position, "draft"), position)
        draft.apply(call_seed(SEED, position, "draft"), position + 1)  # another position's seed
        draft.apply(call_seed(SEED + 1, position, "draft"), position)  # another request seed


def test_no_shipped_launch_path_enables_fault_injection():
    """Only the tests may set the switch: not the images, manifests, launcher or Makefile."""
    shipped = [ROOT / "Makefile", ROOT / "launcher" / "launch.py"]
    for folder in ("docker", "k8s", "model_repository"):
        shipped += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    offenders = [str(p.relative_to(ROOT)) for p in shipped if ALLOW_VAR in p.read_text(errors="replace")]
    assert offenders == []
