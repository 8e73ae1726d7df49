"""oneDNN's prepacked linear kernel for the engine's float linear layers,
where a start-up measurement finds it better than torch's default kernel.

Which kernel is better depends on the CPU and the libraries, so both are
measured on this machine, per distinct linear shape of the model: the row
count from which every row comes out bitwise the same (rows.invariant_floor:
a plain decoding step is padded to it) and the time at that floor and at a
verification's rows. On a 2-vCPU AMD EPYC with AVX2 only (float32, torch
2.13), the default kernel (MKL, strict reproducible mode) agreed from 4 rows
and the prepacked one from 1 row, and the prepacked one was faster at 1, 2,
4 and 8 rows on every shape of the 1.5B target but the 256-wide k/v
projections (``docs/measurements.md``). One kernel serves every float linear
layer of a model, so the whole model has one floor.

A packed weight is a copy in oneDNN's blocked layout, in anonymous memory.
Where the checkpoint is memory-mapped (safetensors), every tensor of the
model is a view of that mapping, and packing reads all of the replaced
weights' pages: as long as one tensor (a bias, a norm, the embedding) still
points into it, those pages stay resident beside their packed copies, twice
the weights' memory. So a packed model's remaining tensors are copied out of
the mapping, which is then released (``docs/measurements.md``: RSS after
loading). A tied ``lm_head`` keeps the embedding's weights beside its
packed copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from cpu_engine.quantize import replace_submodule
from cpu_engine.rows import invariant_floor
from cpu_engine.timing import fastest_times

log = logging.getLogger(__name__)

DEFAULT, PACKED = "default", "onednn-packed"
KERNELS = ("auto", DEFAULT, PACKED)  # the engine's linear_kernel parameter
VERIFY_ROWS = 8  # rows of a verification, the other forward decoding repeats
# The choice compares floors over forwards of up to this many rows (every
# floor the engine knows is below it); the kernel kept is then measured over
# the engine's whole row budget (rows.measure_row_shape), which decides.
CHOICE_ROWS = 17
# The prepacked kernel replaces the default only if it costs at most this
# share of it: rounding differs between the kernels, so a choice that timing
# noise could flip from one start to the next would let a restarted replica
# (rarely) break a near-tie differently.
SWITCH_SHARE = 0.9
_TIMING_REPEATS = 5


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered once for its own kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn packed"


@dataclass(frozen=True)
class KernelCost:
    """One kernel over a model's linear shapes: its floor (None: no row count
    makes rows agree) and the seconds of one pass over every linear layer at
    the floor and at VERIFY_ROWS rows."""

    floor: int | None
    step_seconds: float
    verify_seconds: float

    @property
    def usable(self) -> bool:
        return self.floor is not None

    @property
    def seconds(self) -> float:
        return self.step_seconds + self.verify_seconds


def _floor(layers: dict[tuple, tuple[nn.Module, int]], budget: int, generator: torch.Generator) -> int | None:
    """The row count from which every layer's rows agree bitwise (None: none does)."""
    floors = [invariant_floor(layer, layer.in_features, budget, layer_dtype(layer), generator)
              for layer, _ in layers.values()]
    return None if any(floor is None for floor in floors) else max(floors, default=1)


def _costs(kernels: dict[str, dict[tuple, tuple[nn.Module, int]]], budget: int,
           generator: torch.Generator) -> dict[str, KernelCost]:
    """``kernels``: name -> (shape -> (a layer of that shape on that kernel, how
    many the model has)). Each kernel's floor, then each shape's time on every
    kernel, taken in turn repeat by repeat and the best kept: a burst of other
    load on the machine slows every kernel alike instead of one, which timing
    the kernels one after the other let flip the choice."""
    floors = {name: _floor(layers, budget, generator) for name, layers in kernels.items()}
    usable = [name for name in kernels if floors[name] is not None]
    totals = {name: [0.0, 0.0] for name in usable}
    for shape in next(iter(kernels.values())):
        runs = []  # (kernel, 0 step / 1 verify, layer, input rows)
        for name in usable:
            layer, _ = kernels[name][shape]
            for which, rows in enumerate((floors[name], max(floors[name], min(VERIFY_ROWS, budget)))):
                x = torch.randn(rows, layer.in_features, generator=generator).to(layer_dtype(layer))
                runs.append((name, which, layer, x))
        best = fastest_times([lambda layer=layer, x=x: layer(x) for _, _, layer, x in runs], _TIMING_REPEATS)
        for (name, which, _, _), seconds in zip(runs, best):
            totals[name][which] += kernels[name][shape][1] * seconds
    return {name: KernelCost(floors[name], *totals[name]) if name in totals
            else KernelCost(None, float("inf"), float("inf")) for name in kernels}


def layer_dtype(layer: nn.Module) -> torch.dtype:
    return layer.dtype if isinstance(layer, PackedLinear) else layer.weight.dtype


def float_linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module.weight.is_floating_point()]


@torch.no_grad()
def pack_linear_layers(model: nn.Module, packed: dict[int, PackedLinear] | None = None) -> int:
    """Replace every float ``nn.Linear`` of ``model`` by a PackedLinear (``packed``:
    ones already made, by id of the layer they replace); returns how many."""
    targets = float_linear_layers(model)
    for name, linear in targets:
        replace_submodule(model, name, (packed or {}).get(id(linear)) or PackedLinear(linear))
    _copy_out_of_checkpoint(model)
    return len(targets)


def _copy_out_of_checkpoint(model: nn.Module) -> None:
    """Give every tensor the model still holds memory of its own (one held in
    two places, as a tied weight is, stays one tensor), so none points into a
    memory-mapped checkpoint and the mapping goes with the replaced layers."""
    copies: dict[int, torch.Tensor] = {}

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            copy = tensor.detach().clone()
            copies[id(tensor)] = nn.Parameter(copy, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copy
        return copies[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = own(tensor)
        if isinstance(module, PackedLinear) and module.bias is not None:
            module.bias = own(module.bias)


@torch.inference_mode()
def choose_linear_kernel(model: nn.Module, budget: int, kernel: str = "auto") -> str:
    """``auto``: measure both kernels over ``model``'s float ``nn.Linear`` shapes
    (forwards of up to ``budget`` rows) and, where the prepacked one is usable and
    costs less, replace every such layer by a PackedLinear; ``default`` or
    ``onednn-packed``: that kernel, unmeasured. Returns the kernel kept."""
    if kernel not in KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    targets = float_linear_layers(model)
    if kernel == PACKED:
        if not available():
            raise ValueError("linear_kernel onednn-packed: this torch has no oneDNN linear kernel")
        pack_linear_layers(model)
        return PACKED
    if kernel == DEFAULT or not targets or not available():
        return DEFAULT
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    shapes: dict[tuple, tuple[nn.Linear, int]] = {}
    for _, linear in targets:
        shape = (linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        first, count = shapes.get(shape, (linear, 0))
        shapes[shape] = (first, count + 1)
    try:
        made = {id(layer): PackedLinear(layer) for layer, _ in shapes.values()}
        costs = _costs({DEFAULT: shapes,
                        PACKED: {shape: (made[id(layer)], count) for shape, (layer, count) in shapes.items()}},
                       min(budget, CHOICE_ROWS), generator)
    except RuntimeError as error:  # a oneDNN build without this kernel for the dtype
        log.info("linear kernel: default (the prepacked kernel failed here: %s)", error)
        return DEFAULT
    default, packed = costs[DEFAULT], costs[PACKED]
    cheaper = packed.seconds <= SWITCH_SHARE * default.seconds
    chosen = PACKED if packed.usable and (not default.usable or cheaper) else DEFAULT
    if chosen == PACKED:
        pack_linear_layers(model, made)
    log.info("linear kernel: %s (measured in %.1f s over %d shapes; default: floor %s, %.1f + %.1f ms; "
             "prepacked: floor %s, %.1f + %.1f ms at the floor + at %d rows)", chosen,
             time.perf_counter() - started, len(shapes), default.floor, 1e3 * default.step_seconds,
             1e3 * default.verify_seconds, packed.floor, 1e3 * packed.step_seconds, 1e3 * packed.verify_seconds,
             VERIFY_ROWS)
    return chosen
