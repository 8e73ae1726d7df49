"""Forwards larger than the kernels' row-invariant range, row by row the same.

The kernels give a row the same bits only in calls of ``floor`` to ``budget``
rows (cpu_engine/rows.py measures both: on an Intel Xeon with AMX, bfloat16,
2 to 32 rows). A forward of more rows (a prompt's prefill) would take another
kernel path and round its rows differently; capping forwards at the budget
instead prefills a long prompt in many forwards, each of which reads every
weight of the model again. Here a forward carries up to ``max_num_tokens``
rows and each linear layer runs block by block, every block a kernel call of
the measured shape: the weights of a layer are read once per forward and
stay in cache for its other blocks. Measured on a 2-vCPU Intel Xeon with AMX
(bfloat16, the 1.5B target, oneDNN's prepacked kernel), a 320-token prompt
took 1.03 s in one forward of 32-row blocks against 1.87 s in ten 32-row
forwards (and 0.55 s in one 320-row forward, which is not row-invariant).

Only forwards that must keep the row shape are cut (``shaping``): the
draft's forwards of greedy calls alone go through whole. Rows a forward marks
as a prompt's (``prompt_rows``) go through calls of the sizes it names instead
(cpu_engine/prompt_blocks.py says why).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from cpu_engine.quantize import replace_submodule
from cpu_engine.rows import RowShape, is_linear

_shape: contextvars.ContextVar[RowShape | None] = contextvars.ContextVar("row_shape", default=None)
# The forward's rows as runs (call size, start, stop); size None: the shape's calls.
_prompt_rows: contextvars.ContextVar[tuple[tuple[int | None, int, int], ...] | None] = contextvars.ContextVar(
    "prompt_rows", default=None)


@contextlib.contextmanager
def shaping(shape: RowShape | None):
    """Linear layers run inside this block keep ``shape`` (None: uncut)."""
    token = _shape.set(shape)
    try:
        yield
    finally:
        _shape.reset(token)


@contextlib.contextmanager
def prompt_rows(runs):
    """Inside ``shaping``, the forward's rows as runs (size, start, stop) in order:
    a run of a size goes through calls of that many rows (the last padded), a run
    of None as ``blocked`` computes it."""
    token = _prompt_rows.set(None if runs is None else tuple(runs))
    try:
        yield
    finally:
        _prompt_rows.reset(token)


def merged_runs(runs) -> list[tuple[int | None, int, int]]:
    """``runs`` (size, start, stop) in row order, empty ones dropped and neighbours of one size joined."""
    out: list[tuple[int | None, int, int]] = []
    for size, start, stop in runs:
        if stop <= start:
            continue
        if out and out[-1][0] == size and out[-1][2] == start:
            out[-1] = (size, out[-1][1], stop)
        else:
            out.append((size, start, stop))
    return out


def blocked(layer, rows: torch.Tensor, shape: RowShape) -> torch.Tensor:
    """``layer`` over ``rows`` [M, K] in blocks of ``shape`` (a short last block padded)."""
    pieces = _blocked_pieces(layer, rows, shape)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _blocked_pieces(layer, rows: torch.Tensor, shape: RowShape) -> list[torch.Tensor]:
    outputs = []
    start = 0
    for size in shape.blocks(rows.shape[0]):
        block = rows[start : start + size]
        if size < shape.least:
            block = nn.functional.pad(block, (0, 0, 0, shape.least - size))
        outputs.append(layer(block.contiguous())[:size])
        start += size
    return outputs


def _gather(rows: torch.Tensor, runs) -> torch.Tensor:
    pieces = [rows[start:stop] for _, start, stop in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def split_by_path(layer, rows: torch.Tensor, runs, shape: RowShape) -> torch.Tensor:
    """``layer`` over ``rows`` run by run (``prompt_rows``): the runs of one size
    together, in calls of that size, the rest as ``blocked`` computes them. Runs
    are sliced, not mask-indexed: boolean indexing cost a 300-token prefill about
    a tenth of its time."""
    by_size: dict[int | None, list] = {}
    for run in runs:
        by_size.setdefault(run[0], []).append(run)
    outputs = {size: _blocked_pieces(layer, _gather(rows, group),
                                     shape if size is None else RowShape(floor=size, budget=size, fixed=size))
               for size, group in by_size.items()}
    if all(len(group) == 1 for group in by_size.values()):  # the usual forward: one copy of the outputs
        pieces = [piece for size, _, _ in runs for piece in outputs[size]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    joined = {size: torch.cat(pieces) for size, pieces in outputs.items()}
    pieces, taken = [], dict.fromkeys(joined, 0)
    for size, start, stop in runs:
        pieces.append(joined[size][taken[size] : taken[size] + stop - start])
        taken[size] += stop - start
    return torch.cat(pieces)


class RowBlockedLinear(nn.Module):
    """A linear layer (float, prepacked or quantized) that, inside ``shaping``,
    computes more rows than one block holds block by block."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = _shape.get()
        leading = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        runs = _prompt_rows.get()
        if shape is not None and runs is not None:
            out = split_by_path(self.inner, rows, runs, shape)
        elif shape is None or rows.shape[0] <= shape.block:
            return self.inner(x)
        else:
            out = blocked(self.inner, rows, shape)
        return out.view(*leading, out.shape[-1])


def block_linear_layers(model: nn.Module) -> int:
    """Wrap every linear layer of ``model`` in a RowBlockedLinear; returns how many.
    A layer held in two places (a tied ``lm_head``) gets one wrapper."""
    wrappers: dict[int, RowBlockedLinear] = {}
    targets = [(name, module) for name, module in model.named_modules(remove_duplicate=False)
               if is_linear(module)]
    for name, module in targets:
        replace_submodule(model, name, wrappers.setdefault(id(module), RowBlockedLinear(module)))
    return len(wrappers)
