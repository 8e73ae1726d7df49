"""The forward-cost ceiling's arithmetic (tools/ceiling.py), with made-up forward times."""

import pytest

from tools.ceiling import Forwards, best, ceilings, recorder, split


def flat(ms, capacity=64):
    """Memory-bound forwards: any row count costs the same."""
    return Forwards(lambda rows: ms, capacity)


def per_row(ms, capacity=64):
    """Compute-bound forwards: cost grows with the rows."""
    return Forwards(lambda rows: ms * rows, capacity)


def test_rows_over_the_budget_take_several_forwards():
    assert split(10, 4) == [4, 4, 2]
    assert split(8, 4) == [4, 4]
    assert flat(100, capacity=4).seconds(10) == pytest.approx(0.3)


def test_plain_decoding_is_prefill_then_one_forward_per_token():
    plain = ceilings(1, 0.8, 4, flat(200, capacity=64), None, prompt_tokens=100, max_tokens=10)[0]
    # 100 prompt rows: two forwards (64 + 36), then 9 more tokens one forward each
    assert plain.window == 0
    assert plain.tokens_per_second == pytest.approx(10 / (0.2 * 2 + 0.2 * 9))


def test_plain_streams_share_memory_bound_forwards():
    one = ceilings(1, 0.8, 4, flat(200), flat(50), prompt_tokens=0, max_tokens=64)[0]
    four = ceilings(4, 0.8, 4, flat(200), flat(50), prompt_tokens=0, max_tokens=64)[0]
    assert four.tokens_per_second == pytest.approx(4 * one.tokens_per_second)


def test_free_drafts_always_accepted_use_the_whole_window():
    results = ceilings(1, 1.0, 6, flat(200), None, prompt_tokens=0, max_tokens=71)
    top = best(results)
    assert top.window == 6
    # 70 tokens after the first in 10 rounds of 7, against 70 forwards
    assert top.tokens_per_second == pytest.approx(71 / (0.2 * 10))
    assert results[0].tokens_per_second == pytest.approx(71 / (0.2 * 70))


def test_speculation_cannot_pay_where_every_row_costs_a_forward():
    results = ceilings(1, 0.9, 8, per_row(200), flat(10), prompt_tokens=0, max_tokens=64)
    assert best(results).window == 0


def test_a_full_batch_leaves_speculation_less_to_gain():
    # Forwards memory-bound up to 8 rows, compute-bound beyond: one stream has
    # idle rows for drafts, eight streams have none.
    target = Forwards(lambda rows: 200 * max(1, rows / 8), 64)

    def speculation_gain(streams):
        results = ceilings(streams, 0.8, 8, target, flat(40), prompt_tokens=0, max_tokens=64)
        return best(results).tokens_per_second / results[0].tokens_per_second

    assert speculation_gain(1) > 1.5
    assert speculation_gain(8) == pytest.approx(1.0)


def test_the_draft_prefills_the_prompt_too():
    without = ceilings(1, 0.8, 4, flat(200), flat(50), prompt_tokens=0, max_tokens=64)[4]
    with_prompt = ceilings(1, 0.8, 4, flat(200), flat(50), prompt_tokens=128, max_tokens=64)[4]
    seconds = 64 / with_prompt.tokens_per_second - 64 / without.tokens_per_second
    assert seconds == pytest.approx(2 * 0.2 + 2 * 0.05)  # two 64-row forwards in each model


def test_the_recorder_notes_every_forward_size_asked_for():
    seen = set()
    ceilings(2, 0.8, 2, recorder(flat(200, capacity=8), seen), None, prompt_tokens=5, max_tokens=4)
    assert seen == {2, 8, 4, 6}  # decode 2 rows; prefill 10 = 8 + 2; verify 4 and 6 rows


def test_a_decode_forward_reads_every_weight_but_an_untied_input_embedding(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from tools.ceiling import decode_weight_bytes

    tensors = {"model.embed_tokens.weight": torch.zeros(100, 8), "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8),
               "lm_head.weight": torch.zeros(100, 8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    assert decode_weight_bytes(str(tmp_path), 4) == (16 * 8 + 100 * 8) * 4
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')  # the output layer reads the embedding
    assert decode_weight_bytes(str(tmp_path), 2) == (100 * 8 + 16 * 8) * 2
