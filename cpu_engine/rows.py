"""How many rows a forward must have so that a row's result does not depend
on the others: measured at start-up on this machine's kernels.

A linear layer over M rows is one matrix multiplication. CPU libraries pick
the kernel (and so the order of the sums, and the rounding) by shape: a
matrix-vector kernel for M = 1, blocked kernels above, a remainder kernel for
the rows left over by the blocking. Greedy speculation is byte-identical to
plain decoding, and a sequence's output is the same alone or next to other
sequences, only if every row of a forward is computed the same way whatever M
is and wherever the row sits in the forward.

``measure_row_shape`` multiplies random rows through each distinct linear
shape of the model at every row count the engine can produce, each count at
the start of the block and at its end, and finds the smallest floor from
which every count gives bitwise the same rows. Measured with torch 2.13:
on an AMD EPYC with AVX-512 bf16 (no AMX), bfloat16, M = 1 differs from
M >= 2 and every M from 2 up agrees. On an AMD EPYC with AVX2 only, float32,
MKL's default kernels agree at no floor (a row's rounding changes with its
place in a 9-row block), and with MKL's strict reproducible mode
(``MKL_CBWR``, set by cpu_engine/__init__.py) every M from 4 up agrees;
a 9-row float32 MLP there took half the time of the default kernels'. On
the same machine oneDNN's prepacked float32 kernel agrees from M = 1, and
the engine measures which of the two to use (cpu_engine/packed.py).
Kernels may agree up to some row count and not beyond (a blocked kernel
whose remainder path starts past it): on an Intel Xeon with AMX, bfloat16,
the 1.5B target's layers agree from M = 2 up to 32 rows and disagree from 33.
So the budget is measured too: the configured ``max_num_tokens`` (at most
``MAX_BLOCK_ROWS``) first, then halved until a floor works, and no kernel
call computes more rows than that: a forward that carries more (a prompt's
prefill, up to ``max_num_tokens`` rows) runs its linear layers in blocks of
the budget (cpu_engine/row_blocks.py). Only where no budget down to the
fallback works is every kernel call padded to one fixed number of rows
instead (slower where extra rows cost).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FLOORS = (1, 2, 4, 8)
# Rows every row count is checked on. A kernel path that sums in another order
# changes only the rows whose bfloat16 rounding it tips: on an Intel Xeon with
# AMX, 1-row calls of the 1.5B target's 8960-wide down projection rounded 33
# of 128 random rows differently from 32-row calls: two rows missed that about
# half the time (and the greedy text of a 750-token prompt then changed with
# what the prefix cache held); 32 miss it about once in 20,000 starts.
PROBE_ROWS = 32
# The most rows one kernel call is measured at (and so computes). A forward of
# more rows runs its linear layers in blocks (cpu_engine/row_blocks.py); this
# bounds what the start-up measurement costs, not the forward.
MAX_BLOCK_ROWS = 64


@dataclass(frozen=True)
class RowShape:
    """The rows of every kernel call: at least ``floor`` (padded), at most
    ``budget``; or exactly ``fixed`` when the kernels are not row-invariant.
    A forward may carry up to ``forward_rows`` rows (default: one block):
    its linear layers then run block by block (cpu_engine/row_blocks.py), so
    every row still goes through a kernel call of the measured shape."""

    floor: int
    budget: int
    fixed: int | None = None
    forward_rows: int | None = None
    # rows of the calls a prompt's leading blocks go through (cpu_engine/prompt_blocks.py)
    prompt_block: int | None = None

    @property
    def block(self) -> int:
        """The most rows one kernel call computes."""
        return self.fixed if self.fixed is not None else self.budget

    @property
    def least(self) -> int:
        """The fewest rows one kernel call computes (fewer are padded)."""
        return self.fixed if self.fixed is not None else self.floor

    def rows(self, real: int) -> int:
        """Rows of a forward that carries ``real`` rows of work: at least the
        floor, and a whole number of blocks where every call has one size."""
        if self.fixed is not None:
            return -(-max(real, 1) // self.fixed) * self.fixed
        return max(real, self.floor)

    def blocks(self, rows: int) -> list[int]:
        """How a kernel over ``rows`` rows is cut: blocks of at most ``block``
        rows; a last block under ``least`` rows is computed padded to it."""
        sizes = [self.block] * (rows // self.block)
        if rows % self.block:
            sizes.append(rows % self.block)
        return sizes

    @property
    def capacity(self) -> int:
        """Rows of work one forward may carry."""
        return self.forward_rows or self.block

    def kernel_calls(self) -> str:
        if self.fixed is not None:
            return f"every kernel call padded to {self.fixed} rows (kernels not row-invariant here)"
        return f"kernel calls of {self.floor} to {self.budget} rows (row-invariant from {self.floor} rows)"

    def describe(self) -> str:
        prompt = f", a prompt's whole blocks in calls of {self.prompt_block} rows" if self.prompt_block else ""
        return f"forwards of up to {self.capacity} rows, {self.kernel_calls()}{prompt}"


def is_linear(module: torch.nn.Module) -> bool:
    """A linear layer of any kind the engine builds (float, prepacked, weight-only quantized)."""
    return (isinstance(module, torch.nn.Linear) or hasattr(module, "packed_weight")
            or hasattr(module, "dequantized_weight"))


def probe_counts(budget: int) -> list[int]:
    """Row counts to compare: every count up to ``budget``. Kernels block rows
    by sizes of their own (28, 48, ...) and send the rest to remainder paths,
    so a count between powers of two can disagree where its neighbours agree;
    a prefill or a crowd of verifications produces any count."""
    return list(range(1, budget + 1))


def call_starts(rows: int, count: int) -> list[int]:
    """Where ``count``-row calls start so that together they cover all ``rows``
    rows: back to back, and one more ending at the last row where they do not
    divide it."""
    starts = list(range(0, rows - count + 1, count))
    if rows % count:
        starts.append(rows - count)
    return starts


def disagreeing_count(multiply, rows: torch.Tensor, budget: int, counts) -> int | None:
    """The largest of ``counts`` whose calls, covering all ``rows`` (a whole number
    of ``budget``-row blocks), give some row other bits than calls of ``budget``
    rows do (None: every count agrees)."""
    reference = torch.cat([multiply(rows[start : start + budget]) for start in range(0, rows.shape[0], budget)])
    for m in sorted(counts, reverse=True):
        if not all(torch.equal(multiply(rows[start : start + m]), reference[start : start + m])
                   for start in call_starts(rows.shape[0], m)):
            return m
    return None


def invariant_floor(multiply, width: int, budget: int, dtype: torch.dtype, generator: torch.Generator) -> int | None:
    """The smallest floor in FLOORS from which ``multiply`` (rows [M, width]
    -> [M, out]) gives every row bitwise the same for every M up to ``budget``,
    wherever the row sits in the block.

    Calls of every count cover at least PROBE_ROWS rows and at least one
    reference call of ``budget`` rows, so every row is checked at its place in
    a call of that count and at its place in the reference. Counts go from the
    largest down: the first that disagrees settles the floor."""
    span = -(-max(budget, PROBE_ROWS) // budget) * budget
    rows = torch.randn(span, width, generator=generator).to(dtype)
    worst = disagreeing_count(multiply, rows, budget, probe_counts(budget))
    above = [floor for floor in FLOORS if floor <= budget and (worst is None or floor > worst)]
    return above[0] if above else None


def candidate_budgets(budget: int, fallback_rows: int) -> list[int]:
    """The budgets tried, largest first: ``budget``, then halves while above ``fallback_rows``."""
    budgets = [budget]
    while budgets[-1] // 2 >= max(fallback_rows, 1) and budgets[-1] // 2 < budgets[-1]:
        budgets.append(budgets[-1] // 2)
    return budgets


@torch.inference_mode()
def measure_row_shape(model: torch.nn.Module, budget: int, fallback_rows: int) -> RowShape:
    """The engine's row shape for ``model`` on this machine (see the module doc):
    the largest budget of ``candidate_budgets`` with a floor, else ``fallback_rows`` fixed."""
    started = time.perf_counter()
    shape = None
    tried = candidate_budgets(budget, fallback_rows)
    for candidate in tried:
        floor, layers = _floor_over_layers(model, candidate)
        if floor is not None:
            shape = RowShape(floor=floor, budget=candidate)
            break
    if shape is None:
        shape = RowShape(floor=fallback_rows, budget=fallback_rows, fixed=fallback_rows)
    log.info("row shape: %s (budgets tried %s over %d linear shapes in %.1f s, MKL_CBWR=%s)", shape.kernel_calls(),
             tried[: tried.index(shape.budget) + 1] if shape.fixed is None else tried, layers,
             time.perf_counter() - started, os.environ.get("MKL_CBWR", "unset"))
    return shape


def _floor_over_layers(model: torch.nn.Module, budget: int) -> tuple[int | None, int]:
    """The floor from which every linear shape of ``model`` agrees up to ``budget`` rows
    (None: some shape agrees at no floor), and how many shapes were measured."""
    generator = torch.Generator().manual_seed(0)
    seen: dict[tuple, int | None] = {}
    floor = 1
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not is_linear(module):
            continue
        width = getattr(module, "in_features", None) or (weight.shape[1] if weight is not None else None)
        key = (type(module).__name__, width, getattr(module, "out_features", None), str(getattr(weight, "dtype", "")))
        if key not in seen:
            dtype = weight.dtype if weight is not None and weight.is_floating_point() else _model_dtype(model)
            seen[key] = invariant_floor(module, width, budget, dtype, generator)
        if seen[key] is None:
            return None, len(seen)
        floor = max(floor, seen[key])
    return floor, len(seen)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())
