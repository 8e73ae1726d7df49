"""Per-sequence, row-invariant attention for the CPU engine's packed forwards.

The engine batches calls of many sequences into one forward (in-flight
batching): their new tokens are rows of one packed block, the linear layers
run over all rows at once, and attention runs per sequence against that
sequence's own keys and values (``SequenceKV``). This module is that
attention, registered with transformers under ``NAME``.

Speculation is lossless only if a token's logits are the same whether the
target decodes it alone, verifies it with k draft tokens, or computes it in a
forward shared with other sequences. Library attention kernels do not promise
that: the reduction over keys is split according to the total key length of
the forward, so a row's rounding depends on where its block started. Here
every operation a row goes through has a shape fixed by the row's own
absolute position p, never by the rest of the forward:

* a sequence's rows are attended in blocks of exactly ``BLOCK_ROWS`` query
  rows (the last block zero-padded), so no attention matmul sees a different M;
* the key range is canonical: keys 0..L(p)-1 with L(p) = p + 1 rounded up to a
  multiple of KEY_BLOCK (zero-padded past the cache), keys after p masked out
  (probabilities exactly 0).

Rows of a block that share L(p) are computed in one pass; a block that
straddles a KEY_BLOCK boundary takes one pass per length. Other rows only
change other rows of the matmuls and masked-out keys, whose scores become
-inf and whose values are multiplied by exact zeros: a row's output is bitwise
the same alone, in a verification block, in a prompt's prefill, or next to
other sequences. tests/unit/test_attention.py checks this on random tensors and on
the real target. (The linear layers' side of the same promise is measured at
start-up: cpu_engine/rows.py.)

Prompt prefill goes through the same blocks, so a prompt's keys and values do
not depend on how its prefill was chunked between forwards.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

NAME = "specdec_packed"
BLOCK_ROWS = 8  # query rows per attention block (a verification of up to 7 drafts is one block)
KEY_BLOCK = 64  # canonical key lengths are multiples of this

class SequenceKV:
    """Keys and values of one sequence, per layer ([kv_heads, length, dim] with
    a leading batch dimension of 1); what the prefix-cache pool keeps."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    def get_seq_length(self) -> int:
        return 0 if self.keys[-1] is None else int(self.keys[-1].shape[2])

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=2)
            value = torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def prefix(self, length: int) -> "SequenceKV":
        """A new cache holding a copy of the first ``length`` positions."""
        copy = SequenceKV(len(self.keys))
        for layer, key in enumerate(self.keys):
            if key is not None:
                copy.keys[layer] = key[:, :, :length].clone()
                copy.values[layer] = self.values[layer][:, :, :length].clone()
        return copy

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        for layer, key in enumerate(self.keys):
            if key is not None and key.shape[2] > length:
                self.keys[layer] = key[:, :, :length].clone()
                self.values[layer] = self.values[layer][:, :, :length].clone()


@dataclass(frozen=True)
class Segment:
    """Rows ``start:stop`` of a packed forward: new tokens of the sequence
    ``kv`` at positions ``kv length``.. (kv None: padding rows, not attended)."""

    start: int
    stop: int
    kv: SequenceKV | None


_segments: contextvars.ContextVar[Sequence[Segment] | None] = contextvars.ContextVar("segments", default=None)


@contextlib.contextmanager
def packed(segments: Sequence[Segment]):
    """The layout of the packed forward run inside this block."""
    token = _segments.set(tuple(segments))
    try:
        yield
    finally:
        _segments.reset(token)


def canonical_length(position: int) -> int:
    """Keys a decode row at ``position`` is computed over (it sees 0..position)."""
    return -(-(position + 1) // KEY_BLOCK) * KEY_BLOCK


def packed_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None,
                     **kwargs):
    """query/key/value [1, heads, rows, d] over all rows of the packed forward
    (after rotary embedding); returns [1, rows, heads, d]. Each segment's new
    keys and values are appended to its sequence first. Outside a packed
    forward (a plain ``model(...)`` call) it is causal attention over the one
    sequence's keys."""
    segments = _segments.get()
    batch, heads, rows, dim = query.shape
    if segments is None:  # an ordinary forward of one sequence (key/value: its cache and the new rows)
        if batch != 1:
            raise ValueError(f"{NAME} attention serves one sequence per forward outside the engine, got {batch}")
        return attend_rows(query, key, value, key.shape[2] - rows, scaling, sliding_window), None
    output = query.new_zeros(batch, rows, heads, dim)
    for segment in segments:
        if segment.kv is None:
            continue
        rows_of = slice(segment.start, segment.stop)
        keys, values = segment.kv.append(module.layer_idx, key[:, :, rows_of], value[:, :, rows_of])
        offset = keys.shape[2] - (segment.stop - segment.start)
        output[:, rows_of] = attend_rows(query[:, :, rows_of], keys, values, offset, scaling, sliding_window)
    return output, None


def attend_rows(query, key, value, offset, scaling, sliding_window=None):
    """Rows at positions offset.. (query [1, heads, n, d]) against key/value
    [1, kv_heads, >= offset + n, d], in blocks of BLOCK_ROWS; returns [1, n, heads, d]."""
    count = query.shape[2]
    blocks = []
    for start in range(0, count, BLOCK_ROWS):
        real = min(BLOCK_ROWS, count - start)
        block = query[:, :, start : start + real]
        if real < BLOCK_ROWS:
            block = torch.nn.functional.pad(block, (0, 0, 0, BLOCK_ROWS - real))
        blocks.append(_decode_block(block, key, value, offset + start, real, scaling, sliding_window)[:, :, :real])
    return torch.cat(blocks, dim=2).transpose(1, 2)


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


AttentionInterface.register(NAME, packed_attention)
