"""The engine tensor contract (coordinator/engines/contract.py) against every profile's
engine configs: each tensor the coordinator sends to `target` or `draft`, and
each output it reads, is declared with the same data type and compatible dims,
so the one coordinator drives the CPU engine and TensorRT-LLM alike."""

from __future__ import annotations

import dataclasses

import pytest

from tests._config_helpers import data_type_name, engine_names, model_config, parameter, profiles
from coordinator.request import api
from coordinator.engines.contract import (ENGINE_EXTENSION_INPUTS, ENGINE_INPUTS, ENGINE_OUTPUTS,
                                         REQUIRED_ENGINE_PARAMETERS, TensorSpec)

CASES = [(profile, role) for profile in profiles() for role in ("target", "draft")]
IDS = [f"{profile}-{role}" for profile, role in CASES]


def dims_compatible(declared: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Same rank; a fixed size must match unless either side is variable (-1)."""
    return len(declared) == len(expected) and all(
        d == e or d == -1 or e == -1 for d, e in zip(declared, expected)
    )


def mismatches(specs: dict[str, TensorSpec], declared) -> list[str]:
    by_name = {tensor.name: tensor for tensor in declared}
    problems = []
    for name, spec in specs.items():
        tensor = by_name.get(name)
        if tensor is None:
            problems.append(f"{name}: not declared")
            continue
        data_type = data_type_name(tensor.data_type)
        if data_type != spec.data_type:
            problems.append(f"{name}: {data_type}, the coordinator uses {spec.data_type}")
        dims = tuple(tensor.dims)
        if not dims_compatible(dims, spec.dims):
            problems.append(f"{name}: dims {list(dims)}, the coordinator uses {list(spec.dims)}")
    return problems


def test_dims_compatible():
    assert dims_compatible((-1,), (-1,))
    assert dims_compatible((1,), (1,))
    assert dims_compatible((-1, -1), (4, -1))
    assert not dims_compatible((1,), (-1, -1))
    assert not dims_compatible((2,), (1,))


def test_both_profiles_present():
    assert {"cpu", "trtllm"} <= set(profiles())


@pytest.mark.parametrize(("profile", "role"), CASES, ids=IDS)
def test_engine_declares_every_input_the_coordinator_sends(profile, role):
    config = model_config(engine_names(profile)[role], profile)
    problems = mismatches(ENGINE_INPUTS, config.input)
    assert not problems, f"{config.name} ({profile}) inputs: " + "; ".join(problems)


@pytest.mark.parametrize("profile", profiles())
def test_a_target_sent_the_cpu_engines_own_inputs_declares_them_optional(profile):
    """The coordinator sends ENGINE_EXTENSION_INPUTS only where its
    engine_prompt_length parameter is on: that profile's target declares each
    (optional, so NVIDIA's clients calling it directly need not send it); a
    target that declares none of them is never sent one."""
    coordinator = model_config("coordinator", profile)
    target = model_config(engine_names(profile)["target"], profile)
    declared = {tensor.name: tensor for tensor in target.input}
    if "engine_prompt_length" in coordinator.parameters and parameter(coordinator, "engine_prompt_length") == "true":
        problems = mismatches(ENGINE_EXTENSION_INPUTS, target.input)
        assert not problems, f"{target.name} ({profile}) inputs: " + "; ".join(problems)
        assert all(declared[name].optional for name in ENGINE_EXTENSION_INPUTS)
    else:
        assert not set(ENGINE_EXTENSION_INPUTS) & set(declared), profile


@pytest.mark.parametrize(("profile", "role"), CASES, ids=IDS)
def test_engine_declares_every_output_the_coordinator_reads(profile, role):
    config = model_config(engine_names(profile)[role], profile)
    problems = mismatches(ENGINE_OUTPUTS, config.output)
    assert not problems, f"{config.name} ({profile}) outputs: " + "; ".join(problems)


@pytest.mark.parametrize(("profile", "role"), CASES, ids=IDS)
def test_engine_requires_nothing_the_coordinator_does_not_send(profile, role):
    config = model_config(engine_names(profile)[role], profile)
    required = {tensor.name for tensor in config.input if not tensor.optional}
    assert required <= set(ENGINE_INPUTS), f"{config.name} ({profile}) requires {sorted(required - set(ENGINE_INPUTS))}"


@pytest.mark.parametrize(("profile", "role"), CASES, ids=IDS)
def test_engine_parameters_the_coordinator_relies_on(profile, role):
    config = model_config(engine_names(profile)[role], profile)
    for key, value in REQUIRED_ENGINE_PARAMETERS.items():
        assert parameter(config, key) == value, f"{config.name} ({profile}): {key} must be {value!r}"


@pytest.mark.parametrize("role", ["target", "draft"])
def test_engines_are_called_the_same_way_in_every_profile(role):
    """Batch dim on the wire and responses read as a stream: the coordinator builds
    the same BLS request for every profile, and reads the engines as decoupled
    exactly where they are (its engine_decoupled setting)."""
    configs = {profile: model_config(engine_names(profile)[role], profile) for profile in profiles()}
    for profile, config in configs.items():
        assert config.max_batch_size >= 1, f"{config.name} ({profile}): the contract assumes a batch dim"
        coordinator = model_config("coordinator", profile)
        decoupled = parameter(coordinator, "engine_decoupled") == "true"
        assert config.model_transaction_policy.decoupled == decoupled, (
            f"{config.name} ({profile}): decoupled must match the coordinator's engine_decoupled")
    assert len({c.model_transaction_policy.decoupled for c in configs.values()}) == 1


# ---- the coordinator's public contract (coordinator/request/api.py) ---------------------------------------------


def declared(tensors) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    return {t.name: (data_type_name(t.data_type), tuple(t.dims), bool(getattr(t, "optional", False))) for t in tensors}


def contract(specs) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    return {s.name: (s.data_type, s.dims, s.optional) for s in specs}


@pytest.mark.parametrize("profile", profiles())
def test_the_coordinator_declares_exactly_the_public_inputs_and_outputs(profile):
    config = model_config("coordinator", profile)
    assert declared(config.input) == contract(api.INPUTS)
    # outputs are never optional in a config; the statistics come with the final response only
    assert {k: v[:2] for k, v in declared(config.output).items()} == {k: v[:2] for k, v in contract(api.OUTPUTS).items()}


def test_every_statistic_reaches_the_wire_and_comes_back():
    """What the server sends (Statistics.outputs) is what a client reads back (Statistics.read), field by
    field: a statistic added to the contract needs no copy anywhere else."""
    sent = api.Statistics(**{name: (7.5 if spec.data_type == "TYPE_FP32" else "why" if spec.data_type == "TYPE_STRING"
                                    else 7) for spec, name in api._specs()})
    arrays = sent.outputs()
    assert set(arrays) == {spec.name for spec in api.STATISTICS}
    received = api.Statistics()
    received.read(arrays.get)
    assert received == sent


def test_the_client_the_load_test_and_the_bench_carry_every_statistic():
    from tools.bench import Totals
    from tools.client import Completion
    from loadtests.grpc_stream import Timing

    names = {name for _, name in api._specs()}
    for carrier in (Completion, Timing, Totals):
        assert names <= {f.name for f in dataclasses.fields(carrier)}, carrier


def test_the_reference_documents_every_input_and_output():
    """The one copy a new input or statistic needs besides the contract and the
    model configs: its row in the reference's tables."""
    import re
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    # names in the first cell of a table row ("| `a`, `b` | ...")
    rows = {name for line in reference.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+)`", line.split("|")[1])}
    missing = [spec.name for spec in (*api.INPUTS, *api.OUTPUTS) if spec.name not in rows]
    assert not missing, f"docs/reference.md has no row for {missing}"
