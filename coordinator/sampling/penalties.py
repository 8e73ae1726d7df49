"""Logits processing that depends on the text so far: repetition, presence
and frequency penalties, a minimum length and banned words, applied as
TensorRT-LLM applies them, so the CPU engine, the coordinator's draft
distribution and a TensorRT-LLM engine agree:

* penaltyKernels.cu: temperature first, then for every token already in the
  sequence (prompt and generated): repetition (positive logits divided,
  negative multiplied), presence (subtracted once), frequency (subtracted
  per occurrence); then the end token is masked while fewer than
  ``min_length`` tokens were generated in this call.
* banBadWords.cu: a one-token bad word is always banned; a longer one bans
  its last token where the sequence ends with its other tokens.

Speculation stays lossless because every position is processed with the
tokens before it, drafted ones included, exactly as plain decoding would
process it, and the draft's distribution q is computed the same way.
numpy only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
import numpy as np
from coordinator.sampling.params import Penalties, SamplingParams

class History:
    """The tokens a position follows: occurrence counts for the penalties
    (counted once the vocabulary size is known), the tail for bad words.
    ``push`` a token once it is part of the sequence."""

    def __init__(self, tokens: Sequence[int], penalties: Penalties):
        self.penalties = penalties
        self.tokens = [int(t) for t in tokens]
        self._counts: np.ndarray | None = None

    def counts(self, vocab_size: int) -> np.ndarray:
        if self._counts is None or self._counts.size != vocab_size:
            ids = np.asarray(self.tokens, dtype=np.int64)
            self._counts = np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
        return self._counts

    def push(self, token: int) -> None:
        self.tokens.append(int(token))
        if self._counts is not None and 0 <= token < self._counts.size:
            self._counts[token] += 1

    def copy(self) -> "History":
        other = History(self.tokens, self.penalties)
        other._counts = None if self._counts is None else self._counts.copy()
        return other

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.penalties.prompt_length


def for_engine_call(params: SamplingParams, input_length: int) -> SamplingParams:
    """``params`` as an engine call with ``input_length`` input tokens receives them."""
    if params.penalties is None or not params.penalties.active:
        return params
    return replace(params, penalties=params.penalties.for_call(input_length))


def history_for(tokens: Sequence[int], params: SamplingParams) -> History | None:
    """The history a sampler with ``params`` needs after ``tokens`` (None: none)."""
    penalties = params.penalties
    return History(tokens, penalties) if penalties is not None and penalties.active else None


def adjust(logits: np.ndarray, params: SamplingParams, history: History | None,
           end_id: int | None) -> tuple[np.ndarray, SamplingParams]:
    """The logits a sampler with ``params`` should read at the position after
    ``history``, and the params to read them with (temperature already
    applied). Unchanged when there is nothing to apply."""
    if history is None or not history.penalties.active:
        return logits, params
    penalties = history.penalties
    scores = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
    if not params.greedy and params.temperature != 1.0:
        scores /= params.temperature
        params = replace(params, temperature=1.0)
    if penalties.counts_tokens:
        counts = history.counts(scores.size)
        seen = counts > 0
        if penalties.repetition != 1.0:
            scores[seen] = np.where(scores[seen] < 0, scores[seen] * penalties.repetition,
                                    scores[seen] / penalties.repetition)
        if penalties.presence != 0.0:
            scores[seen] -= penalties.presence
        if penalties.frequency != 0.0:
            scores[seen] -= penalties.frequency * counts[seen]
    for word in penalties.bad_words:
        if len(word) == 1 or (len(history.tokens) >= len(word) - 1
                              and tuple(history.tokens[len(history.tokens) - len(word) + 1:]) == word[:-1]):
            if 0 <= word[-1] < scores.size:
                scores[word[-1]] = -np.inf
    if end_id is not None and history.generated < penalties.min_length and 0 <= end_id < scores.size:
        scores[end_id] = -np.inf
    return scores, params


def processed_rows(logits: np.ndarray, drafts: Sequence[int], params: SamplingParams, end_id: int | None,
                   input_ids: Sequence[int]) -> tuple[np.ndarray, SamplingParams]:
    """Row i of a call's logits processed after ``input_ids`` plus drafts[:i]
    (row i predicts the token after those), and the params to read the rows
    with; the rows themselves when nothing applies. The engine verifies with
    this; the coordinator computes the draft's q with it."""
    history = history_for(input_ids, params)
    if history is None:
        return logits, params
    rows, adjusted = [], params
    for i, row in enumerate(np.asarray(logits)):
        processed, adjusted = adjust(row, params, history, end_id)
        rows.append(processed)
        if i < len(drafts):
            history.push(drafts[i])
    return (np.stack(rows) if rows else np.asarray(logits)), adjusted


def word_list(words: Sequence[Sequence[int]]) -> np.ndarray:
    """Token sequences in the tensorrtllm backend's ``bad_words_list`` format
    [1, 2, n]: the flat ids, then each word's end offset (padded with -1)."""
    flat = [int(t) for word in words for t in word]
    offsets = list(itertools.accumulate(len(word) for word in words))  # each engine call builds one: no numpy
    width = max(len(flat), 1)
    ids = flat + [0] * (width - len(flat))
    ends = offsets + [-1] * (width - len(offsets))
    return np.array([[ids, ends]], dtype=np.int32)


def read_word_list(array: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """The token sequences of a ``bad_words_list`` tensor ([1, 2, n] or [2, n])."""
    rows = np.asarray(array).reshape(2, -1)
    words, start = [], 0
    for end in rows[1]:
        if end < 0:
            break
        words.append(tuple(int(t) for t in rows[0][start:int(end)]))
        start = int(end)
    return tuple(word for word in words if word)
