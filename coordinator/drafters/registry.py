"""Every drafter the coordinator knows, declared once.

A drafter is one file in this folder (its class and its ``ENTRY``: name,
whether it runs a model, its prior cost, how to build it) plus one line in
``ENTRIES`` below. The request parser, the server settings, the policy, the
cost model and the metrics read what they need from here; none of them
names a drafter of its own.
"""

from __future__ import annotations

from coordinator.drafters import draft_model, hybrid, prompt_lookup
from coordinator.drafters.base import Drafter, DrafterEntry, DrafterOptions

ENTRIES: tuple[DrafterEntry, ...] = (
    draft_model.ENTRY,
    prompt_lookup.ENTRY,
    hybrid.ENTRY,
)
REGISTRY: dict[str, DrafterEntry] = {entry.name: entry for entry in ENTRIES}

# The drafters other modules treat specially: the draft model (the one that
# needs the draft engine, its warm-up and its catch-up) and prompt lookup
# (whose proposals a response counts on their own, ``lookup_draft_tokens``).
DRAFT_MODEL = draft_model.NAME
PROMPT_LOOKUP = prompt_lookup.NAME


def names() -> tuple[str, ...]:
    """Every drafter a request or the server may name."""
    return tuple(REGISTRY)


def proposers() -> tuple[str, ...]:
    """The drafters whose proposals are their own (a chooser's name the one it used)."""
    return tuple(name for name, entry in REGISTRY.items() if entry.prior_cost is not None)


def is_free(name: str) -> bool:
    """Runs no model: the acceptance under which the draft model stops paying does not apply."""
    entry = REGISTRY.get(name)
    return entry is not None and entry.free


def prior_cost(name: str) -> float:
    """A draft step's cost as a fraction of a target step, before anything is measured."""
    entry = REGISTRY.get(name)
    cost = None if entry is None else entry.prior_cost
    return REGISTRY[DRAFT_MODEL].prior_cost if cost is None else cost


def check_name(name: str, field: str = "drafter") -> str:
    """``name`` if it is a drafter, else a ValueError that names ``field`` and the drafters."""
    if name not in REGISTRY:
        raise ValueError(f"{field} must be one of {', '.join(REGISTRY)}, got {name!r}")
    return name


def build(name: str, options: DrafterOptions) -> Drafter:
    """The drafter called ``name`` for one request."""
    return REGISTRY[check_name(name)].build(options)
