"""Row-invariant attention (coordinator/cpu_engine/attention.py).

A decode row's attention output must be bitwise the same whether the row is
decoded alone (a plain step: a block of decode_rows rows with one real row) or
verified inside a block with other real rows and padding. The fast tests check
that on random tensors; the slow one on the real target, end to end.
"""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from coordinator.cpu_engine import attention  # noqa: E402

SEQUENCE = 704  # positions 0..703: key lengths 1..704
# Block starts around canonical-length boundaries (a block straddling one is
# computed in two passes) and in between.
OFFSETS = sorted({0, 1, 5, 30, 57, 58, 59, 63, 64, 100, 121, 125, 127, 128, 190, 250, 255, 256, 300, 383, 444,
                  505, 509, 512, 600, 639, 640, 690, SEQUENCE - 8})
# (query heads, key/value heads, head dim): grouped-query (the 1.5B target's 12/2), multi-query, multi-head
HEADS = [(12, 2, 128), (14, 2, 64), (8, 1, 64), (4, 4, 32)]


@pytest.fixture
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def attend(query, key, value, real, scaling=0.125):
    """The module's forward for one block: query [1, heads, rows, d], key/value [1, kv_heads, keys, d]."""
    with attention.real_rows(real):
        output, _ = attention.row_invariant_attention(None, query, key, value, None, scaling)
    return output  # [1, rows, heads, d]


class Sequence:
    """Queries, keys and values of one token sequence; padding rows get fresh random values."""

    def __init__(self, heads, kv_heads, dim, dtype, seed=0):
        self.generator = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim, self.dtype = heads, kv_heads, dim, dtype
        self.query = self.random(heads, SEQUENCE)
        self.key, self.value = self.random(kv_heads, SEQUENCE), self.random(kv_heads, SEQUENCE)

    def random(self, heads, rows):
        return torch.randn(1, heads, rows, self.dim, generator=self.generator).to(self.dtype)

    def block(self, offset, real, rows):
        """Attention output of a block of ``rows`` rows at ``offset`` whose first ``real`` rows are real."""
        padding = rows - real
        end = offset + real
        query = torch.cat([self.query[:, :, offset:end], self.random(self.heads, padding)], dim=2)
        key = torch.cat([self.key[:, :, :end], self.random(self.kv_heads, padding)], dim=2)
        value = torch.cat([self.value[:, :, :end], self.random(self.kv_heads, padding)], dim=2)
        return attend(query, key, value, real)


def check_rows(sequence, rows, reals):
    alone = {}  # position -> the row as a plain step computes it (a block with one real row)
    for offset in OFFSETS:
        for real in reals:
            output = sequence.block(offset, real, rows)
            assert output.shape == (1, rows, sequence.heads, sequence.dim)
            for row in range(real):
                position = offset + row
                if position not in alone:
                    alone[position] = sequence.block(position, 1, rows)[:, 0]
                assert torch.equal(output[:, row], alone[position]), (rows, offset, real, row)
            assert not output[:, real:].any()  # padding rows are not computed


@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,kv_heads,dim", HEADS)
def test_a_row_in_a_block_equals_the_row_decoded_alone(heads, kv_heads, dim, dtype, threads):
    sequence = Sequence(heads, kv_heads, dim, dtype)
    for rows in range(1, 9):  # decode_rows
        reals = range(1, 9) if rows == 8 else sorted({1, 2, rows // 2, rows - 1, rows} & set(range(1, rows + 1)))
        check_rows(sequence, rows, reals)


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_targets_shapes_on_two_threads(dtype, threads):
    # the engine's configuration: the 1.5B target's heads, decode_rows 8, 2 threads
    check_rows(Sequence(12, 2, 128, dtype), 8, (1, 2, 5, 8))


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
    output, _ = attention.row_invariant_attention(None, query, key, value, None, 0.125, sliding_window=sliding_window)
    expected = reference(query, key, value, 0.125, offset, sliding_window)
    assert output.shape == (1, queries, 12, 64) and output.dtype == dtype
    assert torch.allclose(output.double(), expected, atol=tolerance, rtol=0)


def test_canonical_lengths():
    block = attention.KEY_BLOCK
    assert [attention.canonical_length(p) for p in (0, block - 1, block, 2 * block - 1)] == [block, block, 2 * block,
                                                                                            2 * block]


# ---- the real target: speculation is bitwise-identical to plain decoding --------------------

TOKENS = 48
# Draft counts of successive verify rounds, repeated until all TOKENS are
# verified: each chain starts at the prompt and continues from the previous
# round's cache, as speculation does. The prompts (86-166 tokens) plus 48 tokens
# cross a KEY_BLOCK boundary, so some blocks are computed in two passes.
CHAINS = [(1, 2, 3, 4, 5, 6, 7), (7, 6, 5, 4, 3, 2, 1)]


@pytest.mark.slow
def test_real_target_verification_is_bitwise_plain_decoding(real_target_dir):
    """The real target, found (or prepared) where the server keeps it: SPECDEC_CACHE_DIR, else ~/.cache/specdec."""
    from tokenizers import Tokenizer

    from coordinator.bench import load_humaneval
    from coordinator.cpu_engine.engine import CausalLMEngine, EngineRequest

    engine = CausalLMEngine(str(real_target_dir), dtype="bfloat16", num_threads=2, decode_rows=8)
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    problems = load_humaneval()
    for task in ("HumanEval/0", "HumanEval/5", "HumanEval/17"):
        prompt = tokenizer.encode(problems[task], add_special_tokens=True).ids
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
