"""Penalties, min_length and bad words (coordinator/sampling/penalties.py): the
arithmetic of TensorRT-LLM's kernels, the engine wire format, and that
speculation with them stays lossless through the whole loop (the drafter's
q and the engine's verification both process each position after the tokens
before it)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import numpy as np
import pytest

from coordinator.engines.tensors import engine_inputs
from coordinator.decoding.loop import speculative_decode
from coordinator.sampling.penalties import History, adjust, for_engine_call, read_word_list, word_list
from coordinator.sampling.params import Penalties
from coordinator.policy.speculation import SpeculationPolicy
from coordinator.sampling.params import SamplingParams
from coordinator.sampling.maths import processed_probs
from tests.fakes import ToyEngine
from tests.stats import gof_pvalue

ALPHA = 1e-4


def test_penalties_follow_tensorrt_llms_kernel():
    """penaltyKernels.cu (batchApplyPenalty): temperature, then for a token seen
    n > 0 times: repetition (positive / r, negative * r), presence (- p),
    frequency (- f * n)."""
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    penalties = Penalties(repetition=2.0, presence=0.5, frequency=0.25)
    history = History([0, 1, 1, 9], penalties)  # 9: outside the vocabulary, ignored
    scores, params = adjust(logits, SamplingParams(temperature=0.5), history, end_id=None)
    assert params.temperature == 1.0
    expected = [2.0 / 0.5 / 2.0 - 0.5 - 0.25, -1.0 / 0.5 * 2.0 - 0.5 - 0.5, 1.0, 6.0]
    np.testing.assert_allclose(scores, expected)


def test_min_length_masks_the_end_token_until_enough_were_generated():
    penalties = Penalties(min_length=2, prompt_length=3)
    logits = np.zeros(5)
    assert adjust(logits, SamplingParams(), History([7, 7, 7, 1], penalties), end_id=4)[0][4] == -np.inf
    assert adjust(logits, SamplingParams(), History([7, 7, 7, 1, 2], penalties), end_id=4)[0][4] == 0.0
    # each engine call counts from its own input (TensorRT-LLM's inputLengths): it is sent the rest
    assert penalties.for_call(4).min_length == 1 and penalties.for_call(9).min_length == 0
    assert penalties.for_call(4).prompt_length == 4


def test_bad_words_ban_a_words_last_token_where_the_text_ends_with_the_rest():
    """banBadWords.cu: one-token words always, longer ones after their prefix."""
    penalties = Penalties(bad_words=((2,), (1, 3), (0, 1, 4)))
    banned = lambda tokens: set(np.flatnonzero(adjust(np.zeros(6), SamplingParams(), History(tokens, penalties),
                                                      None)[0] == -np.inf))
    assert banned([5]) == {2}
    assert banned([5, 1]) == {2, 3}
    assert banned([0, 1]) == {2, 3, 4}
    assert banned([1, 0]) == {2}


def test_word_list_is_the_backends_bad_words_list_format():
    words = ((5, 6), (7,), (8, 9, 10))
    array = word_list(words)
    assert array.shape == (1, 2, 6) and array.dtype == np.int32
    assert array[0, 0].tolist() == [5, 6, 7, 8, 9, 10] and array[0, 1].tolist() == [2, 3, 6, -1, -1, -1]
    assert read_word_list(array) == words


def test_engine_calls_carry_the_penalties_and_what_min_length_still_owes():
    penalties = Penalties(repetition=1.2, frequency=0.5, min_length=10, bad_words=((3, 4),), prompt_length=5)
    tensors = engine_inputs(list(range(8)), 4, SamplingParams(penalties=penalties), end_id=1, pad_id=0)
    assert tensors["repetition_penalty"].item() == pytest.approx(1.2)
    assert tensors["frequency_penalty"].item() == 0.5 and "presence_penalty" not in tensors
    assert tensors["min_length"].item() == 7  # 3 of the 10 were generated before this call
    assert read_word_list(tensors["bad_words_list"]) == ((3, 4),)
    plain = engine_inputs([1, 2], 4, SamplingParams(), end_id=1, pad_id=0)
    assert not {"repetition_penalty", "min_length", "bad_words_list"} & set(plain)


# ---- lossless through the loop ------------------------------------------------------------------------------

VOCAB = 5
_rng = np.random.default_rng(11)
TARGET_TABLE = np.log(_rng.dirichlet(np.full(VOCAB, 0.8), size=VOCAB))
DRAFT_TABLE = np.log(_rng.dirichlet(np.full(VOCAB, 0.8), size=VOCAB))
PROMPT = [0, 3]
PENALTIES = Penalties(repetition=1.6, presence=0.4, frequency=0.3, bad_words=((1, 2),), prompt_length=len(PROMPT))


def markov(table):
    return lambda context: table[context[-1]]


def run(sampling: SamplingParams, window: int, tokens: int, draft_fn=markov(DRAFT_TABLE)) -> list[int]:
    policy = SpeculationPolicy(window, 0.0, adaptive=False, first_round_plain=False)

    async def collect():
        return [t async for r in speculative_decode(PROMPT, tokens, draft=ToyEngine(draft_fn),
                                                    target=ToyEngine(markov(TARGET_TABLE)), policy=policy,
                                                    sampling=sampling, end_ids=(999,)) for t in r.tokens]

    return asyncio.run(collect())


def exact_joint(params: SamplingParams, tokens: int) -> dict[tuple[int, ...], float]:
    """p(x1 ... xn) of plain penalized decoding, by enumeration."""
    joint = {}
    for sequence in itertools.product(range(VOCAB), repeat=tokens):
        probability, context = 1.0, list(PROMPT)
        for token in sequence:
            scores, adjusted = adjust(TARGET_TABLE[context[-1]], params, History(context, PENALTIES), None)
            probability *= processed_probs(scores, adjusted)[token]
            context.append(token)
        joint[sequence] = probability
    return joint


@pytest.mark.parametrize("window", [0, 1, 3])
def test_greedy_output_with_penalties_equals_plain_decoding(window):
    greedy = SamplingParams(penalties=replace(PENALTIES))
    plain = run(greedy, 0, 12)
    assert run(greedy, window, 12) == plain
    assert plain != run(SamplingParams(), 0, 12)  # the penalties changed the text


@pytest.mark.parametrize("window", [1, 3])
def test_sampled_output_with_penalties_is_distributed_as_plain_penalized_decoding(window):
    params = SamplingParams(temperature=0.9, penalties=PENALTIES)
    n, tokens = 1500, 3
    samples = [tuple(run(replace(params, seed=seed), window, tokens)) for seed in range(n)]
    joint = exact_joint(params, tokens)
    for i in range(tokens):
        counts = np.bincount([s[i] for s in samples], minlength=VOCAB)
        exact = np.zeros(VOCAB)
        for sequence, p in joint.items():
            exact[sequence[i]] += p
        assert gof_pvalue(counts, exact) > ALPHA, f"token {i + 1}: {counts} vs {np.round(exact * n)}"
    pairs = np.bincount([s[1] * VOCAB + s[2] for s in samples], minlength=VOCAB * VOCAB)
    exact_pairs = np.zeros(VOCAB * VOCAB)
    for sequence, p in joint.items():
        exact_pairs[sequence[1] * VOCAB + sequence[2]] += p
    assert gof_pvalue(pairs, exact_pairs) > ALPHA


def test_for_engine_call_leaves_requests_without_penalties_alone():
    params = SamplingParams(temperature=0.5)
    assert for_engine_call(params, 10) is params
