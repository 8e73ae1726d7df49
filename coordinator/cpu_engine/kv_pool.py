"""A bounded pool of KV caches keyed by the token sequence they hold.

Each speculative round sends the whole sequence again (prompt + everything
emitted so far), as clients of TensorRT-LLM do; its KV-cache reuse finds the
longest cached prefix and computes only the rest. This pool does the same for
the CPU engine: ``take`` hands out the entry sharing the longest prefix with
the request, ``put`` stores it back, least-recently-used entries are evicted
beyond ``capacity``. Caches are opaque here (anything with a ``crop``).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Any

import numpy as np


class PrefixCachePool:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"max_cached_sequences must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[np.ndarray, Any]] = OrderedDict()
        self._keys = count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys and values the pool holds (its memory is proportional)."""
        return sum(len(tokens) for tokens, _ in self._entries.values())

    def take(self, tokens: np.ndarray) -> tuple[Any | None, int]:
        """Remove and return (cache, reusable length) for the longest entry
        whose tokens are a prefix of ``tokens``.

        Only whole-entry prefixes are reused, which is exactly what the rounds
        of one sequence produce. An entry that merely shares some leading
        tokens (another prompt with the same preamble) is not: its KV for those
        positions was computed in a differently shaped forward, and reusing it
        would let rounding differ between otherwise identical requests. The
        reusable length is at most ``len(tokens) - 1``: the last token is
        always recomputed so the engine gets its logits.
        """
        best_key, best_len = None, 0
        for key, (cached, _) in self._entries.items():
            if best_len < len(cached) <= len(tokens) and np.array_equal(cached, tokens[: len(cached)]):
                best_key, best_len = key, len(cached)
        if best_key is None:
            return None, 0
        _, cache = self._entries.pop(best_key)
        return cache, min(best_len, len(tokens) - 1)

    def put(self, tokens: np.ndarray, cache: Any) -> None:
        if self.capacity == 0 or len(tokens) == 0:
            return
        self._entries[next(self._keys)] = (np.asarray(tokens, dtype=np.int64).copy(), cache)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
