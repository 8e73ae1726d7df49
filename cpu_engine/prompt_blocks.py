"""A prompt's rows through kernel calls of one larger size, where that is faster.

The row-invariant kernel calls (cpu_engine/rows.py) are small: on an Intel Xeon
with AMX, bfloat16, 2 to 32 rows. A long prompt's prefill made of such calls
reads every weight once per 32 rows, and on that machine took 2.5x as long as
one ``transformers`` forward over the same prompt. Calls of a fixed larger size
(128 rows there) compute each row the same whatever the other rows of the call
are and wherever the row sits in it, but round otherwise than the small calls.

So a position's path is fixed by the request alone: the prompt's
leading whole blocks of ``prompt_block`` rows (``prompt_path``) go through
``prompt_block``-row calls, everything else (the rest of the prompt, generated
tokens, drafts, every other logits row) through the small calls. The prompt's rest
past its whole blocks goes through one more call, padded, of the size (a
multiple of REST_STEP up to the block, each measured row-invariant too) that
costs least, where that costs less than its rows in small calls: on that
machine, with 256-row blocks, the per-row costs measured at start-up put a
101-row rest at 247 ms in 32-row calls and 173 ms padded to one 128-row call. The rest's size is fixed by its length, so
a path is still one number, its end (``PromptBlock.agreement`` says how far two
paths compute their positions alike). Plain decoding and
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
import time
from dataclasses import dataclass

import torch
from torch import nn

from cpu_engine.rows import is_linear
from cpu_engine.timing import fastest_times

log = logging.getLogger(__name__)

CANDIDATES = (128, 256)
REST_STEP = 64  # the sizes a prompt's rest may be padded to: multiples of this up to the block
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
    """``rows``: the size of a prompt block's calls; ``rest_sizes``: the sizes a
    prompt's rest past its whole blocks may be padded to, each with its seconds a
    row; ``small``: seconds a row in the small calls."""

    rows: int
    rest_sizes: tuple[tuple[int, float], ...] = ()
    small: float = 0.0

    def rest_call(self, rest: int) -> int | None:
        """The size a ``rest``-row rest is padded to (None: it goes through the small calls)."""
        fits = [(size * per_row, size) for size, per_row in self.rest_sizes if size >= rest]
        if not rest or not fits:
            return None
        cost, size = min(fits)
        return size if cost < rest * self.small else None

    def call_of(self, path: int, position: int) -> int:
        """The size of the call that computes ``position`` (below ``path``, the end of a prompt path)."""
        whole = path // self.rows * self.rows
        return self.rows if position < whole else self.rest_call(path - whole)

    def agreement(self, one: int, other: int) -> int:
        """How many leading positions two prompt paths (their ends) compute alike."""
        whole, whole_other = one // self.rows * self.rows, other // self.rows * self.rows
        if whole == whole_other and self.rest_call(one - whole) == self.rest_call(other - whole):
            return min(one, other)
        return min(whole, whole_other)

    def describe(self) -> str:
        least = next((rest for rest in range(1, self.rows) if self.rest_call(rest)), None)
        rest = (f", a prompt's rest of {least} rows or more padded to one call of "
                f"{'/'.join(str(size) for size, _ in self.rest_sizes)} rows") if least else ""
        return f"{self.rows} rows{rest}"


def prompt_path(prompt_length: int | None, input_length: int, block: PromptBlock | None) -> int:
    """How many leading positions of a call's input go through the prompt's calls:
    its whole blocks, and its rest where a padded call pays (``PromptBlock.rest_call``).
    The prompt's last token counts: its row, whose logits give the first token, joins
    the calls too rather than read every weight once more in a small call of its own."""
    if block is None or not prompt_length:
        return 0
    rows = min(prompt_length, input_length)
    whole = rows // block.rows * block.rows
    return rows if block.rest_call(rows - whole) else whole


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
    usable = [size for size in sizes if _row_invariant(shapes, size, small, dtype, generator)]
    if setting != "auto" and not usable:
        raise ValueError(f"prompt_block {setting}: calls of {setting} rows do not give a row the same "
                         f"bits wherever it sits in the call on this machine")
    costs = {size: _seconds_per_row(shapes, size, small, dtype, generator) for size in usable}
    best = min(costs, key=lambda size: costs[size][0], default=None)
    if setting == "auto" and best is not None and costs[best][0] > KEEP_SHARE * costs[best][1]:
        best = None
    chosen = None if best is None else _with_rest_sizes(best, costs, shapes, small, dtype, generator)
    log.info("prompt block: %s (measured in %.1f s; %s)", chosen.describe() if chosen else "none",
             time.perf_counter() - started,
             ", ".join(f"{size} rows {1e6 * mine:.0f} us a row against {1e6 * theirs:.0f} in {small}-row calls"
                       for size, (mine, theirs) in costs.items()) or "no candidate size is row-invariant here")
    return chosen


def _with_rest_sizes(block: int, measured: dict[int, tuple[float, float]], shapes, small: int, dtype,
                     generator) -> PromptBlock:
    """The block and the row-invariant sizes under it a prompt's rest may be padded to
    (``measured``: the candidate sizes already checked and timed, not measured again)."""
    sizes = {block: measured[block]}
    for size in range(REST_STEP, block, REST_STEP):
        if size in measured:
            sizes[size] = measured[size]
        elif _row_invariant(shapes, size, small, dtype, generator):
            sizes[size] = _seconds_per_row(shapes, size, small, dtype, generator)
    small_cost = min(theirs for _, theirs in sizes.values())
    return PromptBlock(block, tuple(sorted((size, mine) for size, (mine, _) in sizes.items())), small_cost)


def _row_invariant(shapes, size: int, small: int, dtype, generator) -> bool:
    """Whether ``size``-row calls (larger than the ``small`` ones) give a row the same bits
    in every linear shape."""
    return size > small and all(block_agrees(layer, layer.in_features, size, dtype, generator)
                                for layer, _ in shapes.values())


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
