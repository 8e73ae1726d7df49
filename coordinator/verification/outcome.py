"""What the coordinator reads from a verification's answer: the accepted prefix,
where the text ends, and how alternative proposals would have fared.

The acceptance itself happens inside the target engine (coordinator/verification/rules.py
says which rule); the coordinator only compares what came back with what it sent.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def reached_end_by_count(returned: int, accepted: int, requested: int, verified: bool) -> bool:
    """Whether a target call that returned ``returned`` tokens (``accepted``
    of them draft tokens) for ``requested`` stopped at the end token, which a
    TensorRT-LLM engine does not return.

    No token of the target's own after the accepted drafts: the next one was
    the end. A plain call that returned fewer than requested: the end. A
    verification that returned exactly one token of its own is a normal
    rejection on an engine that stops after the correction token; on one that
    keeps decoding to ``request_output_len`` it may also mean the end came
    right after it, and then the next round's call returns no token: correct
    either way, one call later at most. More than one own token but fewer
    than requested happens only on an engine that keeps decoding: the end."""
    own = returned - accepted
    if own <= 0:
        return True
    if returned >= requested:
        return False
    return not verified or own > 1


def score_alternatives(alternatives: Sequence[tuple[str, Sequence[int]]],
                       emitted: Sequence[int]) -> tuple[tuple[str, int, bool], ...]:
    """(drafter, accepted, rejected) of each alternative proposal had it been verified by
    token matching: its tokens are tried in order against what the target emitted (its
    own sample at every position, distributed as the target's for sampled requests too),
    up to the first that differs; tokens past the emitted ones are not tried."""
    scored = []
    for name, tokens in alternatives:
        matched = common_prefix_length(tokens, emitted)
        scored.append((name, matched, matched < min(len(tokens), len(emitted))))
    return tuple(scored)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def before_end(tokens: Sequence[int], end_ids: Collection[int]) -> list[int]:
    """``tokens`` up to (not including) the first end token."""
    out = []
    for token in tokens:
        if token in end_ids:
            break
        out.append(int(token))
    return out
