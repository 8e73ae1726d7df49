"""Linear layers over forwards larger than a kernel call's row-invariant
range (cpu_engine/row_blocks.py): every row comes out as a call of the
measured shape computes it."""

import pytest

torch = pytest.importorskip("torch")

from cpu_engine.row_blocks import RowBlockedLinear, block_linear_layers, shaping  # noqa: E402
from cpu_engine.rows import RowShape  # noqa: E402


class ShapeRecorder(torch.nn.Linear):
    """A linear layer that rounds rows past ``limit`` in a call another way (as a
    blocked kernel's remainder path does) and records every call's row count."""

    def __init__(self, limit):
        super().__init__(16, 4, bias=False)
        self.limit, self.calls = limit, []
        with torch.no_grad():
            self.weight.copy_(torch.randn(4, 16, generator=torch.Generator().manual_seed(2)).mul(4).round())

    def forward(self, x):
        rows = x.reshape(-1, 16)
        self.calls.append(rows.shape[0])
        out = rows.mul(4).round() @ self.weight.T
        if rows.shape[0] > self.limit:
            out[self.limit:] += 1e-3
        return out.view(*x.shape[:-1], 4)


def test_a_large_forward_gives_every_row_what_a_call_of_the_shape_gives():
    inner = ShapeRecorder(limit=8)
    layer = RowBlockedLinear(inner)
    shape = RowShape(floor=2, budget=8, forward_rows=64)
    rows = torch.randn(1, 27, 16, generator=torch.Generator().manual_seed(0))
    with shaping(shape):
        out = layer(rows)
    assert inner.calls == [8, 8, 8, 3] and out.shape == (1, 27, 4)
    for start in range(0, 27, 3):  # the same rows in small calls, anywhere in them
        assert torch.equal(out[0, start : start + 3], inner(rows[0, start : start + 3]))
    inner.calls.clear()
    with shaping(shape):
        layer(rows[:, :9])
    assert inner.calls == [8, 2]  # a 1-row remainder is computed padded to the floor
    inner.calls.clear()
    unshaped = layer(rows)  # outside a shaped forward: one call, as the layer computes it
    assert inner.calls == [27] and not torch.equal(unshaped, out)


def test_every_linear_layer_is_wrapped_once_and_a_shared_one_once():
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), shared, shared)
    assert block_linear_layers(model) == 2
    assert isinstance(model[0], RowBlockedLinear) and model[2] is model[3] and model[2].inner is shared
    x = torch.randn(5, 4)
    with shaping(RowShape(floor=1, budget=2)):
        assert torch.allclose(model(x), torch.nn.Sequential(model[0].inner, torch.nn.ReLU(), shared, shared)(x))


def test_runs_of_rows_go_through_calls_of_their_sizes():
    from cpu_engine.row_blocks import merged_runs, prompt_rows

    inner = ShapeRecorder(limit=16)
    layer = RowBlockedLinear(inner)
    shape = RowShape(floor=2, budget=8, forward_rows=64, prompt_block=16)
    rows = torch.randn(1, 27, 16, generator=torch.Generator().manual_seed(1))
    runs = merged_runs([(None, 0, 3), (16, 3, 23), (None, 23, 23), (None, 23, 27)])
    assert runs == [(None, 0, 3), (16, 3, 23), (None, 23, 27)]  # 20 prompt rows between decode rows
    with shaping(shape), prompt_rows(runs):
        out = layer(rows)
    assert sorted(inner.calls) == [7, 16, 16]  # 20 marked rows in two 16-row calls (the last padded), 7 others in one
    marked = torch.nn.functional.pad(rows[0, 19:23], (0, 0, 0, 12))
    assert torch.equal(out[0, 19:23], inner(marked)[:4])  # as a 16-row call computes them
    assert torch.equal(out[0, :3], inner(rows[0, :3])) and torch.equal(out[0, 23:], inner(rows[0, 23:]))
    # one run of each size (the outputs in one copy): a prompt's whole block, its rest padded to 8, a decode row
    inner.calls.clear()
    with shaping(shape), prompt_rows([(16, 0, 16), (8, 16, 21), (None, 21, 22)]):
        out = layer(rows[:, :22])
    assert sorted(inner.calls) == [2, 8, 16]  # the lone decode row padded to the floor
    assert torch.equal(out[0, 16:21], inner(torch.nn.functional.pad(rows[0, 16:21], (0, 0, 0, 3)))[:5])
    assert torch.equal(out[0, :16], inner(rows[0, :16])) and torch.equal(out[0, 21:], inner(rows[0, 21:22]))
    inner.calls.clear()
    with shaping(shape), prompt_rows([(16, 0, 1), (None, 1, 5), (16, 5, 8)]):
        layer(rows[:, :8])
    assert sorted(inner.calls) == [4, 16]  # runs of one size share calls
