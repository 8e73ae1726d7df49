"""Per-sequence, row-invariant attention (cpu_engine/attention.py).

A row's attention output must be bitwise the same whether the row is decoded
alone (a plain step), verified with other rows, computed in a prompt's
prefill, or in a packed forward next to other sequences. The fast tests check
that on random tensors; the slow ones on the real target, end to end.
"""

import itertools

import numpy as np
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

TOKENS = 32
# Draft counts of successive verify rounds, repeated until all TOKENS are
# verified: each chain starts at the prompt and continues from the previous
# round's cache, as speculation does; together the two chains verify every
# draft count from 1 to 7. The prompts (118 and 166 tokens) plus 32 tokens
# cross a KEY_BLOCK boundary, so some blocks are computed in two passes.
CHAINS = [(1, 2, 3, 4, 5, 6, 7), (7, 6, 5, 4, 3, 2, 1)]


def served_dtype() -> str:
    """The dtype the server's target engine computes in on this machine (its
    config says ``auto``: bfloat16 where the CPU has native bfloat16, else float32)."""
    from cpu_engine.engine import resolve_dtype
    from tests._config_helpers import model_config, parameter

    return resolve_dtype(parameter(model_config("target", "cpu"), "dtype"))


@pytest.mark.slow
def test_real_target_verification_is_bitwise_plain_decoding(real_target_dir):
    """The real target, found (or prepared) where the server keeps it: SPECDEC_CACHE_DIR, else ~/.cache/specdec,
    in the dtype the server runs it in here."""
    from tokenizers import Tokenizer

    from tools.prompts import load_humaneval
    from cpu_engine.engine import CausalLMEngine, EngineRequest

    engine = CausalLMEngine(str(real_target_dir), dtype=served_dtype(), num_threads=2)
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    problems = load_humaneval()
    for task in ("HumanEval/0", "HumanEval/17"):
        prompt = tokenizer.encode(problems[task], add_special_tokens=True).ids
        assert len(prompt) // attention.KEY_BLOCK < (len(prompt) + TOKENS - 1) // attention.KEY_BLOCK, task
        plain = engine.run(EngineRequest(np.array(prompt), TOKENS, return_logits=True))
        assert len(plain.tokens) == TOKENS
        for chain in CHAINS:
            start = 0
            for drafts in itertools.cycle(chain):
                drafts = min(drafts, TOKENS - start - 1)
                if drafts < 1:
                    break
                request = EngineRequest(np.array(prompt + plain.tokens[:start]), drafts + 1,
                                        draft_tokens=np.array(plain.tokens[start : start + drafts]), return_logits=True)
                verified = engine.run(request)
                stop = start + drafts + 1
                assert verified.tokens == plain.tokens[start:stop], (task, chain, start, drafts)
                assert np.array_equal(verified.logits, plain.logits[start:stop]), (task, chain, start, drafts)
                start = stop


@pytest.mark.slow
def test_real_target_output_is_the_same_alone_and_in_a_crowd(real_target_dir):
    """In-flight batching: a request's tokens and logits are bitwise the same
    whether the target serves it alone or in forwards shared with other
    sequences (plain decoding, verifications and prompt prefills of others).

    The engine has the server's dtype, threads and row budget (max_num_tokens),
    no prefix cache (every call prefills), and one change: max_draft_len. The
    rows a forward may carry are measured at start-up (cpu_engine/rows.py):
    max_num_tokens where the kernels are row-invariant from a floor, but where
    they are not (on an AMX Xeon, bfloat16 over a 64-row budget) every forward
    is padded to max_draft_len + 1 rows (8 at the engine's default), and this
    crowd then shared forwards two sequences at most. With max_draft_len =
    max_num_tokens - 1 a forward carries up to max_num_tokens rows either way,
    so the scheduler builds the same crowd on every machine; what is tested is
    what the server relies on, that a row does not depend on what else its
    forward carries under the row shape the engine measured."""
    from tokenizers import Tokenizer

    from tools.prompts import load_humaneval
    from cpu_engine.engine import CausalLMEngine, EngineRequest
    from tests._config_helpers import model_config, parameter

    served = model_config("target", "cpu")
    max_num_tokens = int(parameter(served, "max_num_tokens"))
    engine = CausalLMEngine(str(real_target_dir), dtype=served_dtype(),
                            num_threads=int(parameter(served, "num_threads")), max_cached_sequences=0,
                            max_num_tokens=max_num_tokens, max_draft_len=max_num_tokens - 1)
    assert engine.row_shape.capacity == max_num_tokens, engine.row_shape.describe()
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    problems = load_humaneval()
    prompts = [tokenizer.encode(problems[task], add_special_tokens=True).ids
               for task in ("HumanEval/2", "HumanEval/11", "HumanEval/23")]
    alone = engine.run(EngineRequest(np.array(prompts[0]), 12, return_logits=True))
    start = 5  # verify plain tokens 5.. with 4 drafts, next to the others
    verify = EngineRequest(np.array(prompts[0] + alone.tokens[:start]), 5,
                           draft_tokens=np.array(alone.tokens[start:start + 4]), return_logits=True)
    crowd = [engine.submit(EngineRequest(np.array(prompts[0]), 12, return_logits=True)),
             engine.submit(EngineRequest(np.array(prompts[1]), 9)),
             engine.submit(verify),
             engine.submit(EngineRequest(np.array(prompts[2] * 2), 3))]  # a prefill longer than the row budget
    sizes = set()
    while not all(call.finished for call in crowd):
        engine.step()
        sizes.add(engine.last_forward)
    print(f"crowd forwards (sequences, rows): {sorted(sizes)}; {engine.row_shape.describe()}")
    assert max(sequences for sequences, _ in sizes) >= 3, sorted(sizes)  # the calls did share forwards
    together = engine.result(crowd[0])
    assert together.tokens == alone.tokens and np.array_equal(together.logits, alone.logits)
    verified = engine.result(crowd[2])
    assert verified.tokens == alone.tokens[start:start + 5]
    assert np.array_equal(verified.logits, alone.logits[start:start + 5])
