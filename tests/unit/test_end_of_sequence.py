"""The end of a sequence, found from the token counts whether or not the engines
return the end token (coordinator/verification/outcome.py)."""

import pytest

from coordinator.verification.outcome import reached_end_by_count
from tests.fakes import ToyEngine, noisy, toy_logits
from tests.loop_helpers import run, tokens_of


def greedy_reference(prompt, n, end=None):
    """Plain greedy decoding of toy_logits, written independently of the loop and the engines."""
    out = []
    while len(out) < n:
        token = int(toy_logits(list(prompt) + out).argmax())
        if token == end:
            break
        out.append(token)
    return out


ENGINE_KINDS = {
    "tensorrt_llm": {},  # end token neither returned nor counted
    "returns_end_token": {"returns_end_token": True},
    "continues_after_verify": {"continues_after_verify": True},
}


@pytest.mark.parametrize("kind", list(ENGINE_KINDS))
@pytest.mark.parametrize("end_at", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("window", [0, 1, 3, 4])
@pytest.mark.parametrize("flip_every", [0, 3])
def test_ends_where_plain_decoding_ends_whatever_the_engines_do_with_the_end_token(kind, end_at, window, flip_every):
    """The end token is the greedy token at position ``end_at``: the request ends
    there, without it, for engines that drop it (TensorRT-LLM), return it, or
    keep decoding after a verification; and never raises."""
    prompt = [4, 8]
    full = greedy_reference(prompt, 20)
    end = full[end_at]
    expected = greedy_reference(prompt, 20, end=end)
    options = ENGINE_KINDS[kind]
    draft = ToyEngine(noisy(toy_logits, flip_every), end_id=end, **options)
    target = ToyEngine(end_id=end, **options)
    rounds, _ = run(prompt, 20, draft, target, window=window, end_ids=(end,))
    assert tokens_of(rounds) == expected
    assert rounds[-1].finished and all(not r.finished for r in rounds[:-1])
    # at most one extra call, with an engine whose verification keeps decoding
    extra = 1 if kind == "continues_after_verify" else 0
    assert len(target.calls) <= len(rounds) <= (len(expected) + 1 + extra)


def test_a_target_call_that_returns_no_token_ends_the_request():
    """TensorRT-LLM returns zero tokens when the first new token is the end id."""
    end = int(toy_logits([1, 2]).argmax())  # the first greedy token after [1, 2]
    for window in (0, 4):
        rounds, _ = run([1, 2], 20, ToyEngine(end_id=end), ToyEngine(end_id=end), window=window, end_ids=(end,))
        assert tokens_of(rounds) == [] and len(rounds) == 1 and rounds[0].finished


def test_the_draft_never_proposes_the_end_token():
    prompt = [4, 8]
    end = greedy_reference(prompt, 10)[3]
    draft = ToyEngine(returns_end_token=True, end_id=end)
    target = ToyEngine(end_id=end)
    sent = []
    original = target.generate

    async def spy(input_ids, max_new_tokens, sampling, draft_tokens=(), **kwargs):
        sent.append(list(draft_tokens))
        return await original(input_ids, max_new_tokens, sampling, draft_tokens, **kwargs)

    target.generate = spy
    rounds, _ = run(prompt, 20, draft, target, window=6, end_ids=(end,))
    assert tokens_of(rounds) == greedy_reference(prompt, 20, end=end)
    assert all(end not in drafts for drafts in sent)


@pytest.mark.parametrize("reached,accepted,requested,verified,ended", [
    (0, 0, 1, False, True),  # plain step, end first
    (1, 0, 1, False, False),
    (2, 2, 3, True, True),  # all returned tokens are drafts: the next one was the end
    (3, 2, 3, True, False),  # 2 accepted + bonus
    (2, 1, 4, True, False),  # rejection: correction token, the normal stop
    (3, 1, 4, True, True),  # kept decoding after the correction, then the end
    (4, 1, 4, True, False),
    (2, 0, 5, False, True),  # a multi-token plain call that stopped early
])
def test_reached_end_by_count(reached, accepted, requested, verified, ended):
    assert reached_end_by_count(reached, accepted, requested, verified) is ended
