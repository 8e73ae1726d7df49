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
draft's forwards of greedy calls alone go through whole.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from cpu_engine.quantize import replace_submodule
from cpu_engine.rows import RowShape, is_linear

_shape: contextvars.ContextVar[RowShape | None] = contextvars.ContextVar("row_shape", default=None)


@contextlib.contextmanager
def shaping(shape: RowShape | None):
    """Linear layers run inside this block keep ``shape`` (None: uncut)."""
    token = _shape.set(shape)
    try:
        yield
    finally:
        _shape.reset(token)


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
        if shape is None or rows.shape[0] <= shape.block:
            return self.inner(x)
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
