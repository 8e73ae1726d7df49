"""Weight-only quantization of a model's linear layers, for a cheaper draft step.

A one-token decode step on CPU is memory-bound: its cost is reading every
weight once, so halving (int8) or quartering (int4) the bytes of the linear
weights cuts the step almost proportionally, while activations stay in the
model's dtype. Only ``nn.Linear`` layers are replaced (including a tied
``lm_head``, which on a 0.5B model is a large share of the weights read per
step); attention, norms and the embedding lookup are untouched, so this works
with either attention implementation of the engine.

Meant for the DRAFT: the target verifies every draft token, so the draft's
precision changes only the acceptance rate, never the served output. This is
what GPU deployments do too (int8/int4-AWQ weight-only TensorRT-LLM drafts).

Schemes (torch's CPU kernels):

* ``int8``: symmetric, one scale per output channel,
  ``aten._weight_int8pack_mm``.
* ``int4``: asymmetric, one scale and zero point per ``group_size`` input
  channels, ``aten._weight_int4pack_mm_for_cpu``.

Kernel limits and what happens to a layer outside them: int4 needs the output
size divisible by 16 and a group size of 32, 64, 128 or 256 that divides the
input size; if ``group_size`` does not divide it, the largest smaller allowed
group size that does is used (finer groups: never less accurate). A layer that
fits no int4 group, or whose output size is not a multiple of 16, falls back
to int8. int8 needs the input size divisible by 16 (the kernel crashes on
other sizes with more than one row); a layer that fails that stays unquantized.
``quantize_linear_layers`` returns what each layer got.

Only small forwards are memory-bound. Over many rows (a prompt's prefill)
these kernels are compute-bound, and where the CPU multiplies the model's
dtype natively the dense GEMM is much faster: each quantized layer keeps a
reference to the original weights and uses them for forwards over more than
``dense_rows`` rows (``DENSE_ROWS`` until measured). Whether the dense weights
pay depends on the CPU, so ``choose_dense_rows`` measures it at start-up. With
torch 2.13, a bfloat16 0.5B draft, 2 threads (``python -m
tools.measure_forwards --weight-quantization int4,none --dense-rows 0``): on an
Intel Xeon with AMX the dense layers were the faster above 8 rows; on an AMD
EPYC with AVX2 only (bfloat16 emulated), a 64-row forward took 1.05 s on the
int4 kernels and 3.4 s on the dense weights, so there the dense weights are
never used and are dropped (``dense_rows=0``).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from cpu_engine.timing import fastest_times

log = logging.getLogger(__name__)

SCHEMES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
_INT8_K_MULTIPLE = 16
_INT4_N_MULTIPLE = 16
# Forwards over more rows than this (prompt prefill) use the original weights until
# choose_dense_rows has measured where they pay: see the module docstring.
DENSE_ROWS = 8
# Row counts choose_dense_rows times both paths at (those above the forward's most are skipped).
DENSE_PROBE_ROWS = (16, 32, 64)
_DENSE_TIMING_REPEATS = 2


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"weight_quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    return scheme


class WeightOnlyLinear(nn.Module):
    """A linear layer with quantized weights; input and output in ``dtype``."""

    def __init__(self, linear: nn.Linear, dense_rows: int = 0):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        # Forwards over more than dense_rows rows use the original weights (0: never; they are dropped).
        self.dense_rows = dense_rows
        self.register_buffer("dense_weight", linear.weight.detach() if dense_rows > 0 else None)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] contiguous, self.dtype
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.dense_weight is not None and rows.shape[0] > self.dense_rows:
            out = nn.functional.linear(rows.to(self.dtype), self.dense_weight, self.bias)
        else:
            if rows.shape[0] == 0:
                out = rows.new_zeros(0, self.out_features, dtype=self.dtype)
            else:
                out = self._matmul(rows.to(self.dtype).contiguous())
            if self.bias is not None:
                out = out + self.bias
        return out.to(x.dtype).view(*leading, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 [out, in] weight this layer computes with (for tests)."""
        raise NotImplementedError


class Int8WeightOnlyLinear(WeightOnlyLinear):
    """Symmetric int8 weights, one scale per output channel."""

    def __init__(self, linear: nn.Linear, dense_rows: int = 0):
        super().__init__(linear, dense_rows)
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
        quantized = torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8)
        self.register_buffer("weight_int8", quantized.contiguous())
        self.register_buffer("scales", scales.to(self.dtype))

    def _matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)

    def dequantized_weight(self):
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int4WeightOnlyLinear(WeightOnlyLinear):
    """Asymmetric int4 weights, one scale and zero point per group of input channels.

    q = clamp(round((w - min) / scale), 0, 15) with scale = (max - min) / 15;
    the kernel computes w ~= (q - 8) * scale + zero, so zero = min + 8 * scale.
    """

    def __init__(self, linear: nn.Linear, group_size: int, dense_rows: int = 0):
        super().__init__(linear, dense_rows)
        out_features, in_features = linear.weight.shape
        self.group_size = group_size
        groups = linear.weight.detach().float().reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scales = ((high - low) / 15).clamp(min=1e-8)
        quantized = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        zeros = low + 8 * scales
        # the kernel's layout: [in / group, out, (scale, zero)]
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous().to(self.dtype)
        )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            quantized.reshape(out_features, in_features).to(torch.int32).contiguous(), 2
        )
        self.register_buffer("weight_int4", packed)

    def _matmul(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_int4, self.group_size, self.scales_and_zeros)

    def dequantized_weight(self):
        # Recover the weight by multiplying the identity (exact: one nonzero per row).
        eye = torch.eye(self.in_features, dtype=torch.float32)
        scales_and_zeros = self.scales_and_zeros.float()
        columns = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, self.group_size, scales_and_zeros)
        return columns.T.contiguous()

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 group_size={self.group_size}")


def int4_group_size(in_features: int, out_features: int, group_size: int) -> int | None:
    """The int4 group size a layer gets: ``group_size`` if it divides the input
    size, else the largest smaller allowed size that does; None if none fits."""
    if out_features % _INT4_N_MULTIPLE:
        return None
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if size <= group_size and in_features % size == 0:
            return size
    return None


def quantize_linear(linear: nn.Linear, scheme: str, group_size: int = 64,
                    dense_rows: int = 0) -> tuple[nn.Module, str]:
    """The replacement of one linear layer and a short description of what it got."""
    check_scheme(scheme)
    if scheme == "none":
        return linear, "none"
    if scheme == "int4":
        size = int4_group_size(linear.in_features, linear.out_features, group_size)
        if size is not None:
            return Int4WeightOnlyLinear(linear, size, dense_rows), f"int4 g{size}"
    if linear.in_features % _INT8_K_MULTIPLE == 0:
        return Int8WeightOnlyLinear(linear, dense_rows), "int8"
    return linear, "none"


def replace_submodule(model: nn.Module, name: str, replacement: nn.Module) -> None:
    """Put ``replacement`` where ``model``'s submodule ``name`` (dotted) is."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)


@torch.no_grad()
def quantize_linear_layers(model: nn.Module, scheme: str, group_size: int = 64,
                           dense_rows: int = DENSE_ROWS) -> dict[str, str]:
    """Replace every ``nn.Linear`` of ``model`` in place by a weight-only
    quantized one (``scheme``: none, int8 or int4; ``group_size``: int4's group
    of input channels, one of 32, 64, 128, 256). Forwards over more than
    ``dense_rows`` rows keep using the original weights (0: drop them and always
    use the quantized ones). Returns layer name -> what it got (``int8``,
    ``int4 g<size>`` or ``none``; see the module docstring for the fallbacks)."""
    check_scheme(scheme)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size!r}")
    if dense_rows < 0:
        raise ValueError(f"dense_rows must be >= 0, got {dense_rows}")
    if scheme == "none":
        return {}
    chosen: dict[str, str] = {}
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        replacement, description = quantize_linear(linear, scheme, group_size, dense_rows)
        chosen[name] = description
        if replacement is not linear:
            replace_submodule(model, name, replacement)
    log.info("weight_quantization %s: %s", scheme, dict(Counter(chosen.values())))
    return chosen


@torch.no_grad()
def time_dense_and_quantized(layer: "WeightOnlyLinear", rows: int, generator: torch.Generator) -> tuple[float, float]:
    """Seconds of one forward of ``rows`` rows through ``layer``'s original weights and through its
    quantized kernel (cpu_engine/timing.py)."""
    x = torch.randn(rows, layer.in_features, generator=generator).to(layer.dtype)
    dense, quantized = fastest_times((lambda: nn.functional.linear(x, layer.dense_weight, layer.bias),
                                      lambda: layer._matmul(x)), _DENSE_TIMING_REPEATS)
    return dense, quantized


@torch.no_grad()
def choose_dense_rows(model: nn.Module, most_rows: int, measure=time_dense_and_quantized) -> int:
    """Time, over one layer of each distinct quantized shape (weighted by how many the model has),
    the original weights against the quantized kernels at ``DENSE_PROBE_ROWS`` rows, the largest
    first (``measure``: layer, rows, generator -> (dense, quantized) seconds), and set every
    quantized layer's ``dense_rows`` to the count above which the original weights are faster at
    every larger probe. Where they never are, they are dropped (0). Returns the ``dense_rows`` set."""
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear) and m.dense_weight is not None]
    probes = [rows for rows in DENSE_PROBE_ROWS if rows <= most_rows]
    if not layers or not probes:
        return layers[0].dense_rows if layers else 0
    shapes: dict[tuple, list] = {}
    for layer in layers:
        shapes.setdefault((type(layer), layer.in_features, layer.out_features), [layer, 0])[1] += 1
    generator = torch.Generator().manual_seed(0)
    dense: dict[int, float] = {}
    quantized: dict[int, float] = {}
    chosen = 0
    for index in reversed(range(len(probes))):  # largest first: where dense loses there, it is never kept
        rows = probes[index]
        dense[rows] = quantized[rows] = 0.0
        for layer, count in shapes.values():
            dense_seconds, quantized_seconds = measure(layer, rows, generator)
            dense[rows] += count * dense_seconds
            quantized[rows] += count * quantized_seconds
        if dense[rows] > quantized[rows]:
            break
        chosen = DENSE_ROWS if index == 0 else probes[index - 1]
    for layer in layers:
        layer.dense_rows = chosen
        if chosen == 0:
            layer.dense_weight = None
    log.info("quantized layers: %s (linear layers over %s rows: original weights %s ms, quantized %s ms)",
             f"the original weights above {chosen} rows" if chosen else "the quantized kernels at every row count, "
             "the original weights dropped", "/".join(map(str, sorted(dense))),
             "/".join(f"{dense[r] * 1e3:.0f}" for r in sorted(dense)),
             "/".join(f"{quantized[r] * 1e3:.0f}" for r in sorted(dense)))
    return chosen
