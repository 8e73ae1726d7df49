"""The start-up measurement of the engine's row shape (cpu_engine/rows.py)."""

import pytest

torch = pytest.importorskip("torch")

from cpu_engine.rows import (RowShape, call_starts, candidate_budgets, invariant_floor,  # noqa: E402
                             measure_row_shape, probe_counts)


def test_every_row_count_up_to_the_budget_is_probed():
    assert probe_counts(64) == list(range(1, 65)) and probe_counts(1) == [1]


def test_a_count_between_powers_of_two_that_rounds_differently_is_found():
    """A kernel whose 40-row calls take another path (as a 48-row blocking's remainder
    might): no floor makes 40 agree, so the budget must not reach it."""
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).mul(4).round()

    def odd_forty(rows):
        out = rows.mul(4).round() @ weight.T
        return out + 1e-3 if rows.shape[0] == 40 else out

    generator = torch.Generator().manual_seed(0)
    assert invariant_floor(odd_forty, 32, 64, torch.float32, generator) is None
    assert invariant_floor(odd_forty, 32, 32, torch.float32, generator) == 1


def kernel_that_rounds_differently_below(rows_threshold):
    """A multiplication whose rows round differently when M < ``rows_threshold`` (as a gemv path does)."""
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).mul(4).round()

    def multiply(rows):
        out = rows.mul(4).round() @ weight.T  # small integers: exact, whatever the kernel
        return out + 1e-3 if rows.shape[0] < rows_threshold else out

    return multiply


@pytest.mark.parametrize("threshold,floor", [(1, 1), (2, 2), (3, 4), (8, 8), (9, None)])
def test_the_floor_is_the_smallest_from_which_every_row_count_agrees(threshold, floor):
    generator = torch.Generator().manual_seed(0)
    assert invariant_floor(kernel_that_rounds_differently_below(threshold), 32, 24, torch.float32, generator) == floor


def test_a_one_row_path_that_rounds_only_some_rows_differently_is_found():
    """As on an Intel Xeon with AMX, where 1-row calls of an 8960-wide bfloat16
    projection rounded about a quarter of the rows differently: a probe of two
    rows per count missed it about half the time (this seed is such a case)."""
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).mul(4).round()

    def some_rows_at_one(rows):
        out = rows.mul(4).round() @ weight.T
        if rows.shape[0] == 1 and rows[0, 0] > 0.67:  # about a quarter of random rows
            out = out + 1e-3
        return out

    assert invariant_floor(some_rows_at_one, 32, 24, torch.float32, torch.Generator().manual_seed(0)) == 2


def test_every_row_is_checked_in_calls_of_every_count():
    assert call_starts(32, 1) == list(range(32)) and call_starts(32, 32) == [0]
    assert call_starts(32, 5) == [0, 5, 10, 15, 20, 25, 27]  # the last call ends at the last row


def test_a_kernel_that_depends_on_the_other_rows_has_no_floor():
    def mixing(rows):  # every row's result depends on the whole block
        return rows + rows.sum(0)

    assert invariant_floor(mixing, 8, 16, torch.float32, torch.Generator().manual_seed(0)) is None


def test_row_shapes():
    shape = RowShape(floor=2, budget=64)
    assert (shape.rows(1), shape.rows(5), shape.capacity) == (2, 5, 64)
    fixed = RowShape(floor=8, budget=8, fixed=8)
    assert (fixed.rows(1), fixed.rows(8), fixed.capacity) == (8, 8, 8)
    assert "padded to 8" in fixed.describe() and "2 to 64" in shape.describe()


def test_a_forward_over_more_rows_than_a_kernel_call_is_cut_into_blocks():
    shape = RowShape(floor=2, budget=32, forward_rows=512)
    assert shape.capacity == 512 and "up to 512 rows" in shape.describe()
    assert shape.blocks(70) == [32, 32, 6] and shape.blocks(33) == [32, 1] and shape.blocks(5) == [5]
    assert (shape.block, shape.least) == (32, 2)  # the 1-row block is computed padded to 2
    fixed = RowShape(floor=8, budget=8, fixed=8, forward_rows=64)
    assert fixed.rows(9) == 16 and fixed.rows(16) == 16 and fixed.blocks(16) == [8, 8]
    assert (fixed.block, fixed.least, fixed.capacity) == (8, 8, 64)


def test_measured_on_a_model_of_linear_layers():
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Linear(48, 16))
    shape = measure_row_shape(model, budget=32, fallback_rows=8)
    if shape.fixed is not None:  # this machine's kernels are not row-invariant at these shapes
        assert shape == RowShape(floor=8, budget=8, fixed=8)
        return
    assert shape.budget in candidate_budgets(32, 8) and shape.floor in (1, 2, 4, 8)
    rows = torch.randn(shape.budget, 16)
    with torch.no_grad():
        full = model(rows)
        for m in range(shape.floor, shape.budget + 1):  # the claim the shape makes, checked at every row count
            assert torch.equal(model(rows[:m]), full[:m]), m


def test_a_kernel_that_rounds_a_row_by_its_place_in_the_block_has_no_floor():
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).mul(4).round()

    def by_place(rows):  # rows past the eighth take a remainder path, whatever M is
        out = rows.mul(4).round() @ weight.T
        out[8:] += 1e-3
        return out

    assert invariant_floor(by_place, 32, 24, torch.float32, torch.Generator().manual_seed(0)) is None


def test_the_engine_package_asks_mkl_for_reproducible_rows():
    import os

    import cpu_engine  # noqa: F401

    assert os.environ.get("MKL_CBWR")


def test_the_budgets_tried_halve_down_to_the_fallback():
    assert candidate_budgets(64, 8) == [64, 32, 16, 8]
    assert candidate_budgets(64, 9) == [64, 32, 16]
    assert candidate_budgets(8, 8) == [8]


class RemainderAbove(torch.nn.Linear):
    """A linear layer whose kernel takes another path (other rounding) for blocks over ``limit`` rows,
    as a blocked kernel's remainder path does on some machines."""

    def __init__(self, limit):
        super().__init__(32, 8, bias=False)
        self.limit = limit
        with torch.no_grad():
            self.weight.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).mul(4).round())

    def forward(self, rows):
        out = rows.mul(4).round() @ self.weight.T  # small integers: exact, whatever the kernel
        if rows.shape[0] > self.limit:
            out[self.limit:] += 1e-3
        return out


@pytest.mark.parametrize("limit,budget", [(64, 64), (40, 32), (32, 32), (20, 16), (9, 8)])
def test_the_budget_is_the_largest_tried_up_to_which_rows_agree(limit, budget):
    shape = measure_row_shape(torch.nn.Sequential(RemainderAbove(limit)), budget=64, fallback_rows=8)
    assert shape == RowShape(floor=1, budget=budget)


class Mixing(RemainderAbove):
    def forward(self, rows):  # every row's result depends on the whole block
        return super().forward(rows) + rows.sum(0, keepdim=True)[:, :8]


def test_rows_that_agree_at_no_budget_down_to_the_fallback_pad_every_forward():
    shape = measure_row_shape(torch.nn.Sequential(Mixing(64)), budget=64, fallback_rows=8)
    assert shape.capacity == 8 and {shape.rows(real) for real in range(1, 9)} == {8}
