"""Row-invariant attention for the CPU engine.

Speculation is lossless only if a token's logits are the same whether the
target decodes it alone or verifies it with k draft tokens in one forward.
Library attention kernels do not promise that: the reduction over keys is
split by the kernel (and its threads) according to the total key length of the
forward, so a query row's rounding depends on where the block started. Here
every query row of a decode block is computed on its own, over exactly the keys
it may see (positions 0..p), so its result depends only on its absolute
position p and the cache, never on the block around it. Long blocks (prompt
prefill, identical in plain and speculative decoding) use a chunked causal
path to keep memory bounded.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface

NAME = "specdec_row_invariant"
ROW_BY_ROW_MAX_QUERIES = 16
PREFILL_CHUNK = 256

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


def row_invariant_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None,
                            **kwargs):
    """query [b, heads, q, d]; key/value [b, kv_heads, kv, d] (the cache plus this block)."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # [b, kv_heads, groups, q, d] against [b, kv_heads, 1, kv, d]: grouped-query attention without copies
    query = query.view(batch, kv_heads, groups, queries, dim)
    key, value = key.unsqueeze(2), value.unsqueeze(2)
    offset = keys - queries  # absolute position of the block's first row
    computed = queries if _real_rows.get() is None else min(_real_rows.get(), queries)
    step = 1 if queries <= ROW_BY_ROW_MAX_QUERIES else PREFILL_CHUNK
    outputs = []
    for start in range(0, computed, step):
        stop = min(start + step, computed)
        end = offset + stop  # keys visible to the chunk's last row
        first = 0 if sliding_window is None else max(0, offset + start - sliding_window + 1)
        scores = torch.matmul(query[:, :, :, start:stop], key[:, :, :, first:end].transpose(-1, -2)) * scaling
        if stop - start > 1:
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
    output = torch.cat(outputs, dim=3).view(batch, heads, queries, dim)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, row_invariant_attention)
