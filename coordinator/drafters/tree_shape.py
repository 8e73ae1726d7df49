"""Growing a draft token tree whose shape follows the draft's confidence
(the dynamic trees of EAGLE-2, Li et al. 2024, arXiv:2406.16858).

The value of a node is its path probability, the product of q along the path
from the root. Growth repeatedly expands the frontier node of highest value
(gives it its children) until the node budget is spent, so the budget goes
where the draft expects the target to agree. A child's value is at most its
parent's, so the expanded nodes are exactly the most valuable ones.

How children are drawn decides which rule may verify the tree
(coordinator/verification/tree.py):

* top-k of q (``greedy=True``, deterministic): verify by matching
  (``verify_tree_by_matching``; with a greedy target, ``verify_tree_greedy``).
* sampled (``greedy=False``): the children of a node are, in order, the first
  draws of a sample without replacement from q, which is what
  ``verify_tree_sampled`` assumes when it accepts child i with
  min(1, p_i / q_i). So a drawn candidate is never dropped, reordered or
  ranked by its own value here (EAGLE-2's final re-ranking would do that);
  the choice of which node to expand next may look at anything already drawn.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coordinator.sampling import maths
from coordinator.verification.tree import ROOT, TokenTree

DraftModel = Callable[[tuple[int, ...]], np.ndarray]  # q after the context + this path of tree tokens


@dataclass(frozen=True)
class DraftTree:
    """A grown tree and the draft's q where it drew children: row 0 at the root,
    row i + 1 at node i (zeros for nodes never expanded), the rows
    ``verify_tree_sampled`` reads."""

    tree: TokenTree
    draft_probs: np.ndarray


def grow_tree(draft: DraftModel, *, budget: int, max_depth: int, branching: int, greedy: bool,
              rng: maths.Uniforms | None = None) -> DraftTree:
    """Up to ``budget`` nodes, none deeper than ``max_depth``, at most ``branching``
    children per node, by best-first expansion of the frontier (ties: the
    earlier node). Budget n with branching 1 is the chain of n tokens the draft
    would have proposed one by one. ``rng`` (the request's stream) draws sampled
    children; greedy growth draws nothing."""
    if budget < 0 or max_depth < 1 or branching < 1:
        raise ValueError(f"a tree needs budget >= 0, max_depth >= 1 and branching >= 1; got "
                         f"budget={budget}, max_depth={max_depth}, branching={branching}")
    if not greedy and rng is None:
        raise ValueError("sampled children need the request's random stream (rng)")
    tokens: list[int] = []
    parents: list[int] = []
    probs_at: dict[int, np.ndarray] = {}
    frontier = [(-1.0, ROOT, ())]  # (-value, node, path): the root first
    while frontier and len(tokens) < budget:
        negative_value, node, path = heapq.heappop(frontier)
        q = probs_at[node] = np.asarray(draft(path), dtype=np.float64)
        for token in _children(q, min(branching, budget - len(tokens)), greedy, rng):
            tokens.append(token)
            parents.append(node)
            if len(path) + 1 < max_depth:
                heapq.heappush(frontier, (negative_value * q[token], len(tokens) - 1, (*path, token)))
    return _breadth_first(tokens, parents, probs_at)


def _children(q: np.ndarray, count: int, greedy: bool, rng: maths.Uniforms | None) -> list[int]:
    return top_k_tokens(q, count) if greedy else sample_without_replacement(q, count, rng)


def top_k_tokens(q: np.ndarray, count: int) -> list[int]:
    """The ``count`` likeliest tokens with q > 0, likeliest first (ties: lower id)."""
    order = np.argsort(-q, kind="stable")[:count]
    return [int(t) for t in order if q[t] > 0.0]


def sample_without_replacement(q: np.ndarray, count: int, rng: maths.Uniforms) -> list[int]:
    """``count`` distinct tokens (fewer if q has fewer with q > 0), in draw order:
    each from q without the ones before, renormalised. The same distribution as
    Gumbel-top-k (Kool et al. 2019), with one uniform per draw rather than one
    per vocabulary entry; the first draw is the chain drafter's own sample."""
    rest = np.array(q, dtype=np.float64)
    drawn: list[int] = []
    for _ in range(min(count, int(np.count_nonzero(rest > 0.0)))):
        token = maths.inverse_cdf(rest, rng.random())
        drawn.append(token)
        rest[token] = 0.0
    return drawn


def _breadth_first(tokens: list[int], parents: list[int], probs_at: dict[int, np.ndarray]) -> DraftTree:
    """Renumber the nodes (made in expansion order) breadth-first, siblings kept in
    draw order, and lay q out in the verifier's rows."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    order: list[int] = []
    queue = list(children.get(ROOT, ()))
    while queue:
        order.extend(queue)
        queue = [child for node in queue for child in children.get(node, ())]
    new_index = {ROOT: ROOT, **{old: new for new, old in enumerate(order)}}
    tree = TokenTree([tokens[old] for old in order], [new_index[parents[old]] for old in order])
    draft_probs = np.zeros((len(order) + 1, probs_at[ROOT].size if probs_at else 0))
    for old, q in probs_at.items():
        draft_probs[new_index[old] + 1] = q
    return DraftTree(tree, draft_probs)
