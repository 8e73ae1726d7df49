"""A prompt's rows through kernel calls of one larger size, where that is faster.

The row-invariant kernel calls (cpu_engine/rows.py) are small: on an Intel Xeon
with AMX, bfloat16, 2 to 32 rows. A long prompt's prefill made of such calls
reads every weight once per 32 rows, and on that machine took 2.5x as long as
one ``transformers`` forward over the same prompt. Calls of a fixed larger size
(128 rows there) compute each row the same whatever the other rows of the call
are and wherever the row sits in it, but round otherwise than the small calls.

So a position has one of two paths, fixed by the request alone: the prompt's
leading whole blocks of ``prompt_block`` rows (``prompt_path``) go through
``prompt_block``-row calls, everything else (the rest of the prompt, generated
tokens, drafts, every logits row) through the small calls. The prompt's rest
past its whole blocks joins them, as one more call padded to the block, where
it is long enough (``padded_from`` rows) that the padded call costs less than
its rows in small calls: on that machine a 101-row rest took 188 ms in
32-row calls and 121 ms padded to one 128-row call. Plain decoding and
speculation then compute every position the same way, and greedy speculation
stays byte-identical to plain decoding. The prompt's length is the engine
input ``prompt_length``, which the coordinator sends (the engine cannot tell a
prompt from generated tokens sent back to it); a call without it computes all
its rows through the small calls. The prefix-cache pool reuses a cached
position only where the cache computed it on the path the call would
(cpu_engine/kv_pool.py).

Which size (if any) is measured at start-up: per distinct linear shape of the
model, weighted by how many layers have it, a call of the size against the
same rows in the small calls, and the size must give a row the same bits at
several places in its call.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from cpu_engine.rows import is_linear
from cpu_engine.timing import fastest_times

log = logging.getLogger(__name__)

CANDIDATES = (128, 256)
SETTINGS = ("auto", "none") + tuple(str(size) for size in CANDIDATES)  # the engine's prompt_block parameter
# A size is kept only if its rows cost at most this share of the small calls'
# (the choice changes how a prompt rounds, so a near-tie must not flip it).
KEEP_SHARE = 0.85
_TIMING_REPEATS = 3
# Where a row is checked in a call of the size: each offset (a share of the
# size) moves every row of the reference calls to another place in the call.
_OFFSETS = (1 / 128, 7 / 128, 67 / 128)


@dataclass(frozen=True)
class PromptBlock:
    """``rows``: the size of a prompt block's calls; ``padded_from``: the fewest
    rows of a prompt's rest past its whole blocks that go through one more such
    call, padded (None: never)."""

    rows: int
    padded_from: int | None = None

    def describe(self) -> str:
        rest = f", a prompt's rest of {self.padded_from} rows or more padded to one" if self.padded_from else ""
        return f"{self.rows} rows{rest}"


def prompt_path(prompt_length: int | None, input_length: int, block: int | None,
                padded_from: int | None = None) -> int:
    """How many leading positions of a call's input go through ``block``-row calls:
    the prompt's whole blocks, and its rest where that has at least ``padded_from``
    rows, short of its last token (a decode row, like every row whose logits are read)."""
    if not block or not prompt_length:
        return 0
    rows = min(prompt_length, input_length) - 1
    whole = rows // block * block
    return rows if padded_from is not None and rows - whole >= padded_from else whole


def padded_from(block: int, mine: float, theirs: float) -> int | None:
    """The fewest rows for which one ``block``-row call (``mine`` seconds a row) costs
    less than the rows in small calls (``theirs`` seconds a row)."""
    least = math.floor(block * mine / theirs) + 1
    return least if least < block else None


def block_agrees(multiply, width: int, size: int, dtype: torch.dtype, generator: torch.Generator) -> bool:
    """Whether ``size``-row calls of ``multiply`` give every row the same bits
    wherever it sits in the call and whatever rows share it."""
    rows = torch.randn(2 * size, width, generator=generator).to(dtype)
    reference = torch.cat([multiply(rows[:size]), multiply(rows[size:])])
    for offset in sorted({max(1, int(share * size)) for share in _OFFSETS}):
        shifted = multiply(rows[offset : offset + size])
        if not torch.equal(shifted, reference[offset : offset + size]):
            return False
    return True


def linear_shapes(model: nn.Module) -> dict[tuple, tuple[nn.Module, int]]:
    """One layer of each distinct linear shape of ``model`` and how many layers have it
    (the output layer aside: its rows are logits rows)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes: dict[tuple, tuple[nn.Module, int]] = {}
    for module in model.modules():
        if not is_linear(module) or (output is not None and output in (module, getattr(module, "inner", None))):
            continue
        inner = getattr(module, "inner", module)
        width = getattr(inner, "in_features", None)
        key = (type(inner).__name__, width, getattr(inner, "out_features", None))
        first, count = shapes.get(key, (inner, 0))
        shapes[key] = (first, count + 1)
    return shapes


@torch.inference_mode()
def measure_prompt_block(model: nn.Module, small: int, setting: str = "auto") -> PromptBlock | None:
    """The prompt block for ``model`` (see the module doc): ``auto`` measures the
    candidates against ``small``-row calls; ``none`` or a size is taken as given
    (and measured only for where a prompt's rest is padded to it)."""
    setting = str(setting).strip().lower()
    if setting not in SETTINGS:
        raise ValueError(f"prompt_block must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting == "none":
        return None
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    shapes = linear_shapes(model)
    sizes = CANDIDATES if setting == "auto" else (int(setting),)
    usable = [size for size in sizes if size > small and all(
        block_agrees(layer, layer.in_features, size, dtype, generator) for layer, _ in shapes.values())]
    if setting != "auto" and not usable:
        raise ValueError(f"prompt_block {setting}: calls of {setting} rows do not give a row the same "
                         f"bits wherever it sits in the call on this machine")
    costs = {size: _seconds_per_row(shapes, size, small, dtype, generator) for size in usable}
    best = min(costs, key=lambda size: costs[size][0], default=None)
    if setting == "auto" and best is not None and costs[best][0] > KEEP_SHARE * costs[best][1]:
        best = None
    chosen = None if best is None else PromptBlock(best, padded_from(best, *costs[best]))
    log.info("prompt block: %s (measured in %.1f s; %s)", chosen.describe() if chosen else "none",
             time.perf_counter() - started,
             ", ".join(f"{size} rows {1e6 * mine:.0f} us a row against {1e6 * theirs:.0f} in {small}-row calls"
                       for size, (mine, theirs) in costs.items()) or "no candidate size is row-invariant here")
    return chosen


def _seconds_per_row(shapes, size: int, small: int, dtype, generator) -> tuple[float, float]:
    """Seconds a row of every linear layer, in ``size``-row calls and in ``small``-row calls."""
    mine = theirs = 0.0
    for layer, count in shapes.values():
        rows = torch.randn(size, layer.in_features, generator=generator).to(dtype)
        whole, pieces = fastest_times(
            [lambda: layer(rows), lambda: [layer(rows[s : s + small]) for s in range(0, size, small)]],
            _TIMING_REPEATS)
        mine += count * whole / size
        theirs += count * pieces / size
    return mine, theirs
