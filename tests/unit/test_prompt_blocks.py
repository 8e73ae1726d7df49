"""A prompt's leading blocks through larger kernel calls (cpu_engine/prompt_blocks.py):
which positions, the start-up check and choice, and the settings."""

import pytest

torch = pytest.importorskip("torch")

from cpu_engine import prompt_blocks  # noqa: E402
from cpu_engine.prompt_blocks import PromptBlock, block_agrees, measure_prompt_block, padded_from, prompt_path  # noqa: E402,E501


def test_the_prompt_path_is_the_prompts_whole_blocks_short_of_its_last_token():
    assert prompt_path(300, 300, 128) == 256
    assert prompt_path(257, 400, 128) == 256  # the prompt's last token (position 256) is a decode row
    assert prompt_path(256, 400, 128) == 128
    assert prompt_path(100, 100, 128) == 0
    assert prompt_path(300, 200, 128) == 128  # a prompt_length past the call's input counts the input
    assert prompt_path(None, 300, 128) == prompt_path(300, 300, None) == 0


def test_a_prompts_rest_joins_its_blocks_padded_from_the_measured_length():
    assert prompt_path(300, 300, 128, padded_from=65) == 256  # a 43-row rest: small calls
    assert prompt_path(358, 358, 128, padded_from=65) == 357  # a 101-row rest: one more call, padded
    assert prompt_path(322, 322, 128, padded_from=65) == 321  # 65 rows: the least that is padded
    assert prompt_path(321, 321, 128, padded_from=65) == 256
    assert prompt_path(358, 300, 128, padded_from=65) == 256  # the call's input bounds it
    assert prompt_path(100, 100, 128, padded_from=65) == 99  # a prompt shorter than a block, padded to one
    assert prompt_path(358, 358, 128, padded_from=None) == 256


def test_the_rest_is_padded_from_where_one_call_costs_less_than_its_rows_in_small_calls():
    assert padded_from(128, mine=0.945e-3, theirs=1.86e-3) == 66  # 65 rows: 120.9 ms in small calls, 121.0 ms padded
    assert padded_from(256, mine=0.874e-3, theirs=1.775e-3) == 127
    assert padded_from(128, mine=1e-3, theirs=1e-3) is None  # never cheaper than its rows in small calls


class PlaceDependent(torch.nn.Linear):
    """Exact sums (integer weights and inputs), but a call's rows past ``limit``
    rounded another way, as a kernel's remainder path does."""

    def __init__(self, limit=None):
        super().__init__(8, 4, bias=False)
        self.limit = limit
        with torch.no_grad():
            self.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(2)).mul(4).round())

    def forward(self, x):
        out = x.mul(4).round() @ self.weight.T
        if self.limit is not None and x.shape[0] > self.limit:
            out = out.clone()
            out[self.limit:] += 1e-3
        return out


def test_a_size_whose_rows_depend_on_their_place_in_the_call_is_refused():
    generator = torch.Generator().manual_seed(0)
    assert block_agrees(PlaceDependent(), 8, 16, torch.float32, generator)
    assert not block_agrees(PlaceDependent(limit=12), 8, 16, torch.float32, generator)


def test_settings_name_the_valid_ones_and_a_forced_size_must_be_row_invariant():
    model = torch.nn.Sequential(PlaceDependent())
    with pytest.raises(ValueError, match="prompt_block must be one of auto, none, 128, 256, got '64'"):
        measure_prompt_block(model, 32, "64")
    assert measure_prompt_block(model, 32, "none") is None
    assert measure_prompt_block(model, 32, "128").rows == 128
    with pytest.raises(ValueError, match="calls of 128 rows do not give a row the same bits"):
        measure_prompt_block(torch.nn.Sequential(PlaceDependent(limit=100)), 32, "128")


@pytest.mark.parametrize(("share", "kept"), [(0.5, 128), (0.95, None)])
def test_auto_keeps_the_fastest_size_only_where_it_clearly_beats_the_small_calls(monkeypatch, share, kept):
    costs = {128: (share * 1e-6, 1e-6), 256: (0.99e-6, 1e-6)}
    monkeypatch.setattr(prompt_blocks, "_seconds_per_row", lambda shapes, size, *args: costs[size])
    chosen = measure_prompt_block(torch.nn.Sequential(PlaceDependent()), 32)
    assert (chosen and chosen.rows) == kept
    if kept:
        assert chosen == PromptBlock(128, padded_from(128, share * 1e-6, 1e-6)) == PromptBlock(128, 65)
