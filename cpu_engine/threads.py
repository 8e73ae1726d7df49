"""How long each engine's OpenMP threads spin before they sleep.

A decode forward runs hundreds of short parallel regions; a worker that
sleeps between them is woken by a system call each time, and on a VM a
halted vCPU may wait for the host to run it again. Spinning briefly keeps
the target's forwards on the cores (measured in docs/measurements.md). The
draft sleeps at once: target and draft share the cores, and a draft that
spins while the target verifies takes a core from the step every request
waits for.

The launcher sets ``OMP_WAIT_POLICY=PASSIVE`` for every model and
``SPECDEC_<MODEL>_GOMP_SPINCOUNT`` per model; ``apply_spin_count`` turns the
latter into libgomp's ``GOMP_SPINCOUNT`` in that model's stub, before torch
loads libgomp. Imports nothing heavy: it runs before torch.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

_COUNT = re.compile(r"[0-9]+")


def spin_count_variable(model_name: str) -> str:
    return f"SPECDEC_{re.sub(r'[^A-Za-z0-9]', '_', model_name).upper()}_GOMP_SPINCOUNT"


def apply_spin_count(model_name: str, env: MutableMapping[str, str]) -> str | None:
    """Set ``GOMP_SPINCOUNT`` from the model's own variable, unless the stub's
    environment already has one (a value the user set for every process wins).
    Returns the count in effect, or None where libgomp keeps its default."""
    own = env.get(spin_count_variable(model_name), "").strip()
    if "GOMP_SPINCOUNT" in env or not own:
        return env.get("GOMP_SPINCOUNT")
    if not _COUNT.fullmatch(own):
        raise ValueError(f"{spin_count_variable(model_name)} must be a whole number of spins, got {own!r}")
    env["GOMP_SPINCOUNT"] = own
    return own
