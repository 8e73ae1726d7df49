"""A prompt's leading blocks through larger kernel calls (cpu_engine/prompt_blocks.py):
which positions, the start-up check and choice, and the settings."""

import pytest

torch = pytest.importorskip("torch")

from cpu_engine import prompt_blocks  # noqa: E402
from cpu_engine.prompt_blocks import PromptBlock, block_agrees, measure_prompt_block, prompt_path  # noqa: E402

BLOCK = PromptBlock(128)  # no size for a prompt's rest: it goes through the small calls


def test_the_prompt_path_is_the_prompts_whole_blocks():
    assert prompt_path(300, 300, BLOCK) == 256
    assert prompt_path(257, 400, BLOCK) == 256  # the prompt's last token (position 256) is a small call's row
    assert prompt_path(256, 400, BLOCK) == 256  # the last token (position 255) in the second block's call
    assert prompt_path(100, 100, BLOCK) == 0
    assert prompt_path(300, 200, BLOCK) == 128  # a prompt_length past the call's input counts the input
    assert prompt_path(None, 300, BLOCK) == prompt_path(300, 300, None) == 0


# seconds a row, as measured with 256-row blocks on a 2-vCPU Intel Xeon with AMX (bfloat16, the 1.5B target)
LADDER = PromptBlock(256, ((64, 1.70e-3), (128, 1.35e-3), (192, 1.10e-3), (256, 1.05e-3)), small=2.45e-3)


def test_a_prompts_rest_is_padded_to_the_size_that_costs_least_where_that_beats_the_small_calls():
    assert LADDER.rest_call(101) == 128  # 173 ms padded to 128 rows; 218 to 192, 269 to 256, 247 in small calls
    assert LADDER.rest_call(60) == 64  # 109 ms against 147
    assert LADDER.rest_call(44) is None  # 109 ms padded against 108 in small calls
    assert LADDER.rest_call(150) == 192 and LADDER.rest_call(255) == 256
    assert prompt_path(358, 358, LADDER) == 358 and prompt_path(300, 300, LADDER) == 256
    assert prompt_path(358, 300, LADDER) == 256  # the call's input bounds it (a 43-row rest)
    assert prompt_path(100, 100, LADDER) == 100  # a prompt shorter than a block, in one 128-row call


def test_two_paths_agree_up_to_where_their_positions_go_through_calls_of_one_size():
    assert LADDER.call_of(357, 100) == 256 and LADDER.call_of(357, 300) == 128
    assert LADDER.agreement(357, 356) == 356  # both rests in 128-row calls from position 256
    assert LADDER.agreement(357, 400) == 256  # a 101-row rest in a 128-row call, a 144-row one in a 192-row call
    assert LADDER.agreement(357, 512) == 256  # positions 256.. in a 128-row call against a 256-row one
    assert LADDER.agreement(256, 357) == 256 and LADDER.agreement(512, 768) == 512
    assert PromptBlock(128).agreement(256, 384) == 256


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
    costs = {64: (share * 1e-6, 1e-6), 128: (share * 1e-6, 1e-6), 256: (0.99e-6, 1e-6)}
    monkeypatch.setattr(prompt_blocks, "_seconds_per_row", lambda shapes, size, *args: costs[size])
    chosen = measure_prompt_block(torch.nn.Sequential(PlaceDependent()), 32)
    assert (chosen and chosen.rows) == kept
    if kept:  # 64-row calls measured too for a prompt's rest (the fake's cost of 128)
        assert chosen == PromptBlock(128, ((64, share * 1e-6), (128, share * 1e-6)), small=1e-6)
        assert chosen.rest_call(40) == 64 and chosen.rest_call(70) == 128
