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
as a prompt's leading blocks (``prompt_rows``) go through calls of the shape's
``prompt_block`` rows instead (cpu_engine/prompt_blocks.py says why).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from cpu_engine.quantize import replace_submodule
from cpu_engine.rows import RowShape, is_linear

_shape: contextvars.ContextVar[RowShape | None] = contextvars.ContextVar("row_shape", default=None)
# The forward's rows as runs (marked, start, stop), cut from the mask once a forward.
_prompt_rows: contextvars.ContextVar[tuple[tuple[bool, int, int], ...] | None] = contextvars.ContextVar(
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
def prompt_rows(mask: torch.Tensor | None):
    """Inside ``shaping``, the rows ``mask`` (bool, one per row of the forward)
    marks go through calls of the shape's ``prompt_block`` rows."""
    token = _prompt_rows.set(None if mask is None else runs_of(mask))
    try:
        yield
    finally:
        _prompt_rows.reset(token)


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


def runs_of(mask: torch.Tensor) -> tuple[tuple[bool, int, int], ...]:
    """``mask`` [rows] as its runs of equal values: (marked, start, stop) in order."""
    values = mask.tolist()
    runs, start = [], 0
    for row in range(1, len(values) + 1):
        if row == len(values) or values[row] != values[start]:
            runs.append((bool(values[start]), start, row))
            start = row
    return tuple(runs)


def _gather(rows: torch.Tensor, runs) -> torch.Tensor:
    pieces = [rows[start:stop] for _, start, stop in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def split_by_path(layer, rows: torch.Tensor, runs, shape: RowShape) -> torch.Tensor:
    """``layer`` over ``rows``: the rows of ``runs`` marked in ``prompt_block``-row
    calls (the last padded), the others as ``blocked`` computes them. Runs are
    sliced, not mask-indexed: a prompt's rows are one run or a few, and boolean
    indexing cost a 300-token prefill about a tenth of its time."""
    block = shape.prompt_block
    marked_runs = [run for run in runs if run[0]]
    rest_runs = [run for run in runs if not run[0]]
    marked = _blocked_pieces(layer, _gather(rows, marked_runs), RowShape(floor=block, budget=block, fixed=block)) \
        if marked_runs else []
    rest = _blocked_pieces(layer, _gather(rows, rest_runs), shape) if rest_runs else []  # a lone row padded too
    if len(marked_runs) <= 1 and len(rest_runs) <= 1:  # the usual forward: one copy of the outputs
        pieces = marked + rest if runs[0][0] else rest + marked
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    marked, rest = torch.cat(marked), torch.cat(rest)
    pieces, taken = [], {True: 0, False: 0}
    for is_marked, start, stop in runs:
        source, at = (marked, taken[True]) if is_marked else (rest, taken[False])
        pieces.append(source[at : at + stop - start])
        taken[is_marked] = at + stop - start
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
        if shape is not None and runs is not None and shape.prompt_block:
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
