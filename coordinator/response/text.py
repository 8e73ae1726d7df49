"""Turning generated token ids into streamed text: incremental detokenisation
and stop words. Pure Python; the tokenizer is passed in as a decode function."""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a cut UTF-8 sequence


class CompletionText:
    """Accumulates generated ids and yields the text that is safe to emit.

    Text is held back while it ends in an incomplete UTF-8 sequence or could
    still grow into a stop word; a stop word ends the completion and is not
    emitted (as in OpenAI-style APIs).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop_words: Sequence[str] = ()):
        self._decode = decode
        self._stop_words = [w for w in stop_words if w]
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already emitted
        self.stopped = False

    def append(self, ids: Sequence[int], final: bool = False) -> str:
        """Add ids; return the newly emittable text (sets ``stopped`` on a stop word)."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        text = self._decode(self._ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._take(text, cut)
        if final:
            return self._take(text, len(text))
        safe = len(text)
        while safe > self._emitted and text[safe - 1] == _INCOMPLETE:
            safe -= 1
        safe -= self._stop_prefix_overlap(text[:safe])
        return self._take(text, max(safe, self._emitted))

    def _take(self, text: str, end: int) -> str:
        delta = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _first_stop(self, text: str) -> int | None:
        # search from a little before the emitted point: a stop word may span rounds
        start = max(0, self._emitted - max((len(w) for w in self._stop_words), default=0))
        hits = [i for i in (text.find(w, start) for w in self._stop_words) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_overlap(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop word."""
        best = 0
        for word in self._stop_words:
            for n in range(min(len(word) - 1, len(text)), best, -1):
                if text.endswith(word[:n]):
                    best = n
                    break
        return best
