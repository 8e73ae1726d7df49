"""Per-sequence, row-invariant attention (cpu_engine/attention.py).

A row's attention output must be bitwise the same whether the row is decoded
alone (a plain step), verified with other rows, computed in a prompt's
prefill, or in a packed forward next to other sequences. The fast tests check
that on random tensors; the slow ones on the real target, end to end.
"""


import pytest

torch = pytest.importorskip("torch")

from cpu_engine import attention  # noqa: E402

SEQUENCE = 704  # positions 0..703: key lengths 1..704
# Block starts around canonical-length boundaries (a block straddling one is
# computed in two passes) and in between.
OFFSETS = sorted({0, 1, 5, 30, 57, 58, 59, 63, 64, 100, 121, 125, 127, 128, 190, 250, 255, 256, 300, 383, 444,
                  505, 509, 512, 600, 639, 640, 690, SEQUENCE - 12})
# (query heads, key/value heads, head dim): grouped-query (the 1.5B target's 12/2), multi-query, multi-head
HEADS = [(12, 2, 128), (14, 2, 64), (8, 1, 64), (4, 4, 32)]


@pytest.fixture
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


class Sequence:
    """Queries, keys and values of one token sequence."""

    def __init__(self, heads, kv_heads, dim, dtype, seed=0):
        self.generator = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim, self.dtype = heads, kv_heads, dim, dtype
        self.query = self.random(heads, SEQUENCE)
        self.key, self.value = self.random(kv_heads, SEQUENCE), self.random(kv_heads, SEQUENCE)

    def random(self, heads, rows):
        return torch.randn(1, heads, rows, self.dim, generator=self.generator).to(self.dtype)

    def rows(self, offset, count, later_keys=0):
        """Attention output [1, count, heads, d] of rows offset..offset+count-1; the
        keys may run ``later_keys`` past the last row (a longer block's own keys)."""
        end = offset + count
        keys = end + later_keys
        return attention.attend_rows(self.query[:, :, offset:end], self.key[:, :, :keys], self.value[:, :, :keys],
                                     offset, 0.125)


def check_rows(sequence, counts):
    alone = {}  # position -> the row as a plain step computes it
    for offset in OFFSETS:
        for count in counts:
            output = sequence.rows(offset, count)
            assert output.shape == (1, count, sequence.heads, sequence.dim)
            for row in range(count):
                position = offset + row
                if position not in alone:
                    alone[position] = sequence.rows(position, 1)[:, 0]
                assert torch.equal(output[:, row], alone[position]), (offset, count, row)


@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,kv_heads,dim", HEADS)
def test_a_row_in_a_block_equals_the_row_decoded_alone(heads, kv_heads, dim, dtype, threads):
    # 1..8 rows: a plain step and verifications of up to 7 drafts; 9 and 12:
    # more rows than one attention block (a prefill chunk, a long verification)
    check_rows(Sequence(heads, kv_heads, dim, dtype), (1, 2, 3, 5, 7, 8, 9, 12))


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_targets_shapes_on_two_threads(dtype, threads):
    check_rows(Sequence(12, 2, 128, dtype), (1, 2, 5, 8, 11))


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_prefill_in_stacked_blocks_equals_its_rows_decoded_alone(dtype, threads):
    """With the stack measured on this machine, blocks of one key length share a
    batched matmul; each row still comes out as a plain step computes it."""
    sequence = Sequence(12, 2, 128, dtype, seed=4)
    stack = attention.measure_stack(12, 2, 128, dtype, SEQUENCE + attention.KEY_BLOCK)
    for offset, count in ((0, 300), (57, 140), (121, 9), (250, 454)):
        end = offset + count
        stacked = attention.attend_rows(sequence.query[:, :, offset:end], sequence.key[:, :, :end],
                                        sequence.value[:, :, :end], offset, 0.125, stack=stack)
        for row in range(count):
            assert torch.equal(stacked[:, row], sequence.rows(offset + row, 1)[:, 0]), (stack, offset, row)


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_row_does_not_depend_on_the_layout_of_its_keys(dtype, threads):
    """A row's canonical key range is a zero-padded copy where the cache is shorter
    than it (a decode step) and a view of the cache where it is longer (a row
    early in a prefill chunk): both must give the row the same bits."""
    sequence = Sequence(12, 2, 128, dtype, seed=5)
    for offset, count in ((0, 130), (190, 8), (255, 1), (640, 64)):
        end = offset + count
        query = sequence.query[:, :, offset:end]
        exact = attention.attend_rows(query, sequence.key[:, :, :end], sequence.value[:, :, :end], offset, 0.125)
        for room in (64, 320, 2 * SEQUENCE - end):
            keys = torch.nn.functional.pad(sequence.key[:, :, :end], (0, 0, 0, room))
            values = torch.nn.functional.pad(sequence.value[:, :, :end], (0, 0, 0, room))
            assert torch.equal(attention.attend_rows(query, keys, values, offset, 0.125), exact), (offset, room)


def test_a_stack_whose_blocks_change_bits_is_not_used(monkeypatch):
    """A kernel that computes a block of a batch of 4 or more otherwise than alone
    (simulated: a different last bit): the measured stack stops at 2."""
    exact = attention._attend_blocks

    def kernel(blocks, group, *args):
        out = exact(blocks, group, *args)
        return out if len(group) < 4 else out + out.abs() * 2.0 ** -7
    monkeypatch.setattr(attention, "_attend_blocks", kernel)
    assert attention.measure_stack(4, 2, 16, torch.bfloat16, 256) == 2


def test_blocks_are_cut_where_their_rows_key_length_changes():
    parts = attention.passes(offset=60, count=12)  # positions 60..71: lengths 64 (60..63) and 128
    assert [(p.block, p.offset, p.start, p.stop, p.length) for p in parts] == [
        (0, 60, 0, 4, 64), (0, 60, 4, 8, 128), (1, 68, 0, 4, 128)]
    assert attention.probed_lengths(2048)[:2] == [64, 128] and attention.probed_lengths(2048)[-3:] == [1536, 1792, 2048]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_whole_prefill_equals_its_rows_decoded_one_by_one(dtype):
    sequence = Sequence(12, 2, 128, dtype, seed=3)
    prefill = sequence.rows(0, 300)
    for position in (0, 7, 8, 63, 64, 65, 199, 299):
        assert torch.equal(prefill[:, position], sequence.rows(position, 1)[:, 0]), position


def test_packed_segments_are_attended_each_against_their_own_keys():
    """Three sequences and padding in one packed block: each sequence's rows come
    out as if it were alone, its keys are appended to its own cache, padding is 0."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 12, 2, 64
    caches, cached = [], (5, 70, 130)
    for length in cached:
        kv = attention.SequenceKV(layers=1)
        kv.append(0, torch.randn(1, kv_heads, length, dim).bfloat16(), torch.randn(1, kv_heads, length, dim).bfloat16())
        caches.append(kv)
    new_rows = (1, 5, 3)
    total = sum(new_rows) + 2  # two padding rows
    query = torch.randn(1, heads, total, dim).bfloat16()
    key = torch.randn(1, kv_heads, total, dim).bfloat16()
    value = torch.randn(1, kv_heads, total, dim).bfloat16()
    segments, start = [], 0
    for kv, rows in zip(caches, new_rows):
        segments.append(attention.Segment(start, start + rows, kv))
        start += rows
    segments.append(attention.Segment(start, total, None))
    expected = []
    for kv, segment in zip(caches, segments):
        keys = torch.cat([kv.keys[0], key[:, :, segment.start:segment.stop]], dim=2)
        values = torch.cat([kv.values[0], value[:, :, segment.start:segment.stop]], dim=2)
        expected.append(attention.attend_rows(query[:, :, segment.start:segment.stop], keys, values,
                                              kv.get_seq_length(), 0.1))

    class Layer:
        layer_idx = 0

    with attention.packed(segments):
        output, _ = attention.packed_attention(Layer(), query, key, value, None, 0.1)
    for kv, segment, want, length, rows in zip(caches, segments, expected, cached, new_rows):
        assert torch.equal(output[:, segment.start:segment.stop], want)
        assert kv.get_seq_length() == length + rows
    assert not output[:, start:].any()
    caches[1].crop(72)
    assert caches[1].get_seq_length() == 72


def test_outside_a_packed_forward_it_is_causal_attention_over_one_sequence():
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 4, 3, 16, generator=generator)
    key, value = torch.randn(1, 2, 10, 16, generator=generator), torch.randn(1, 2, 10, 16, generator=generator)
    output, _ = attention.packed_attention(None, query, key, value, None, 0.25)
    assert torch.allclose(output.double(), reference(query, key, value, 0.25, offset=7), atol=1e-5)
    with pytest.raises(ValueError, match="one sequence"):
        attention.packed_attention(None, query.expand(2, -1, -1, -1), key, value, None, 0.25)


def reference(query, key, value, scaling, offset, sliding_window=None):
    """Causal grouped-query attention in float64."""
    groups = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(groups, dim=1)
    value = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ key.transpose(-1, -2) * scaling
    rows = torch.arange(offset, offset + query.shape[2]).unsqueeze(1)
    cols = torch.arange(key.shape[2]).unsqueeze(0)
    hidden = cols > rows
    if sliding_window is not None:
        hidden |= cols <= rows - sliding_window
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (probs @ value).transpose(1, 2)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("queries,offset", [(1, 0), (8, 0), (8, 60), (5, 123), (16, 250), (40, 0), (300, 20)])
@pytest.mark.parametrize("sliding_window", [None, 50])
def test_attention_is_causal_attention(queries, offset, dtype, tolerance, sliding_window):
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 12, queries, 64, generator=generator).to(dtype)
    key = torch.randn(1, 2, offset + queries, 64, generator=generator).to(dtype)
    value = torch.randn(1, 2, offset + queries, 64, generator=generator).to(dtype)
    output = attention.attend_rows(query, key, value, offset, 0.125, sliding_window=sliding_window)
    expected = reference(query, key, value, 0.125, offset, sliding_window)
    assert output.shape == (1, queries, 12, 64) and output.dtype == dtype
    assert torch.allclose(output.double(), expected, atol=tolerance, rtol=0)


def test_canonical_lengths():
    block = attention.KEY_BLOCK
    assert [attention.canonical_length(p) for p in (0, block - 1, block, 2 * block - 1)] == [block, block, 2 * block,
                                                                                            2 * block]


# ---- the real target: speculation is bitwise-identical to plain decoding --------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_blocks_rows_are_the_same_however_the_forwards_carried_them(dtype):
    """A prompt's whole blocks attend a block a call (attend_prompt_blocks): a
    block carried in two forwards, or from a cached prefix that ends inside it,
    gives its rows the bits the whole block gives them, and it is causal
    attention."""
    block, heads, kv_heads, dim = 16, 12, 2, 32
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, heads, 3 * block, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, 3 * block, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, 3 * block, dim, generator=generator).to(dtype)
    whole = attention.attend_prompt_blocks(query, key, value, 0, 0.3, block)
    for start, stop in [(0, 16), (16, 48), (5, 16), (21, 40), (40, 48)]:
        part = attention.attend_prompt_blocks(query[:, :, start:stop], key[:, :, :stop], value[:, :, :stop],
                                              start, 0.3, block)
        assert torch.equal(part, whole[:, start:stop]), (start, stop)
    reference = attention.attend_rows(query.float(), key.float(), value.float(), 0, 0.3)
    assert torch.allclose(whole.float(), reference, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_prompt_blocks_whose_rows_depend_on_each_other_are_not_used(monkeypatch):
    assert attention.prompt_blocks_agree(12, 2, 32, torch.float32, 16, 64)
    real = torch.nn.functional.scaled_dot_product_attention

    def mixing(query, *args, **kwargs):  # each row's output moved by the block's mean query
        return real(query, *args, **kwargs) + query.mean(dim=2, keepdim=True) * 1e-3

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", mixing)
    assert not attention.prompt_blocks_agree(12, 2, 32, torch.float32, 16, 64)
