"""Row-invariant attention for the CPU engine.

Speculation is lossless only if a token's logits are the same whether the
target decodes it alone or verifies it with k draft tokens in one forward.
Library attention kernels do not promise that: the reduction over keys is
split by the kernel (and its threads) according to the total key length of the
forward, so a query row's rounding depends on where the block started.

Here every operation a decode row goes through has a shape fixed by the row's
own absolute position p and the block size (the engine's decode_rows), never by
the rest of the block:

* the key range is canonical: keys 0..L(p)-1 with L(p) = p + 1 rounded up to a
  multiple of KEY_BLOCK (zero-padded past the cache), keys after p masked out
  (probabilities exactly 0);
* all rows of the block (padding rows included) form the rows of the same
  matmuls, whichever of them are real, so no kernel sees a different M.

Rows that share L(p) (nearly always all real rows of a block) are therefore
computed together in one pass; a block that straddles a KEY_BLOCK boundary
takes one pass per length. A row's output is then bitwise the same whether it
is decoded alone (a block with one real row) or verified with the k rows around
it: other rows only change other rows of the matmuls and masked-out keys, whose
scores are replaced by -inf and whose values are multiplied by exact zeros.
tests/test_attention.py checks this on random tensors and on the real target.

Both rules are needed (measured with that test's check on this AMX CPU): one
pass over the exact keys 0..last row differs from the row alone for ~1% of bf16
rows and ~25% of fp32 rows (softmax and probs @ V round differently once
trailing -inf/zero keys are added); one pass over the block's largest canonical
length differs too (~1% bf16, ~4% fp32); canonical lengths with only the real
rows in the matmuls (M varying with the block) differ for some bf16 and fp32
shapes. The previous row-by-row loop was invariant but cost ~12 ms per real row
per forward (1.5B target, 300-token context); this costs ~7 ms per forward.

Long blocks (prompt prefill, identical in plain and speculative decoding) use a
chunked causal path to keep memory bounded.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface

NAME = "specdec_row_invariant"
ROW_BY_ROW_MAX_QUERIES = 16  # blocks up to this many rows are decode blocks
PREFILL_CHUNK = 256
KEY_BLOCK = 64  # canonical key lengths are multiples of this

# Rows of the current block that carry real tokens; the rest is padding whose
# outputs are discarded (and which no real row can attend to: it comes last).
_real_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("real_rows", default=None)


@contextlib.contextmanager
def real_rows(count: int):
    token = _real_rows.set(count)
    try:
        yield
    finally:
        _real_rows.reset(token)


def canonical_length(position: int) -> int:
    """Keys a decode row at ``position`` is computed over (it sees 0..position)."""
    return -(-(position + 1) // KEY_BLOCK) * KEY_BLOCK


def row_invariant_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None,
                            **kwargs):
    """query [b, heads, q, d]; key/value [b, kv_heads, kv, d] (the cache plus this block)."""
    queries, keys = query.shape[2], key.shape[2]
    offset = keys - queries  # absolute position of the block's first row
    computed = queries if _real_rows.get() is None else min(_real_rows.get(), queries)
    if queries > ROW_BY_ROW_MAX_QUERIES:
        output = _chunked_causal(query, key, value, offset, computed, scaling, sliding_window)
    else:
        output = _decode_block(query, key, value, offset, computed, scaling, sliding_window)
    return output.transpose(1, 2).contiguous(), None


def _decode_block(query, key, value, offset, computed, scaling, sliding_window):
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # The query heads sharing a key head are rows of one matmul: [b, kv_heads, groups * q, d].
    rows = query.reshape(batch, kv_heads, groups * queries, dim)
    positions = torch.arange(offset, offset + queries).unsqueeze(1)
    output = query.new_zeros(batch, kv_heads, groups, queries, dim)
    start = 0
    while start < computed:
        length = canonical_length(offset + start)
        stop = min(computed, length - offset)  # rows sharing this key length
        k, v = _keys(key, length), _keys(value, length)
        scores = torch.matmul(rows, k.transpose(-1, -2)) * scaling
        cols = torch.arange(length).unsqueeze(0)
        hidden = cols > positions
        if sliding_window is not None:
            hidden |= cols <= positions - sliding_window
        scores = scores.view(batch, kv_heads, groups, queries, length).masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(batch, kv_heads, groups * queries, length)
        block = torch.matmul(probs, v).view(batch, kv_heads, groups, queries, dim)
        output[:, :, :, start:stop] = block[:, :, :, start:stop]
        start = stop
    return output.view(batch, heads, queries, dim)


def _keys(states, length):
    """states [b, kv_heads, kv, d] cut or zero-padded to ``length`` keys."""
    have = states.shape[2]
    if have >= length:
        return states[:, :, :length]
    return torch.nn.functional.pad(states, (0, 0, 0, length - have))


def _chunked_causal(query, key, value, offset, computed, scaling, sliding_window):
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # [b, kv_heads, groups, q, d] against [b, kv_heads, 1, kv, d]: grouped-query attention
    query = query.reshape(batch, kv_heads, groups, queries, dim)
    key, value = key.unsqueeze(2), value.unsqueeze(2)
    outputs = []
    for start in range(0, computed, PREFILL_CHUNK):
        stop = min(start + PREFILL_CHUNK, computed)
        end = offset + stop  # keys visible to the chunk's last row
        first = 0 if sliding_window is None else max(0, offset + start - sliding_window + 1)
        scores = torch.matmul(query[:, :, :, start:stop], key[:, :, :, first:end].transpose(-1, -2)) * scaling
        rows = torch.arange(offset + start, offset + stop).unsqueeze(1)
        cols = torch.arange(first, end).unsqueeze(0)
        hidden = cols > rows
        if sliding_window is not None:
            hidden |= cols <= rows - sliding_window
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        outputs.append(torch.matmul(probs, value[:, :, :, first:end]))
    if computed < queries:
        outputs.append(query.new_zeros(batch, kv_heads, groups, queries - computed, dim))
    return torch.cat(outputs, dim=3).view(batch, heads, queries, dim)


AttentionInterface.register(NAME, row_invariant_attention)
