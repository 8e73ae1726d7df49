"""A bounded pool of KV caches keyed by the token sequence they hold.

Each speculative round sends the whole sequence again (prompt + everything
emitted so far), as clients of TensorRT-LLM do; its KV-cache reuse finds the
longest cached prefix and computes only the rest. This pool does the same for
the CPU engine: ``take`` hands out the entry sharing the longest common prefix
with the request (the caller crops it to that length), ``put`` stores it back,
least-recently-used entries are evicted beyond ``capacity``. Caches are opaque
here.

An entry that goes on for more than ``tail`` tokens past the shared prefix is
another sequence (two prompts with one preamble, the same prompt asked again),
not this one with rejected drafts at its end: it stays in the pool, and the
request gets a copy of the shared prefix (``copy_prefix``). Taking it would
crop that sequence to the preamble, and its next call would compute its
whole prompt again, as TensorRT-LLM's block reuse never makes a sequence do.

Each entry also records its ``prompt_path``: how many leading positions were
computed through the prompt's kernel calls (cpu_engine/prompt_blocks.py). A
call whose path differs reuses no position past where the two paths compute
alike (``path_agreement``; by default the shorter path's end): from there the
entry's keys and values are not the ones the call computes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import count
from typing import Any

import numpy as np


class PrefixCachePool:
    def __init__(self, capacity: int, tail: int | None = None,
                 copy_prefix: Callable[[Any, int], Any] | None = None,
                 path_agreement: Callable[[int, int], int] = min):
        """``tail``: the most tokens an entry of the same sequence holds past what its
        next call shares (the drafts a verification rejects); None: every entry is taken."""
        if capacity < 0:
            raise ValueError(f"max_cached_sequences must be >= 0, got {capacity}")
        if tail is not None and (tail < 0 or copy_prefix is None):
            raise ValueError("a pool that keeps other sequences' entries needs tail >= 0 and copy_prefix")
        self.capacity = capacity
        self.tail = tail
        self.copy_prefix = copy_prefix
        self.path_agreement = path_agreement
        self._entries: OrderedDict[int, tuple[np.ndarray, Any, int]] = OrderedDict()
        self._keys = count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys and values the pool holds (its memory is proportional)."""
        return sum(len(entry[0]) for entry in self._entries.values())

    def take(self, tokens: np.ndarray, prompt_path: int = 0) -> tuple[Any | None, int]:
        """Remove and return (cache, reusable length) for the entry sharing the
        longest common prefix with ``tokens``; the caller keeps that many
        positions of it.

        A draft's entry ends with the drafts it proposed; after the target
        rejects one, the next call shares only the accepted part, and that
        part is reused. So is a preamble shared with another prompt: the
        engine computes a position's keys and values the same way whatever
        forward it was in (cpu_engine/attention.py, rows.py), so
        they depend only on the tokens before it. The reusable length is at
        most ``len(tokens) - 1``: the last token is always recomputed so the
        engine gets its logits, and where ``prompt_path`` differs from the
        entry's, at most the shorter of the two.
        """
        best_key, best_len = None, 0
        for key, (cached, _, path) in self._entries.items():
            shared = common_prefix(cached, tokens)
            if path != prompt_path:
                shared = min(shared, self.path_agreement(path, prompt_path))
            if shared > best_len:
                best_key, best_len = key, shared
        if best_key is None:
            return None, 0
        reusable = min(best_len, len(tokens) - 1)
        cached, cache, _ = self._entries[best_key]
        if self.tail is not None and len(cached) - best_len > self.tail:  # another sequence's: it stays
            self._entries.move_to_end(best_key)
            return self.copy_prefix(cache, reusable), reusable
        del self._entries[best_key]
        return cache, reusable

    def put(self, tokens: np.ndarray, cache: Any, prompt_path: int = 0) -> None:
        if self.capacity == 0 or len(tokens) == 0:
            return
        self._entries[next(self._keys)] = (np.asarray(tokens, dtype=np.int64).copy(), cache, prompt_path)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
