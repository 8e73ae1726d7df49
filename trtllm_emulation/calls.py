"""What a tensorrtllm-backend engine does with one request, given its model's
logits: the CPU engine and the tests' toy engines share this, so the only
engines the tests run behave as TensorRT-LLM does where the coordinator can
tell the difference.

* The end token is neither returned nor counted in ``sequence_length``
  (TensorRT-LLM's sampling kernels do not advance the sequence length when
  the end id is drawn): a call whose first new token is the end returns no
  token at all.
* A stop word (``stop_words_list``) ends the call after it: unlike the end
  token it is returned and counted (TensorRT-LLM's stop criterion matches
  tokens already written to the output).
* Random numbers come from the call's own seed, drawn in order (one curand
  state initialised from ``random_seed`` per request).
* ``draft_logits`` are read as q = softmax(draft_logits), with no
  temperature or top-k/top-p; those process the target's logits only.
* With k draft tokens the call returns the accepted prefix plus one token of
  the target's own (the correction or the bonus token).
* Penalties, min_length and bad words (coordinator/sampling/penalties.py) process each
  position's logits with the tokens before it, drafted ones included;
  ``generation_logits`` stay the model's raw logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
import numpy as np
from coordinator.sampling.penalties import adjust, history_for, processed_rows
from coordinator.sampling.params import SamplingParams
from coordinator.sampling import maths
from coordinator.sampling.maths import call_rng, select_token, token_log_prob
from coordinator.verification.outcome import before_end, common_prefix_length
from coordinator.verification.rules import verify_by_matching, verify_by_rejection

@dataclass(frozen=True)
class CallResult:
    tokens: list[int]  # what output_ids/sequence_length carry: the end token excluded
    logits: list[np.ndarray]  # one row per returned token
    fed: int  # how many of ``tokens`` went through the model (their KV is in the cache)
    log_probs: list[float] | None = None  # each token's, when the call asked (output_log_probs)


class PlainDecoding:
    """Plain decoding one step at a time: ``next_token(logits)`` takes the
    logits of the last fed token and returns the token to feed next, or None
    once the call is finished (the end token drawn or the budget spent).
    Engines that batch many calls into one forward drive it step by step."""

    def __init__(self, max_new_tokens: int, params: SamplingParams, end_id: int | None,
                 input_ids: Sequence[int] = (), stop_words: Sequence[Sequence[int]] = ()):
        self.max_new_tokens = max_new_tokens
        self.params = params
        self.end_id = end_id
        self.stop_words = [tuple(int(t) for t in word) for word in stop_words if len(word)]
        self.history = history_for(input_ids, params)
        self.log_probs: list[float] | None = [] if params.log_probs else None
        self.rng = call_rng(params.seed)
        self.tokens: list[int] = []
        self.rows: list[np.ndarray] = []
        self.finished = False
        self.fed = 0

    def next_token(self, logits: np.ndarray) -> int | None:
        scores, params = adjust(logits, self.params, self.history, self.end_id)
        token = select_token(scores, params, self.rng)
        if self.history is not None:
            self.history.push(token)
        if token == self.end_id:
            self.finished, self.fed = True, len(self.tokens)
            return None
        self.tokens.append(token)
        self.rows.append(logits)
        if self.log_probs is not None:
            self.log_probs.append(token_log_prob(scores, params, token))
        if len(self.tokens) >= self.max_new_tokens or self._stopped():
            self.finished, self.fed = True, len(self.tokens) - 1
            return None
        return token

    def _stopped(self) -> bool:
        """Whether the tokens so far end with a stop word."""
        return any(len(self.tokens) >= len(w) and tuple(self.tokens[-len(w):]) == w for w in self.stop_words)

    def result(self) -> CallResult:
        return CallResult(self.tokens, self.rows, self.fed, self.log_probs)


def stop_word_end(tokens: Sequence[int], stop_words: Sequence[tuple[int, ...]], start: int = 0) -> int | None:
    """The length of ``tokens`` up to the end of the first stop word completed
    at or after position ``start`` (None: no stop word there)."""
    for end in range(start + 1, len(tokens) + 1):
        if any(end >= len(w) and tuple(tokens[end - len(w):end]) == w for w in stop_words):
            return end
    return None


def generate(
    step: Callable[[int], np.ndarray],
    last_input: int,
    max_new_tokens: int,
    params: SamplingParams,
    end_id: int | None,
    input_ids: Sequence[int] = (),
    stop_words: Sequence[Sequence[int]] = (),
) -> CallResult:
    """Plain decoding: ``step(token)`` feeds one token and returns the logits
    of the next position; the first call feeds the prompt's last token
    (``input_ids``: the whole input, which penalties count)."""
    decoding = PlainDecoding(max_new_tokens, params, end_id, input_ids, stop_words)
    feed: int | None = int(last_input)
    while feed is not None:
        feed = decoding.next_token(step(feed))
    return decoding.result()


def verify(
    target_logits: np.ndarray,
    draft_tokens: Sequence[int],
    draft_logits: np.ndarray | None,
    max_new_tokens: int,
    params: SamplingParams,
    end_id: int | None,
    input_ids: Sequence[int] = (),
    stop_words: Sequence[Sequence[int]] = (),
) -> CallResult:
    """Verification of k draft tokens from the target's logits [k + 1, vocab]
    (row i predicts the position of draft token i; row k the bonus)."""
    rng = call_rng(params.seed)
    drafts = [int(t) for t in draft_tokens]
    rows, params = processed_rows(target_logits, drafts, params, end_id, input_ids)
    if draft_logits is None:
        emitted = verify_by_matching(rows, drafts, params, rng)
    else:
        q = np.stack([maths.softmax(row) for row in np.asarray(draft_logits)])
        emitted = verify_by_rejection(rows, q, drafts, params, rng)
    tokens = before_end(emitted[:max_new_tokens], () if end_id is None else (end_id,))
    words = [tuple(int(t) for t in word) for word in stop_words if len(word)]
    tokens = tokens[:stop_word_end(tokens, words) or len(tokens)]
    fed = common_prefix_length(tokens, drafts)  # accepted drafts went through the forward pass
    log_probs = [token_log_prob(rows[i], params, t) for i, t in enumerate(tokens)] if params.log_probs else None
    return CallResult(tokens, [np.asarray(row) for row in target_logits[: len(tokens)]], fed, log_probs)
