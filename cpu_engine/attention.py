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
straddles a KEY_BLOCK boundary takes one pass per length. Passes over the
same L go through one batched matmul, up to a stack measured at start-up
(``measure_stack``): only where the kernels compute each block of a batch
bitwise as they compute it alone (on a 2-vCPU Intel Xeon with AMX a
750-token prompt's attention took 0.54 s in stacks of 8 against 0.90 s block
by block, over 28 layers). Other rows only
change other rows of the matmuls and masked-out keys, whose scores become
-inf and whose values are multiplied by exact zeros: a row's output is bitwise
the same alone, in a verification block, in a prompt's prefill, or next to
other sequences. tests/unit/test_attention.py checks this on random tensors and on
the real target. (The linear layers' side of the same promise is measured at
start-up: cpu_engine/rows.py.)

Prompt prefill goes through the same blocks, so a prompt's keys and values do
not depend on how its prefill was chunked between forwards. The rows of a
prompt's leading whole blocks (cpu_engine/prompt_blocks.py: fixed by the
request, never by the forward) go another way, which is just as fixed: each
block of ``prompt_block`` rows aligned at a multiple of it, against keys
0..its end, in one ``scaled_dot_product_attention`` call with a causal mask,
rows of the block the forward does not carry (cached already) zero-padded.
Where ``prompt_blocks_agree`` finds a block's rows not independent of its
other rows on this machine, those rows go through the 8-row blocks too. On a
2-vCPU Intel Xeon with AMX a 2,048-token prompt's attention took 1.1-1.2 s a
model in 128-row blocks against 5.3-8.2 s in 8-row ones.
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
    prompt_rows: int = 0  # leading rows in a prompt's whole blocks (attend_prompt_blocks)


_segments: contextvars.ContextVar[Sequence[Segment] | None] = contextvars.ContextVar("segments", default=None)
_stack: contextvars.ContextVar[int] = contextvars.ContextVar("stack", default=1)
_prompt_block: contextvars.ContextVar[int] = contextvars.ContextVar("prompt_block", default=0)


@contextlib.contextmanager
def packed(segments: Sequence[Segment], stack: int = 1, prompt_block: int = 0):
    """The layout of the packed forward run inside this block; ``stack``: the most
    attention blocks of one key length computed in one batched matmul;
    ``prompt_block``: the rows of a prompt block (0: segments' prompt rows go
    through the 8-row blocks like any other)."""
    token, stacked = _segments.set(tuple(segments)), _stack.set(stack)
    blocked = _prompt_block.set(prompt_block)
    try:
        yield
    finally:
        _segments.reset(token)
        _stack.reset(stacked)
        _prompt_block.reset(blocked)


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
    stack, block = _stack.get(), _prompt_block.get()
    output = query.new_zeros(batch, rows, heads, dim)
    for segment in segments:
        if segment.kv is None:
            continue
        rows_of = slice(segment.start, segment.stop)
        keys, values = segment.kv.append(module.layer_idx, key[:, :, rows_of], value[:, :, rows_of])
        offset = keys.shape[2] - (segment.stop - segment.start)
        marked = segment.prompt_rows if block and sliding_window is None else 0
        if marked:
            prompt = slice(segment.start, segment.start + marked)
            output[:, prompt] = attend_prompt_blocks(query[:, :, prompt], keys, values, offset, scaling, block)
        if segment.start + marked < segment.stop:
            rest = slice(segment.start + marked, segment.stop)
            output[:, rest] = attend_rows(query[:, :, rest], keys, values, offset + marked, scaling, sliding_window,
                                          stack)
    return output, None


def attend_prompt_blocks(query, key, value, offset, scaling, block):
    """Rows at positions offset.. (query [1, heads, n, d]), all in a prompt's whole
    blocks, against key/value [1, kv_heads, >= offset + n, d]: each block of
    ``block`` rows aligned at a multiple of it in one causal attention call over
    keys 0..its end, rows it does not carry zero; returns [1, n, heads, d]."""
    _, heads, count, dim = query.shape
    parts = []
    for first in range(offset // block * block, offset + count, block):
        lo, hi = max(first, offset), min(first + block, offset + count)
        rows = query.new_zeros(1, heads, block, dim)
        rows[:, :, lo - first : hi - first] = query[:, :, lo - offset : hi - offset]
        length = first + block
        mask = torch.arange(length).view(1, length) <= torch.arange(first, length).view(block, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, _keys(key, length), _keys(value, length), attn_mask=mask, scale=scaling,
            enable_gqa=heads != key.shape[1])
        parts.append(out[:, :, lo - first : hi - first])
    return torch.cat(parts, dim=2).transpose(1, 2)


@torch.inference_mode()
def prompt_blocks_agree(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, block: int,
                        max_length: int) -> bool:
    """Whether a prompt block's rows come out of ``attend_prompt_blocks`` bitwise
    the same whatever its other rows hold (a block the forward carries in part has
    them zero, and a prompt's padded rest has no keys past its rows yet), at block
    ends up to ``max_length``."""
    generator = torch.Generator().manual_seed(0)
    for length in range(block, max_length + 1, max(block, max_length // 8 // block * block)):
        query = torch.randn(1, heads, block, dim, generator=generator).to(dtype)
        key = torch.randn(1, kv_heads, length, dim, generator=generator).to(dtype)
        value = torch.randn(1, kv_heads, length, dim, generator=generator).to(dtype)
        whole = attend_prompt_blocks(query, key, value, length - block, 1.0, block)
        for carried in (1, block // 2 + 3):
            part = attend_prompt_blocks(query[:, :, -carried:], key, value, length - carried, 1.0, block)
            if not torch.equal(part, whole[:, -carried:]):
                return False
            # a prompt's padded rest: the block's first rows, no keys past them yet
            known = length - block + carried
            part = attend_prompt_blocks(query[:, :, :carried], key[:, :, :known], value[:, :, :known],
                                        length - block, 1.0, block)
            if not torch.equal(part, whole[:, :carried]):
                return False
    return True


@dataclass(frozen=True)
class Pass:
    """Rows ``start:stop`` of query block ``block`` (at positions ``offset``..), all over ``length`` keys."""

    block: int
    offset: int
    start: int
    stop: int
    length: int


def passes(offset: int, count: int) -> list[Pass]:
    """How ``count`` rows at positions ``offset``.. are attended: blocks of BLOCK_ROWS
    rows, each cut where its rows' canonical key length changes."""
    out = []
    for block, first in enumerate(range(0, count, BLOCK_ROWS)):
        computed = min(BLOCK_ROWS, count - first)
        start = 0
        while start < computed:
            length = canonical_length(offset + first + start)
            stop = min(computed, length - offset - first)
            out.append(Pass(block, offset + first, start, stop, length))
            start = stop
    return out


def attend_rows(query, key, value, offset, scaling, sliding_window=None, stack=1):
    """Rows at positions offset.. (query [1, heads, n, d]) against key/value
    [1, kv_heads, >= offset + n, d], in blocks of BLOCK_ROWS; returns [1, n, heads, d].
    Blocks over the same key length go through one batched matmul, ``stack`` (a
    power of two) at most: the kernels compute each block of the batch as they
    compute it alone only where ``measure_stack`` found so on this machine."""
    _, heads, count, dim = query.shape
    padded = -(-count // BLOCK_ROWS) * BLOCK_ROWS
    if padded > count:
        query = torch.nn.functional.pad(query, (0, 0, 0, padded - count))
    blocks = query[0].view(heads, padded // BLOCK_ROWS, BLOCK_ROWS, dim).transpose(0, 1)  # [blocks, heads, rows, d]
    output = query.new_zeros(padded // BLOCK_ROWS, heads, BLOCK_ROWS, dim)
    by_length: dict[int, list[Pass]] = {}
    for part in passes(offset, count):
        by_length.setdefault(part.length, []).append(part)
    for length, parts in by_length.items():
        k, v = _keys(key, length), _keys(value, length)
        for first in range(0, len(parts), stack):
            group = parts[first : first + stack]
            computed = _attend_blocks(blocks, group, k, v, length, scaling, sliding_window)
            for i, part in enumerate(group):
                output[part.block, :, part.start : part.stop] = computed[i, :, part.start : part.stop]
    return output.transpose(0, 1).reshape(1, heads, padded, dim)[:, :, :count].transpose(1, 2)


def _attend_blocks(blocks, group: list[Pass], k, v, length, scaling, sliding_window):
    """The blocks of ``group`` over their first ``length`` keys, in one batched matmul
    of a power-of-two number of blocks (zero blocks fill it up): [n, heads, rows, d]."""
    size = 1 << (len(group) - 1).bit_length()
    query = blocks[[part.block for part in group]]
    if size > len(group):
        query = torch.cat([query, query.new_zeros(size - len(group), *query.shape[1:])])
    n, heads, queries, dim = query.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    # The query heads sharing a key head are rows of one matmul: [n, kv_heads, groups * q, d].
    rows = query.reshape(n, kv_heads, groups * queries, dim).contiguous()
    offsets = torch.tensor([part.offset for part in group] + [0] * (size - len(group)))
    positions = (offsets.view(n, 1) + torch.arange(queries)).view(n, 1, 1, queries, 1)
    scores = torch.matmul(rows, k.transpose(-1, -2)) * scaling
    cols = torch.arange(length)
    hidden = cols > positions
    if sliding_window is not None:
        hidden |= cols <= positions - sliding_window
    scores = scores.view(n, kv_heads, groups, queries, length).masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(n, kv_heads, groups * queries, length)
    return torch.matmul(probs, v).view(n, heads, queries, dim)


def model_heads(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a transformers model config."""
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, dim


# Stack sizes tried, smallest first: a stack of n blocks is computed as the next
# power of two, so every size up to the chosen one must agree.
STACKS = (2, 4, 8)


@torch.inference_mode()
def measure_stack(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, max_length: int) -> int:
    """The most blocks one batched attention matmul may carry on this machine: the
    largest of STACKS (1: none) for which, at every canonical key length up to
    ``max_length``, each block of a batch comes out bitwise as it does alone.

    Stacking matters for a prompt's prefill: a 750-token prompt is 94 blocks a layer,
    and one matmul per block spent more time dispatching than multiplying."""
    generator = torch.Generator().manual_seed(0)
    top = max(STACKS)
    blocks = torch.randn(top, heads, BLOCK_ROWS, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, max_length, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, max_length, dim, generator=generator).to(dtype)
    agreeing = set(STACKS)
    for length in probed_lengths(max_length):
        k, v = key[:, :, :length], value[:, :, :length]
        # every block's rows have this canonical length; the blocks differ in where they stand
        group = [Pass(block, length - BLOCK_ROWS - block % 2, 0, BLOCK_ROWS, length) for block in range(top)]
        alone = [_attend_blocks(blocks, [part], k, v, length, 1.0, None)[0] for part in group]
        for size in sorted(agreeing):
            together = _attend_blocks(blocks, group[:size], k, v, length, 1.0, None)
            if not all(torch.equal(together[i], alone[i]) for i in range(size)):
                agreeing.discard(size)
    chosen = 1
    for size in STACKS:
        if size not in agreeing:
            break
        chosen = size
    return chosen


def probed_lengths(max_length: int) -> list[int]:
    """Key lengths the stack is checked at: every canonical length up to 1,024, then
    every 256th (kernels change their blocking at such sizes; checking every length
    up to 4,096 took 4 s a start)."""
    dense = list(range(KEY_BLOCK, min(max_length, 1024) + 1, KEY_BLOCK))
    return dense + list(range(1024 + 256, max_length + 1, 256))


def _keys(states, length):
    """states [b, kv_heads, kv, d] cut or zero-padded to ``length`` keys."""
    have = states.shape[2]
    if have >= length:
        return states[:, :, :length]
    return torch.nn.functional.pad(states, (0, 0, 0, length - have))


AttentionInterface.register(NAME, packed_attention)
