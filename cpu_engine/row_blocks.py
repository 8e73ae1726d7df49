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
_prompt_rows: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("prompt_rows", default=None)


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
    token = _prompt_rows.set(mask)
    try:
        yield
    finally:
        _prompt_rows.reset(token)


def blocked(layer, rows: torch.Tensor, shape: RowShape) -> torch.Tensor:
    """``layer`` over ``rows`` [M, K] in blocks of ``shape`` (a short last block padded)."""
    outputs = []
    start = 0
    for size in shape.blocks(rows.shape[0]):
        block = rows[start : start + size]
        if size < shape.least:
            block = nn.functional.pad(block, (0, 0, 0, shape.least - size))
        outputs.append(layer(block.contiguous())[:size])
        start += size
    return torch.cat(outputs)


def split_by_path(layer, rows: torch.Tensor, mask: torch.Tensor, shape: RowShape) -> torch.Tensor:
    """``layer`` over ``rows``: those ``mask`` marks in ``prompt_block``-row calls
    (the last padded), the others as ``blocked`` computes them."""
    block = shape.prompt_block
    marked = blocked(layer, rows[mask], RowShape(floor=block, budget=block, fixed=block))
    if bool(mask.all()):
        return marked
    rest = blocked(layer, rows[~mask], shape)  # a lone row too is padded to the floor
    out = marked.new_empty(rows.shape[0], marked.shape[1])
    out[mask] = marked
    out[~mask] = rest
    return out


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
        mask = _prompt_rows.get()
        if shape is not None and mask is not None and shape.prompt_block:
            out = split_by_path(self.inner, rows, mask, shape)
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
