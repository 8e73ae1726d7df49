"""Token trees: several draft candidates per position, verified in one target
forward, and the acceptance rules over them.

A tree hangs off the current context (the root, index ``ROOT``). Its nodes are
in breadth-first order, so one forward can feed them as a flat sequence:
``flatten`` gives the tokens and each node's ancestors, which is all a tree
attention mask needs (node i sees the context, its ancestors and itself).
Target rows follow the same order: row 0 is the distribution after the
context, row ``i + 1`` the one after node i; the draft's q rows likewise.

Which rule verifies a tree depends on how its candidates were drawn
(coordinator/drafters/tree_shape.py grows them):

* ``verify_tree_by_matching``: any tree, no q needed. The target samples (or,
  greedy, takes its argmax) at each node and follows the child with that
  token. Every emitted token is the target's own choice, so it is lossless for
  any tree, e.g. top-k children.
* ``verify_tree_sampled``: children drawn without replacement from q, in draw
  order (recursive rejection sampling, Jeon et al. 2024).
* ``verify_tree_iid``: children drawn i.i.d. with replacement from q
  (SpecInfer's multi-step speculative sampling, Miao et al. 2023).

On a chain (one child per node) the three are exactly today's chain rules
(coordinator/verification/rules.py): same uniforms, same emitted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from coordinator.sampling import maths
from coordinator.sampling.params import SamplingParams

ROOT = -1  # the parent index of the root's children: the current context
GREEDY = SamplingParams(temperature=0.0)

Update = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class TokenTree:
    """Draft tokens as a tree: ``tokens[i]`` hangs under ``parents[i]`` (ROOT for the
    context). Breadth-first means every parent comes before its children and
    parents never decrease, so each node's children are a contiguous run and one
    pass builds everything an engine or a verifier needs."""

    __slots__ = ("tokens", "parents", "depths", "_children")

    def __init__(self, tokens: Sequence[int], parents: Sequence[int]):
        self.tokens = tuple(int(t) for t in tokens)
        self.parents = tuple(int(p) for p in parents)
        _check_breadth_first(self.tokens, self.parents)
        depths: list[int] = []
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            depths.append(1 if parent == ROOT else depths[parent] + 1)
            children.setdefault(parent, []).append(node)
        self.depths = tuple(depths)  # the root's children are at depth 1
        self._children = {node: tuple(kids) for node, kids in children.items()}

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        """The chain case: each node the only child of the one before."""
        return cls(tokens, range(-1, len(tokens) - 1))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int = ROOT) -> tuple[int, ...]:
        return self._children.get(node, ())

    def ancestors(self, node: int) -> tuple[int, ...]:
        """The nodes above ``node``, root side first (the context not included)."""
        above = []
        while self.parents[node] != ROOT:
            node = self.parents[node]
            above.append(node)
        return tuple(reversed(above))

    def path(self, node: int) -> tuple[int, ...]:
        """The tokens from the root down to ``node`` inclusive: what the model
        conditions on at that node (after the context)."""
        return tuple(self.tokens[i] for i in (*self.ancestors(node), node))

    def flatten(self) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """What one forward verifies: the tokens in node order and, per node, its
        ancestors' indices (its position is the context length + depth - 1)."""
        return self.tokens, tuple(self.ancestors(node) for node in range(len(self)))

    def attention_mask(self) -> np.ndarray:
        """[n, n] booleans: node i attends to node j iff j is i or one of its ancestors
        (every node also attends to the whole context, not part of this mask)."""
        mask = np.eye(len(self), dtype=bool)
        for node in range(len(self)):
            mask[node, list(self.ancestors(node))] = True
        return mask


def _check_breadth_first(tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
    if len(tokens) != len(parents):
        raise ValueError(f"a token tree needs one parent per token: {len(tokens)} tokens, {len(parents)} parents")
    for node, parent in enumerate(parents):
        if not ROOT <= parent < node:
            raise ValueError(f"node {node}'s parent {parent} is not an earlier node or the root ({ROOT}): "
                             f"nodes must be in breadth-first order")
        if node and parent < parents[node - 1]:
            raise ValueError(f"nodes are not in breadth-first order: node {node}'s parent {parent} comes "
                             f"after node {node - 1}'s parent {parents[node - 1]}")
        if tokens[node] < 0:
            raise ValueError(f"node {node} has a negative token {tokens[node]}")


def _check_rows(tree: TokenTree, rows: np.ndarray, what: str) -> None:
    """One row per place a token is predicted: after the context, after each node."""
    if np.ndim(rows) != 2 or len(rows) != len(tree) + 1:
        raise ValueError(f"{what} have shape {list(np.shape(rows))}; a tree of {len(tree)} nodes needs "
                         f"{len(tree) + 1} rows (the root's, then one per node)")


def _check_distinct_siblings(tree: TokenTree) -> None:
    """Candidates drawn without replacement are distinct: a repeat means the tree
    was not drawn the way ``verify_tree_sampled`` assumes."""
    for node, children in tree._children.items():
        siblings = [tree.tokens[child] for child in children]
        if len(set(siblings)) != len(siblings):
            raise ValueError(f"the children of node {node} repeat a token ({siblings}): candidates drawn "
                             "without replacement are distinct")


# -- the rules -----------------------------------------------------------------------


def verify_tree_by_matching(tree: TokenTree, target_logits: np.ndarray, params: SamplingParams,
                            rng: maths.Uniforms | None) -> list[int]:
    """Walk down the tree while the target's own choice is a child: emit the
    accepted path plus the target's token after it. Greedy params: the target's
    argmax at each node, so the output equals plain greedy decoding and the
    accepted path is the longest in the tree that greedy decoding would take."""
    _check_rows(tree, target_logits, "target logits")
    emitted, node = [], ROOT
    while True:
        token = _target_choice(target_logits[node + 1], params, rng)
        emitted.append(token)
        node = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if node is None:
            return emitted


def verify_tree_greedy(tree: TokenTree, target_logits: np.ndarray) -> list[int]:
    """Greedy verification: matching against the target's argmax (no random numbers)."""
    return verify_tree_by_matching(tree, target_logits, GREEDY, None)


def verify_tree_sampled(tree: TokenTree, target_logits: np.ndarray, draft_probs: np.ndarray,
                        params: SamplingParams, rng: maths.Uniforms) -> list[int]:
    """Recursive rejection sampling over candidates drawn WITHOUT replacement
    (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference
    via Sampling Without Replacement", arXiv:2402.14160).

    At each node, its children in order must be the first draws of a sample
    without replacement from q = ``draft_probs[node + 1]``, and whether a node got
    one more child may depend on anything drawn before it, never on that child
    (coordinator/drafters/tree_shape.py grows trees so). Child i is
    accepted with probability min(1, p_i(x_i) / q_i(x_i)), where q_i is q without
    the earlier siblings, renormalised (the distribution x_i was drawn from), and
    p_{i+1} = normalise(max(0, p_i - q_i)). After the last rejection the
    correction is drawn from that residual; an accepted child is descended into;
    a leaf gives a bonus token from p. The output is distributed exactly as the
    target's sampler (p = ``maths.processed_probs`` of its logits).
    """
    _check_rows(tree, target_logits, "target logits")
    _check_rows(tree, draft_probs, "draft probabilities")
    _check_distinct_siblings(tree)
    return _walk(tree, target_logits, draft_probs, params, rng, without_replacement_update)


def verify_tree_iid(tree: TokenTree, target_logits: np.ndarray, draft_probs: np.ndarray,
                    params: SamplingParams, rng: maths.Uniforms) -> list[int]:
    """Multi-step speculative sampling for candidates drawn i.i.d. WITH replacement
    from q (SpecInfer, Miao et al. 2023, arXiv:2305.09781): as ``verify_tree_sampled``
    but q stays the same for every sibling, since each was drawn from q itself.
    Repeated siblings must stay separate nodes: merging them changes the rule."""
    _check_rows(tree, target_logits, "target logits")
    _check_rows(tree, draft_probs, "draft probabilities")
    return _walk(tree, target_logits, draft_probs, params, rng, with_replacement_update)


def without_replacement_update(p: np.ndarray, q: np.ndarray, rejected: int) -> tuple[np.ndarray, np.ndarray]:
    """After ``rejected`` fails: the residual p, and q without it (the next sibling's distribution)."""
    rest = q.copy()
    rest[rejected] = 0.0
    total = rest.sum()
    return residual(p, q), (rest / total if total > 0.0 else rest)


def with_replacement_update(p: np.ndarray, q: np.ndarray, rejected: int) -> tuple[np.ndarray, np.ndarray]:
    """After ``rejected`` fails: the residual p; q unchanged (i.i.d. siblings)."""
    return residual(p, q), q


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalise(max(0, p - q)): what p still owes after q's proposals; the chain
    rule's correction distribution (rules.accept_or_correct)."""
    rest = np.maximum(p - q, 0.0)
    if not rest.sum() > 0.0:  # p == q: a rejection cannot happen, but be safe
        rest = p
    return rest / rest.sum()


def _walk(tree: TokenTree, target_logits: np.ndarray, draft_probs: np.ndarray, params: SamplingParams,
          rng: maths.Uniforms, update: Update) -> list[int]:
    """From the root, descend into accepted children; stop with a correction or a bonus."""
    emitted, node = [], ROOT
    while True:
        children = tree.children(node)
        p = maths.processed_probs(target_logits[node + 1], params)
        q = np.asarray(draft_probs[node + 1], dtype=np.float64)
        accepted, correction = _first_accepted([tree.tokens[c] for c in children], p, q, rng, update)
        if accepted is None:
            emitted.append(_draw(correction, rng))
            return emitted
        node = children[accepted]
        emitted.append(tree.tokens[node])


def _first_accepted(candidates: list[int], p: np.ndarray, q: np.ndarray, rng: maths.Uniforms,
                    update: Update) -> tuple[int | None, np.ndarray | None]:
    """(index of the accepted candidate, None), or (None, the distribution to draw
    the target's token from: the residual after the last rejection, p at a leaf)."""
    for i, token in enumerate(candidates):
        if i:
            p, q = update(p, q, candidates[i - 1])
        if _accepts(p, q, token, rng):
            return i, None
    return None, (residual(p, q) if candidates else p)


def _accepts(p: np.ndarray, q: np.ndarray, token: int, rng: maths.Uniforms) -> bool:
    """True with probability min(1, p(token) / q(token)), one uniform (none when q(token) = 0)."""
    return bool(q[token] > 0.0 and rng.random() * q[token] < p[token])


def _draw(probs: np.ndarray, rng: maths.Uniforms) -> int:
    return maths.inverse_cdf(probs, rng.random())


def _target_choice(logits: np.ndarray, params: SamplingParams, rng: maths.Uniforms | None) -> int:
    """The target's token at a node: argmax when greedy (no uniform), else one draw."""
    if params.greedy:
        return maths.select_token(logits, params, rng)
    return _draw(maths.processed_probs(logits, params), rng)
