"""Token trees are verified losslessly: exact output distributions, one statistical
run of the whole pipeline, and named mutants that must fail.

The models are toy language models (4 or 5 tokens for the exact checks, 10
for the statistical one) whose distribution is a random function of the whole
path (``PathModel``), so the target's own distribution over the next m tokens
is known exactly.

* Exact checks: every random step of growing and verifying a tree goes through
  three primitives (the draw of a node's children, the acceptance test, the
  draw of a token from a distribution). ``outcomes`` replaces them by scripted
  choices and replays the production code once per combination of choices,
  multiplying the exact probability of each: the distribution of the emitted
  tokens over the draft's draws and the verifier's uniforms, computed, not
  sampled. The first m emitted tokens (continued by the target's own
  distribution where a round emitted fewer) must equal the target's to 1e-12.
  The scripted primitives' own probabilities are checked against the real
  ones (chain rules, a sampling test), and the statistical run uses the real
  random streams end to end.
* Statistical check: N_STAT requests, each grown and verified by the production
  code with its own seeded streams; a chi-square test at ALPHA that, as shown
  here, rejects a total-variation error of 0.01 at this N.
* Mutants: the same exact check must fail for each wrong rule: (a) q not
  renormalised after a rejected sibling, (a') p not updated between siblings,
  (b) each branch accepted with the chain formula, (c) candidates drawn with
  replacement and redrawn until distinct, (d) sampled candidates reordered
  likeliest first, (e) top-k candidates verified by rejection; candidates
  drawn with replacement (repeats) are refused by the without-replacement rule.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from coordinator.drafters import tree_shape
from coordinator.drafters.tree_shape import grow_tree, sample_without_replacement, top_k_tokens
from coordinator.sampling.maths import call_rng, inverse_cdf, processed_probs
from coordinator.sampling.params import SamplingParams, call_seed
from coordinator.verification import tree as tree_rules
from coordinator.verification.rules import verify_by_matching, verify_by_rejection
from coordinator.verification.tree import (ROOT, TokenTree, residual, verify_tree_by_matching, verify_tree_greedy,
                                           verify_tree_iid, verify_tree_sampled, with_replacement_update)
from tests.stats import gof_pvalue, total_variation
from tests.unit.test_rejection_sampling import _memoised_probabilities  # noqa: F401 (speed: cached, pure)

SAMPLED = SamplingParams(temperature=1.0)
PARAMS = {
    "temperature_1": SAMPLED,
    "temperature_0.7_top_k_3": SamplingParams(temperature=0.7, top_k=3),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8),
}
EXACT = 1e-12


class PathModel:
    """A toy model: a random distribution after every path (the tokens after the
    prompt), always the same one for the same path. ``zeros`` tokens of each
    row get probability 0, so supports differ between draft and target."""

    def __init__(self, vocab: int, seed: int, concentration: float = 0.8, zeros: int = 0):
        self.vocab, self.seed, self.concentration, self.zeros = vocab, seed, concentration, zeros
        self._probs: dict = {}
        self._logits: dict = {}
        self._joint: dict = {}

    def probs(self, path: tuple[int, ...]) -> np.ndarray:
        path = tuple(path)
        if path not in self._probs:
            rng = np.random.default_rng([self.seed, len(path), *path])
            row = rng.dirichlet(np.full(self.vocab, self.concentration))
            row[rng.choice(self.vocab, self.zeros, replace=False)] = 0.0
            self._probs[path] = row / row.sum()
        return self._probs[path]

    def logits(self, path: tuple[int, ...]) -> np.ndarray:
        path = tuple(path)
        if path not in self._logits:
            with np.errstate(divide="ignore"):
                self._logits[path] = np.log(self.probs(path))
        return self._logits[path]

    def joint(self, params: SamplingParams, path: tuple[int, ...], m: int) -> np.ndarray:
        """The target's exact distribution of the next m tokens after ``path``: shape [vocab] * m."""
        key = (params, tuple(path), m)
        if key not in self._joint:
            if m == 0:
                self._joint[key] = np.array(1.0)
            else:
                p = processed_probs(self.logits(path), params)
                self._joint[key] = np.stack([p[t] * self.joint(params, (*path, t), m - 1)
                                             for t in range(self.vocab)])
        return self._joint[key]

    def greedy(self, path: tuple[int, ...], m: int) -> list[int]:
        """The target's own greedy continuation of ``path``, m tokens."""
        out = list(path)
        for _ in range(m):
            out.append(int(np.argmax(self.probs(tuple(out)))))
        return out[len(path):]


def target_rows(target: PathModel, tree: TokenTree, context: tuple[int, ...] = ()) -> np.ndarray:
    """The target's logits in the verifier's rows: after the context, then after each node."""
    return np.stack([target.logits(context)] + [target.logits((*context, *tree.path(i))) for i in range(len(tree))])


# ---------------------------------------------------------------------------
# exact enumeration of every random step


class Script:
    """The choices of one replay: a prefix to follow, the first option beyond it.
    It has no ``random()``: a random step that bypasses the primitives fails loudly."""

    def __init__(self, prefix: tuple[int, ...]):
        self.prefix, self.taken, self.sizes, self.weight = prefix, [], [], 1.0

    def choose(self, options):
        options = [(value, chance) for value, chance in options if chance > 0.0]
        step = len(self.taken)
        index = self.prefix[step] if step < len(self.prefix) else 0
        self.taken.append(index)
        self.sizes.append(len(options))
        value, chance = options[index]
        self.weight *= chance
        return value


def outcomes(run):
    """(result, exact probability) of every distinct sequence of choices of ``run(script)``."""
    pending = [()]
    while pending:
        script = Script(pending.pop())
        result = run(script)
        for step in range(len(script.prefix), len(script.taken)):
            pending.extend((*script.taken[:step], other) for other in range(1, script.sizes[step]))
        yield result, script.weight


def scripted_accepts(p, q, token, script):
    chance = min(1.0, p[token] / q[token]) if q[token] > 0.0 else 0.0
    return script.choose([(True, chance), (False, 1.0 - chance)])


def scripted_draw(probs, script):
    return script.choose([(token, chance / probs.sum()) for token, chance in enumerate(probs)])


def scripted_without_replacement(q, count, script):
    rest, drawn = np.array(q, dtype=np.float64), []
    for _ in range(min(count, int(np.count_nonzero(rest)))):
        drawn.append(scripted_draw(rest, script))
        rest[drawn[-1]] = 0.0
    return drawn


def scripted_with_replacement(q, count, script):
    return [scripted_draw(np.asarray(q), script) for _ in range(count)]


@pytest.fixture
def scripted(monkeypatch):
    """Route the production code's random steps through ``Script.choose``."""
    monkeypatch.setattr(tree_rules, "_accepts", scripted_accepts)
    monkeypatch.setattr(tree_rules, "_draw", scripted_draw)
    monkeypatch.setattr(tree_shape, "sample_without_replacement", scripted_without_replacement)
    return monkeypatch


def emitted_distribution(run, target: PathModel, params: SamplingParams, m: int) -> np.ndarray:
    """Exact distribution of the first m tokens: the round's, then the target's own after them."""
    dist, total = np.zeros((target.vocab,) * m), 0.0
    for emitted, weight in outcomes(run):
        head = tuple(emitted[:m])
        dist[head] += weight * target.joint(params, head, m - len(head))
        total += weight
    assert total == pytest.approx(1.0, abs=EXACT)
    return dist


def exact_errors(run, target: PathModel, params: SamplingParams, m: int = 2) -> list[float]:
    """Max |error| of the first 1..m emitted tokens' distribution against the target's."""
    dist = emitted_distribution(run, target, params, m)
    exact = target.joint(params, (), m)
    return [float(np.abs(dist.sum(axis=tuple(range(k, m))) - exact.sum(axis=tuple(range(k, m)))).max())
            for k in range(1, m + 1)]


def drawn_tree_run(parents, target, draft, params, draw_children, verify=verify_tree_sampled):
    """Children of each node of a fixed shape drawn by ``draw_children(q, count, script)``, then verified."""
    shape = TokenTree([0] * len(parents), parents)

    def run(script):
        tokens, draft_probs = [0] * len(parents), np.zeros((len(parents) + 1, draft.vocab))
        for node in (ROOT, *range(len(parents))):
            if shape.children(node):
                path = () if node == ROOT else tuple(tokens[i] for i in (*shape.ancestors(node), node))
                draft_probs[node + 1] = draft.probs(path)
                for child, token in zip(shape.children(node), draw_children(draft.probs(path),
                                                                            len(shape.children(node)), script)):
                    tokens[child] = token
        tree = TokenTree(tokens, parents)
        return verify(tree, target_rows(target, tree), draft_probs, params, script)

    return run


def grown_tree_run(target, draft, params, *, budget, max_depth, branching, greedy=False, verify=verify_tree_sampled):
    def run(script):
        grown = grow_tree(draft.probs, budget=budget, max_depth=max_depth, branching=branching, greedy=greedy,
                          rng=script)
        return verify(grown.tree, target_rows(target, grown.tree), grown.draft_probs, params, script)

    return run


def by_matching(tree, rows, draft_probs, params, rng):
    return verify_tree_by_matching(tree, rows, params, rng)


TARGET5, DRAFT5 = PathModel(5, 1, zeros=1), PathModel(5, 2)
TARGET4, DRAFT4 = PathModel(4, 3, concentration=0.6, zeros=1), PathModel(4, 4, concentration=0.6, zeros=1)
SHAPES = {  # parents (breadth-first), target, draft
    "three_children": ((-1, -1, -1), TARGET5, DRAFT5),
    "two_children_each_with_one": ((-1, -1, 0, 1), TARGET4, DRAFT4),
    "two_then_two_under_the_first": ((-1, -1, 0, 0), TARGET4, DRAFT4),
    "depth_3": ((-1, -1, 0, 2), TARGET4, DRAFT4),
}


def test_the_enumeration_is_exact_on_a_known_case():
    """Two draws without replacement from [0.5, 0.3, 0.2]: probabilities by hand."""
    q = np.array([0.5, 0.3, 0.2])
    found = dict(outcomes(lambda script: tuple(scripted_without_replacement(q, 2, script))))
    assert found[(0, 1)] == pytest.approx(0.5 * 0.3 / 0.5, abs=EXACT)
    assert found[(2, 1)] == pytest.approx(0.2 * 0.3 / 0.8, abs=EXACT)
    assert len(found) == 6 and sum(found.values()) == pytest.approx(1.0, abs=EXACT)


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fixed_shapes_drawn_without_replacement_are_exact(scripted, shape, params):
    parents, target, draft = SHAPES[shape]
    run = drawn_tree_run(parents, target, draft, PARAMS[params], scripted_without_replacement)
    assert max(exact_errors(run, target, PARAMS[params], m=3 if shape == "depth_3" else 2)) < EXACT


@pytest.mark.parametrize("shape", ["three_children", "two_children_each_with_one"])
def test_the_iid_variant_with_repeated_siblings_is_exact(scripted, shape):
    parents, target, draft = SHAPES[shape]
    run = drawn_tree_run(parents, target, draft, SAMPLED, scripted_with_replacement, verify_tree_iid)
    assert max(exact_errors(run, target, SAMPLED)) < EXACT


GROWN = {  # budget, max_depth, branching, target, draft
    "budget_4_depth_2_branching_2": (4, 2, 2, TARGET4, DRAFT4),
    "budget_5_depth_3_branching_3": (5, 3, 3, TARGET4, DRAFT4),
    "budget_3_depth_3_branching_1": (3, 3, 1, TARGET4, DRAFT4),
    "budget_4_depth_2_branching_3_five_tokens": (4, 2, 3, TARGET5, DRAFT5),
}


@pytest.mark.parametrize("params", ["temperature_1", "temperature_0.7_top_k_3"])
@pytest.mark.parametrize("grown", list(GROWN))
def test_grown_sampled_trees_are_exact(scripted, grown, params):
    budget, depth, branching, target, draft = GROWN[grown]
    run = grown_tree_run(target, draft, PARAMS[params], budget=budget, max_depth=depth, branching=branching)
    assert max(exact_errors(run, target, PARAMS[params], m=3)) < EXACT


def test_grown_top_k_trees_verified_by_matching_are_exact_for_a_sampled_target(scripted):
    run = grown_tree_run(TARGET5, DRAFT5, SAMPLED, budget=5, max_depth=3, branching=2, greedy=True,
                         verify=by_matching)
    assert max(exact_errors(run, TARGET5, SAMPLED, m=3)) < EXACT


# ---------------------------------------------------------------------------
# mutants: each wrong rule must fail the exact check


def without(q, token):
    rest = q.copy()
    rest[token] = 0.0
    return rest / rest.sum()


RULE_MUTANTS = {
    # (a) the sibling's probability not removed: q not renormalised after a rejected sibling
    "q_not_renormalised_after_a_rejected_sibling": with_replacement_update,
    # (a') p not updated between siblings (q renormalised)
    "p_not_updated_between_siblings": lambda p, q, token: (p, without(q, token)),
    # (b) each child tested with the node's own p and q, as if it were the only candidate
    "branch_accepted_with_the_chain_formula": lambda p, q, token: (p, q),
}


@pytest.mark.parametrize("mutant", list(RULE_MUTANTS))
def test_a_wrong_sibling_rule_fails_the_exact_check(scripted, mutant):
    scripted.setattr(tree_rules, "without_replacement_update", RULE_MUTANTS[mutant])
    run = drawn_tree_run(SHAPES["three_children"][0], TARGET5, DRAFT5, SAMPLED, scripted_without_replacement)
    assert exact_errors(run, TARGET5, SAMPLED)[0] > 1e-2


def distinct_iid(q, count, script):
    """(c) Wrong draw: i.i.d. with replacement, redrawn until distinct (not a sample without replacement)."""
    tuples = list(itertools.permutations(np.flatnonzero(q), count))
    weights = np.array([math.prod(q[t] for t in drawn) for drawn in tuples])
    return list(script.choose(zip(tuples, weights / weights.sum())))


def ordered_by_q(q, count, script):
    """(d) Wrong draw: sampled without replacement, then ordered likeliest first as top-k is."""
    return sorted(scripted_without_replacement(q, count, script), key=lambda t: -q[t])


@pytest.mark.parametrize("draw", [distinct_iid, ordered_by_q])
def test_candidates_not_drawn_as_the_rule_assumes_fail_the_exact_check(scripted, draw):
    scripted.setattr(tree_shape, "sample_without_replacement", draw)
    run = grown_tree_run(TARGET5, DRAFT5, SAMPLED, budget=3, max_depth=2, branching=3)
    assert exact_errors(run, TARGET5, SAMPLED)[0] > 1e-2


def test_candidates_drawn_with_replacement_are_refused_by_the_without_replacement_rule(scripted):
    run = drawn_tree_run(SHAPES["three_children"][0], TARGET4, DRAFT4, SAMPLED, scripted_with_replacement)
    with pytest.raises(ValueError, match="repeat a token"):
        exact_errors(run, TARGET4, SAMPLED)


def test_top_k_children_verified_by_rejection_fail_the_exact_check(scripted):
    """The rejection rule needs sampled children; top-k children need matching."""
    run = grown_tree_run(TARGET5, DRAFT5, SAMPLED, budget=3, max_depth=2, branching=3, greedy=True)
    assert exact_errors(run, TARGET5, SAMPLED)[0] > 1e-2


# ---------------------------------------------------------------------------
# the scripted primitives are the real ones


def test_sample_without_replacement_draws_ordered_pairs_with_their_exact_probabilities():
    q = np.array([0.35, 0.25, 0.2, 0.15, 0.05])
    pairs = list(itertools.permutations(range(5), 2))
    exact = np.array([q[a] * q[b] / (1 - q[a]) for a, b in pairs])
    rng = call_rng(5)
    index = {pair: i for i, pair in enumerate(pairs)}
    counts = np.bincount([index[tuple(sample_without_replacement(q, 2, rng))] for _ in range(20_000)],
                         minlength=len(pairs))
    assert gof_pvalue(counts, exact) > 1e-4
    assert sorted(sample_without_replacement(np.array([0.0, 0.7, 0.0, 0.3]), 3, rng)) == [1, 3]


def test_the_acceptance_test_and_the_draw_use_one_uniform_each():
    class Fixed:
        def __init__(self, u):
            self.u, self.calls = u, 0

        def random(self):
            self.calls += 1
            return self.u

    p, q = np.array([0.2, 0.8]), np.array([0.5, 0.5])
    assert tree_rules._accepts(p, q, 0, Fixed(0.39)) and not tree_rules._accepts(p, q, 0, Fixed(0.41))
    never = Fixed(0.0)
    assert not tree_rules._accepts(p, np.array([0.0, 1.0]), 0, never) and never.calls == 0
    assert tree_rules._draw(np.array([0.25, 0.75]), Fixed(0.3)) == 1


# ---------------------------------------------------------------------------
# a chain is today's chain rules


def chain_case(seed: int, vocab: int = 5, k: int = 3):
    """Target logits, q rows (one spare for the last node) and draft tokens, mostly drawn from q."""
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore"):
        logits = np.log(rng.dirichlet(np.full(vocab, 0.7), size=k + 1))
    q = rng.dirichlet(np.full(vocab, 0.7), size=k + 1)
    drafts = [int(rng.choice(vocab, p=row)) if rng.random() < 0.8 else int(rng.integers(vocab)) for row in q[:k]]
    return logits, q, drafts


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.7, top_k=3), SamplingParams()])
def test_a_chain_emits_what_the_chain_rules_emit_for_the_same_uniforms(params):
    for seed in range(300):
        logits, q, drafts = chain_case(seed)
        chain = TokenTree.chain(drafts)
        expected = verify_by_rejection(logits, q[:-1], drafts, params, call_rng(seed))
        assert verify_tree_sampled(chain, logits, q, params, call_rng(seed)) == expected
        assert verify_tree_iid(chain, logits, q, params, call_rng(seed)) == expected
        expected = verify_by_matching(logits, drafts, params, call_rng(seed))
        assert verify_tree_by_matching(chain, logits, params, call_rng(seed)) == expected


# ---------------------------------------------------------------------------
# greedy


def random_tree(rng, size: int, vocab: int, branching: int = 3) -> TokenTree:
    """A random breadth-first tree: each node in turn gets 0..branching distinct-token children."""
    tokens, parents, node = [], [], ROOT
    while len(tokens) < size and node < len(tokens):
        count = min(int(rng.integers(1 if node == ROOT else 0, branching + 1)), size - len(tokens), vocab)
        tokens += [int(t) for t in rng.choice(vocab, count, replace=False)]
        parents += [node] * count
        node += 1
    return TokenTree(tokens, parents)


def test_greedy_verification_is_greedy_decoding_along_the_longest_matching_path():
    rng = np.random.default_rng(11)
    for trial in range(300):
        target = PathModel(3, 100 + trial)
        tree = random_tree(rng, int(rng.integers(1, 12)), 3)
        emitted = verify_tree_greedy(tree, target_rows(target, tree))
        assert emitted == target.greedy((), len(emitted))
        matching = [tree.depths[i] for i in range(len(tree)) if list(tree.path(i)) == target.greedy((), tree.depths[i])]
        assert len(emitted) == max(matching, default=0) + 1


def test_greedy_verification_ignores_the_draft_and_draws_nothing():
    target = PathModel(4, 9)
    tree = random_tree(np.random.default_rng(2), 10, 4)
    assert verify_tree_by_matching(tree, target_rows(target, tree), SamplingParams(), None) == \
        verify_tree_greedy(tree, target_rows(target, tree))


# ---------------------------------------------------------------------------
# the tree and its flat form


def test_children_paths_depths_and_the_flat_form():
    #        root
    #       /    \
    #     0:7    1:8
    #    /   \      \
    #  2:9  3:10   4:11
    #   |
    #  5:12
    tree = TokenTree([7, 8, 9, 10, 11, 12], [-1, -1, 0, 0, 1, 2])
    assert tree.children() == (0, 1) and tree.children(0) == (2, 3) and tree.children(5) == ()
    assert tree.depths == (1, 1, 2, 2, 2, 3)
    assert tree.path(5) == (7, 9, 12) and tree.ancestors(5) == (0, 2) and tree.ancestors(1) == ()
    tokens, ancestors = tree.flatten()
    assert tokens == (7, 8, 9, 10, 11, 12) and ancestors == ((), (), (0,), (0,), (1,), (0, 2))
    mask = tree.attention_mask()
    assert mask.tolist()[5] == [True, False, True, False, False, True]
    assert (mask == mask & np.tri(6, dtype=bool)).all()  # only earlier nodes or itself
    assert (TokenTree.chain([3, 1, 4]).attention_mask() == np.tri(3, dtype=bool)).all()


@pytest.mark.parametrize("tokens, parents, problem", [
    ([1, 2, 3], [-1, 0, -1], "not in breadth-first order"),
    ([1, 2], [-1, 1], "not an earlier node"),
    ([1, 2], [-1, -2], "not an earlier node"),
    ([1, 2, 3], [-1, 0], "one parent per token"),
    ([1, -2], [-1, 0], "negative token"),
])
def test_a_malformed_tree_is_refused(tokens, parents, problem):
    with pytest.raises(ValueError, match=problem):
        TokenTree(tokens, parents)


def test_rows_that_do_not_match_the_nodes_are_refused():
    tree = TokenTree([1, 2], [-1, -1])
    logits, q = np.zeros((3, 4)), np.full((3, 4), 0.25)
    for verify in (lambda rows: verify_tree_sampled(tree, rows, q, SAMPLED, call_rng(0)),
                   lambda rows: verify_tree_by_matching(tree, rows, SAMPLED, call_rng(0))):
        with pytest.raises(ValueError, match="a tree of 2 nodes needs 3 rows"):
            verify(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="draft probabilities .* needs 3 rows"):
        verify_tree_sampled(tree, logits, q[:2], SAMPLED, call_rng(0))
    with pytest.raises(ValueError, match="repeat a token"):
        verify_tree_sampled(TokenTree([1, 1], [-1, -1]), logits, q, SAMPLED, call_rng(0))


# ---------------------------------------------------------------------------
# growing


def test_a_budget_of_n_with_branching_1_is_the_chain_of_length_n():
    draft = PathModel(6, 21)
    for n in range(6):
        greedy = grow_tree(draft.probs, budget=n, max_depth=8, branching=1, greedy=True)
        assert greedy.tree.parents == tuple(range(-1, n - 1))
        assert list(greedy.tree.tokens) == draft.greedy((), n)
        sampled = grow_tree(draft.probs, budget=n, max_depth=8, branching=1, greedy=False, rng=call_rng(n))
        rng, path = call_rng(n), ()
        for _ in range(n):  # the chain drafter: one draw of q per position, same stream
            path += (inverse_cdf(draft.probs(path), rng.random()),)
        assert sampled.tree.parents == tuple(range(-1, n - 1)) and sampled.tree.tokens == path


def expanded_values(grown, draft):
    """Path probability of each node and whether it got children."""
    tree, values = grown.tree, []
    for node in range(len(tree)):
        parent_path = tree.path(node)[:-1]
        parent_value = 1.0 if tree.parents[node] == ROOT else values[tree.parents[node]][0]
        values.append((parent_value * draft.probs(parent_path)[tree.tokens[node]], bool(tree.children(node))))
    return values


@pytest.mark.parametrize("greedy", [True, False])
def test_growth_respects_budget_depth_and_branching_and_expands_the_likeliest_nodes(greedy):
    draft = PathModel(5, 31, concentration=0.5, zeros=1)
    for seed in range(200):
        budget, depth, branching = 1 + seed % 9, 1 + seed % 4, 1 + seed % 3
        grown = grow_tree(draft.probs, budget=budget, max_depth=depth, branching=branching, greedy=greedy,
                          rng=call_rng(seed))
        tree = grown.tree
        assert len(tree) <= budget and max(tree.depths, default=0) <= depth
        assert all(len(tree.children(node)) <= branching for node in (ROOT, *range(len(tree))))
        values = expanded_values(grown, draft)
        expanded = [value for value, has_children in values if has_children]
        waiting = [value for (value, has_children), d in zip(values, tree.depths) if not has_children and d < depth]
        assert min(expanded, default=1.0) >= max(waiting, default=0.0)
        if waiting:  # growth stopped for want of budget, not of candidates
            assert len(tree) == budget
        for node in (ROOT, *range(len(tree))):  # q where children were drawn, zeros elsewhere
            row = grown.draft_probs[node + 1]
            q = draft.probs(() if node == ROOT else tree.path(node))
            assert np.array_equal(row, q) if tree.children(node) else not row.any()
            if greedy and tree.children(node):
                assert [tree.tokens[c] for c in tree.children(node)] == top_k_tokens(q, len(tree.children(node)))


def test_growth_expands_the_most_probable_frontier_node_first():
    q = {(): [0.6, 0.4, 0.0], (0,): [0.8, 0.2, 0.0], (0, 0): [0.5, 0.5, 0.0]}
    grown = grow_tree(lambda path: np.array(q.get(path, [0.0, 0.0, 1.0])), budget=7, max_depth=3, branching=2,
                      greedy=True)
    # root -> 0 (0.6), 1 (0.4); expand 0 -> 00 (0.48), 01 (0.12); expand 00 (deeper but likelier than 1)
    # -> 000, 001 (0.24 each); expand 1 (0.4) -> 12 (0.4): budget spent. Renumbered breadth-first.
    assert grown.tree.tokens == (0, 1, 0, 1, 2, 0, 1)
    assert grown.tree.parents == (-1, -1, 0, 0, 1, 2, 2)
    assert grown.draft_probs[[0, 1, 2, 3]].tolist() == [q[()], q[(0,)], [0.0, 0.0, 1.0], q[(0, 0)]]


def test_greedy_growth_is_deterministic_and_sampled_growth_follows_its_seed():
    draft = PathModel(6, 41)

    def grow(greedy, seed):
        return grow_tree(draft.probs, budget=8, max_depth=3, branching=3, greedy=greedy,
                         rng=None if greedy else call_rng(seed))

    assert grow(True, 0).tree.tokens == grow(True, 0).tree.tokens
    assert grow(False, 3).tree.tokens == grow(False, 3).tree.tokens
    assert len({(grow(False, s).tree.tokens, grow(False, s).tree.parents) for s in range(20)}) > 5


def test_growth_refuses_bad_settings():
    with pytest.raises(ValueError, match="rng"):
        grow_tree(lambda path: np.ones(3) / 3, budget=2, max_depth=2, branching=2, greedy=False)
    with pytest.raises(ValueError, match="branching >= 1"):
        grow_tree(lambda path: np.ones(3) / 3, budget=2, max_depth=2, branching=0, greedy=True)
    empty = grow_tree(lambda path: np.ones(3) / 3, budget=0, max_depth=2, branching=2, greedy=True)
    assert len(empty.tree) == 0 and verify_tree_greedy(empty.tree, np.log([[0.2, 0.5, 0.3]])) == [1]


# ---------------------------------------------------------------------------
# statistical: the whole pipeline with its real random streams

N_STAT = 30_000
ALPHA = 1e-3
PROMPT = 7  # absolute position of the first generated token (for the call seeds)
# Ten tokens, a near-flat target: a TV error of 0.01 is detectable at N_STAT (see the power test).
STAT_TARGET, STAT_DRAFT = PathModel(10, 51, concentration=20.0), PathModel(10, 52, concentration=1.0)


def pipeline_first_two(target, draft, params, n, *, budget=4, max_depth=2, branching=2):
    """The first two tokens of requests 0..n-1: rounds of grow (draft stream) and verify (target stream)."""
    out = np.empty((n, 2), dtype=np.int64)
    for seed in range(n):
        context: tuple[int, ...] = ()
        while len(context) < 2:
            position = PROMPT + len(context)
            draft_rng, target_rng = (call_rng(call_seed(seed, position, role)) for role in ("draft", "target"))
            grown = grow_tree(lambda path: draft.probs((*context, *path)), budget=budget, max_depth=max_depth,
                              branching=branching, greedy=False, rng=draft_rng)
            rows = target_rows(target, grown.tree, context)
            context += tuple(verify_tree_sampled(grown.tree, rows, grown.draft_probs, params, target_rng))
        out[seed] = context[:2]
    return out


def stat_checks(samples, target, params):
    """(p-value, TV) of the first token and of the first two against the exact distribution."""
    v, joint = target.vocab, target.joint(params, (), 2)
    first = np.bincount(samples[:, 0], minlength=v)
    pairs = np.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v)
    return {"token 1": (gof_pvalue(first, joint.sum(axis=1)), total_variation(first, joint.sum(axis=1))),
            "tokens 1-2": (gof_pvalue(pairs, joint.reshape(-1)), total_variation(pairs, joint.reshape(-1)))}


def test_the_whole_pipeline_emits_the_targets_distribution():
    results = stat_checks(pipeline_first_two(STAT_TARGET, STAT_DRAFT, SAMPLED, N_STAT), STAT_TARGET, SAMPLED)
    assert all(pvalue > ALPHA for pvalue, _ in results.values()), results


def test_the_statistical_check_detects_a_total_variation_error_of_0_01():
    """At N_STAT and ALPHA, moving 0.01 of probability between the two likeliest
    cells of the first token's or the first two tokens' distribution (a TV error
    of exactly 0.01) is rejected in at least 198 of 200 independent multinomial
    draws: a power of about 0.99 or more."""
    joint = STAT_TARGET.joint(SAMPLED, (), 2)
    rng = np.random.default_rng(8)
    for probs in (joint.sum(axis=1), joint.reshape(-1)):
        first, second = np.argsort(-probs)[:2]
        shifted = probs.copy()
        shifted[first] -= 0.01
        shifted[second] += 0.01
        assert total_variation(shifted, probs) == pytest.approx(0.01)
        assert sum(gof_pvalue(rng.multinomial(N_STAT, shifted), probs) < ALPHA for _ in range(200)) >= 198


def test_a_tree_accepts_more_than_its_first_branch_alone():
    """Why trees: with three candidates the first token is a draft token more often
    than with one (1 - TV(p, q) for a single candidate)."""
    p, q = STAT_TARGET.probs(()), STAT_DRAFT.probs(())
    rates = []
    for branching in (1, 3):
        accepted = 0
        for seed in range(1000):
            grown = grow_tree(STAT_DRAFT.probs, budget=branching, max_depth=1, branching=branching, greedy=False,
                              rng=call_rng(seed))
            emitted = verify_tree_sampled(grown.tree, target_rows(STAT_TARGET, grown.tree), grown.draft_probs,
                                          SAMPLED, call_rng(seed + 10**6))
            accepted += len(emitted) == 2
        rates.append(accepted / 1000)
    assert abs(rates[0] - float(np.minimum(p, q).sum())) < 0.05
    assert rates[1] > rates[0] + 0.05


def test_residual_is_the_chain_rules_correction_distribution():
    p, q = np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.1, 0.6, 0.1, 0.2])
    assert residual(p, q) == pytest.approx([0.4 / 0.5, 0.0, 0.1 / 0.5, 0.0])
    assert residual(p, p) == pytest.approx(p)
