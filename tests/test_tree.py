"""Tests for ddtree_reference/tree.py: DDTree best-first construction, chain drafts,
tree invariants, greedy acceptance walk, and input validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_reference.tree import Tree, TreeError, build_chain, build_ddtree

SETTINGS = settings(max_examples=200, deadline=None)


# ---------------------------------------------------------------- generators
@st.composite
def logprob_matrices(draw: st.DrawFn, max_l: int = 4, max_v: int = 6) -> torch.Tensor:
    """[L, V] fp32 log-probs.  Mixes tie-heavy, continuous and distinct rows,
    optionally with masked (-inf) tokens (each row keeps one finite entry)."""
    n_depth = draw(st.integers(1, max_l))
    vocab = draw(st.integers(1, max_v))
    kind = draw(st.sampled_from(["ties", "float", "distinct"]))
    rows: list[list[float]] = []
    for _ in range(n_depth):
        if kind == "ties":
            row = [float(x) for x in draw(st.lists(st.integers(-2, 2), min_size=vocab, max_size=vocab))]
        elif kind == "float":
            row = draw(
                st.lists(
                    st.floats(-8.0, 8.0, allow_nan=False, allow_infinity=False, width=32),
                    min_size=vocab,
                    max_size=vocab,
                )
            )
        else:
            ints = draw(st.lists(st.integers(0, 10_000), min_size=vocab, max_size=vocab, unique=True))
            row = [x / 997.0 for x in ints]
        if vocab > 1 and draw(st.booleans()):
            keep = draw(st.integers(0, vocab - 1))
            masked = draw(st.sets(st.integers(0, vocab - 1), max_size=vocab - 1))
            row = [(-math.inf if (t in masked and t != keep) else x) for t, x in enumerate(row)]
        rows.append(row)
    lp = torch.log_softmax(torch.tensor(rows, dtype=torch.float32), dim=-1)
    # The builder clamps round-off above 0; do it here too so the oracle sees
    # exactly the values the builder uses.
    return lp.clamp(max=0.0)


@st.composite
def ddtree_cases(draw: st.DrawFn) -> tuple[int, torch.Tensor, int]:
    lp = draw(logprob_matrices())
    root = draw(st.integers(0, lp.shape[1] - 1))
    budget = draw(st.integers(0, 20))
    return root, lp, budget


# -------------------------------------------------------------------- oracle
def sorted_row(row: list[float]) -> tuple[list[float], list[int]]:
    """Row values/ids sorted by log-prob descending, ties -> lower id first."""
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))
    return [row[t] for t in order], order


def all_prefixes(lp: torch.Tensor, budget: int) -> list[tuple[tuple[int, ...], float]]:
    """Every rank path (r_1..r_d), 1 <= d <= L, r_j < K, with its score
    accumulated root-down in float64 (same order as the builder)."""
    n_depth, vocab = lp.shape
    k = min(budget, vocab)
    vals = [sorted_row(r)[0] for r in lp.tolist()]
    out: list[tuple[tuple[int, ...], float]] = []
    for d in range(1, n_depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = 0.0
            for j, r in enumerate(ranks):
                s = s + vals[j][r]
            out.append((ranks, s))
    return out


def top_prefix_oracle(lp: torch.Tensor, budget: int) -> list[tuple[tuple[int, ...], float]]:
    """Brute-force top-B prefixes in the builder's total order (-score, ranks)."""
    cands = all_prefixes(lp, budget)
    cands.sort(key=lambda c: (-c[1], c[0]))
    return cands[:budget]


def rank_path(tree: Tree, i: int) -> tuple[int, ...]:
    ranks = tree.ranks.tolist()
    return tuple(ranks[j] for j in tree.path(i)[1:])


def path_scores_f64(tree: Tree, lp: torch.Tensor) -> list[float]:
    """Recompute every node's score from lp by summing along its path."""
    rows = lp.tolist()
    tokens = tree.tokens.tolist()
    out = []
    for i in range(tree.num_nodes):
        s = 0.0
        for j in tree.path(i)[1:]:
            s = s + rows[tree.depths[j].item() - 1][tokens[j]]
        out.append(s)
    return out


# ---------------------------------------------------- DDTree vs brute force
@SETTINGS
@given(ddtree_cases())
def test_ddtree_equals_bruteforce_top_b_in_order(case: tuple[int, torch.Tensor, int]) -> None:
    root, lp, budget = case
    tree = build_ddtree(root, lp, budget)
    oracle = top_prefix_oracle(lp, budget)
    got = [rank_path(tree, i) for i in range(1, tree.num_nodes)]
    # Exact, tie-aware: same prefixes, same pop order.
    assert got == [p for p, _ in oracle]
    assert tree.scores[1:].tolist() == torch.tensor([s for _, s in oracle], dtype=torch.float32).tolist()
    # Tokens: token at (depth d, rank r) is the r-th best id of row d-1.
    ids = [sorted_row(r)[1] for r in lp.tolist()]
    for i in range(1, tree.num_nodes):
        d, r = tree.depths[i].item(), tree.ranks[i].item()
        assert tree.tokens[i].item() == ids[d - 1][r]


@SETTINGS
@given(ddtree_cases())
def test_ddtree_top_b_scores_tie_independent(case: tuple[int, torch.Tensor, int]) -> None:
    """Order-free check: the multiset of scores is the top-B multiset, and if
    there is no tie at the cut-off the prefix *set* is determined."""
    root, lp, budget = case
    tree = build_ddtree(root, lp, budget)
    cands = all_prefixes(lp, budget)
    by_score = sorted((s for _, s in cands), reverse=True)
    top = by_score[:budget]
    got = sorted((s for s in path_scores_f64(tree, lp)[1:]), reverse=True)
    assert got == top
    paths = {rank_path(tree, i) for i in range(1, tree.num_nodes)}
    if budget == 0:
        assert not paths
        return
    if len(by_score) > budget and by_score[budget - 1] == by_score[budget]:
        return  # tie at the cut-off: which tied prefixes make it is a tie-break matter
    assert paths == {p for p, s in cands if s >= top[-1]}


@SETTINGS
@given(logprob_matrices(), st.integers(0, 20))
def test_top_b_by_score_is_prefix_closed(lp: torch.Tensor, budget: int) -> None:
    """The fact the algorithm relies on: with lp <= 0, every prefix scores
    >= its extensions and precedes them in (-score, ranks) order, so the
    top-B set is prefix-closed (and sibling-closed towards rank 0)."""
    chosen = {p for p, _ in top_prefix_oracle(lp, budget)}
    for p in chosen:
        if len(p) > 1:
            assert p[:-1] in chosen
        if p[-1] > 0:
            assert p[:-1] + (p[-1] - 1,) in chosen


# ------------------------------------------------------ structural invariants
def naive_visibility(tree: Tree) -> torch.Tensor:
    n = tree.num_nodes
    vis = torch.zeros((n, n), dtype=torch.bool)
    parents = tree.parents.tolist()
    for i in range(n):
        j = i
        while j != -1:
            vis[i, j] = True
            j = parents[j]
    return vis


@SETTINGS
@given(ddtree_cases())
def test_ddtree_structural_invariants(case: tuple[int, torch.Tensor, int]) -> None:
    root, lp, budget = case
    tree = build_ddtree(root, lp, budget)
    tree.validate()
    n_depth, vocab = lp.shape
    k = min(budget, vocab)
    total = sum(k**d for d in range(1, n_depth + 1))
    assert tree.num_nodes == min(budget, total) + 1
    assert tree.num_drafted == tree.num_nodes - 1
    for t in (tree.tokens, tree.parents, tree.depths, tree.ranks):
        assert t.dtype == torch.int64 and t.shape == (tree.num_nodes,)
    assert tree.scores.dtype == torch.float32
    assert tree.tokens[0].item() == root
    assert tree.parents[0].item() == -1 and tree.depths[0].item() == 0
    assert tree.ranks[0].item() == 0 and tree.scores[0].item() == 0.0
    parents, depths, tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
    siblings: dict[int, list[int]] = {}
    for i in range(1, tree.num_nodes):
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1
        assert 1 <= depths[i] <= n_depth
        assert 0 <= tree.ranks[i].item() < k
        siblings.setdefault(parents[i], []).append(tokens[i])
    for toks in siblings.values():
        assert len(toks) == len(set(toks))
    assert tree.max_depth == max(depths)
    # visibility = ancestor-or-self
    assert torch.equal(tree.visibility(), naive_visibility(tree))
    # scores = path sums (fp64 recomputation rounded to fp32)
    assert tree.scores.tolist() == torch.tensor(path_scores_f64(tree, lp), dtype=torch.float32).tolist()
    # pop order non-increasing in score
    s = tree.scores.tolist()
    assert all(a >= b for a, b in zip(s[1:], s[2:]))
    assert not any(math.isnan(x) for x in s)
    # children() / path() agree with parents
    for i in range(tree.num_nodes):
        kids = tree.children(i)
        assert sorted(kids.values()) == [c for c in range(tree.num_nodes) if parents[c] == i]
        assert all(tokens[c] == tok for tok, c in kids.items())
        p = tree.path(i)
        assert p[0] == 0 and p[-1] == i and len(p) == depths[i] + 1
        assert all(parents[b] == a for a, b in zip(p, p[1:]))
        # generator closure: rank r>0 needs sibling r-1; a parent of anything has its rank-0 child
        r = tree.ranks[i].item()
        if i > 0 and r > 0:
            assert any(parents[c] == parents[i] and tree.ranks[c].item() == r - 1 for c in range(tree.num_nodes))
        if kids:
            assert any(tree.ranks[c].item() == 0 for c in kids.values())


def test_ddtree_hand_example() -> None:
    lp = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]))
    tree = build_ddtree(2, lp, 4)
    # scores: (0)=.6, (0,0)=.42, (1)=.3, (1,0)=.21, (0,1)=.12 -> first four
    assert tree.tokens.tolist() == [2, 0, 0, 1, 0]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3]
    assert tree.depths.tolist() == [0, 1, 2, 1, 2]
    assert tree.ranks.tolist() == [0, 0, 0, 1, 0]
    expected = [1.0, 0.6, 0.42, 0.3, 0.21]
    assert torch.allclose(tree.scores.exp(), torch.tensor(expected), atol=1e-6)
    assert tree.max_depth == 2


def test_ddtree_ties_prefer_lower_token_id() -> None:
    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), dim=-1)
    tree = build_ddtree(0, lp, 4)
    assert tree.tokens.tolist() == [0, 1, 2, 4, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 2, 3]
    # equal path scores -> lexicographically smaller rank path first
    lp2 = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    t2 = build_ddtree(0, lp2, 6)
    assert [rank_path(t2, i) for i in range(1, t2.num_nodes)] == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]


def test_ddtree_root_only_cases() -> None:
    lp = torch.log_softmax(torch.randn(3, 5), dim=-1)
    for tree in (build_ddtree(2, lp, 0), build_ddtree(2, torch.zeros(0, 5), 7)):
        assert tree.num_nodes == 1 and tree.num_drafted == 0 and tree.max_depth == 0
        assert tree.tokens.tolist() == [2] and tree.parents.tolist() == [-1]
        assert torch.equal(tree.visibility(), torch.ones(1, 1, dtype=torch.bool))
        assert tree.walk_greedy(torch.tensor([3])) == [0]


def test_ddtree_budget_exceeds_tree_size() -> None:
    lp = torch.log_softmax(torch.randn(2, 2), dim=-1)
    tree = build_ddtree(0, lp, 100)  # K = 2: 2 + 4 nodes
    assert tree.num_drafted == 6


def test_ddtree_masked_tokens_have_neg_inf_scores_not_nan() -> None:
    lp = torch.log_softmax(torch.tensor([[0.0, -math.inf, -math.inf], [1.0, 0.0, -math.inf]]), dim=-1)
    tree = build_ddtree(0, lp, 12)
    s = tree.scores.tolist()
    assert not any(math.isnan(x) for x in s)
    finite = [x for x in s if x > -math.inf]
    assert len(finite) == 1 + 1 + 2  # root, (0), (0,0), (0,1)
    assert s[: len(finite)] == finite  # finite nodes are popped first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_ddtree_casts_other_dtypes_to_fp32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 6, generator=gen), dim=-1).to(dtype)
    a = build_ddtree(1, lp, 9)
    b = build_ddtree(1, lp.to(torch.float32).clamp(max=0.0), 9)
    assert a.scores.dtype == torch.float32
    for f in ("tokens", "parents", "depths", "ranks", "scores"):
        assert torch.equal(getattr(a, f), getattr(b, f))


# ------------------------------------------------------------------ chain
@SETTINGS
@given(logprob_matrices(), st.data())
def test_chain_is_argmax_path(logits: torch.Tensor, data: st.DataObject) -> None:
    n_depth, vocab = logits.shape
    depth = data.draw(st.none() | st.integers(0, n_depth))
    root = data.draw(st.integers(0, vocab - 1))
    tree = build_chain(root, logits, depth)
    d = n_depth if depth is None else depth
    tree.validate()
    assert tree.num_nodes == d + 1 and tree.max_depth == d
    assert tree.parents.tolist() == list(range(-1, d))
    assert tree.depths.tolist() == list(range(d + 1))
    assert tree.ranks.tolist() == [0] * (d + 1)
    rows = logits.tolist()
    assert tree.tokens.tolist() == [root] + [sorted_row(rows[j])[1][0] for j in range(d)]
    lp = torch.log_softmax(logits.float(), dim=-1).clamp(max=0.0).tolist()
    acc, expect = 0.0, [0.0]
    for j in range(d):
        acc = acc + lp[j][tree.tokens[j + 1].item()]
        expect.append(acc)
    assert tree.scores.tolist() == torch.tensor(expect, dtype=torch.float32).tolist()
    # argmax of the target == the drafted token everywhere -> accept the whole chain
    target = torch.cat([tree.tokens[1:], torch.tensor([0])])
    assert tree.walk_greedy(target) == list(range(d + 1))


def test_chain_hand_example_and_ties() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0], [9.0, 1.0, 2.0], [0.0, 0.0, 3.0]])
    tree = build_chain(1, logits)
    assert tree.tokens.tolist() == [1, 1, 0, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert build_chain(0, logits, depth=1).tokens.tolist() == [0, 1]
    assert build_chain(0, logits, depth=0).num_nodes == 1


@SETTINGS
@given(logprob_matrices(max_v=1), st.integers(0, 20))
def test_chain_equals_ddtree_when_vocab_is_one(lp: torch.Tensor, budget: int) -> None:
    n_depth = lp.shape[0]
    a = build_ddtree(0, lp, budget)
    b = build_chain(0, lp, min(budget, n_depth))
    for f in ("tokens", "parents", "depths", "ranks", "scores"):
        assert torch.equal(getattr(a, f), getattr(b, f))


# ------------------------------------------------------------- walk_greedy
def hand_tree() -> Tree:
    #        0(5)
    #       /    \
    #    1(7)    2(3)
    #     |      /  \
    #   3(9)  4(9)  5(8)
    tree = Tree(
        tokens=torch.tensor([5, 7, 3, 9, 9, 8]),
        parents=torch.tensor([-1, 0, 0, 1, 2, 2]),
        depths=torch.tensor([0, 1, 1, 2, 2, 2]),
        ranks=torch.tensor([0, 0, 1, 0, 0, 1]),
        scores=torch.tensor([0.0, -0.5, -1.0, -1.2, -1.5, -2.5]),
    )
    tree.validate()
    return tree


def test_walk_greedy_hand_examples() -> None:
    tree = hand_tree()
    assert tree.children(0) == {7: 1, 3: 2}
    assert tree.children(2) == {9: 4, 8: 5}
    assert tree.children(5) == {}
    # accept the non-first sibling at both depths, then stop at a leaf
    assert tree.walk_greedy(torch.tensor([3, 0, 8, 0, 0, 1])) == [0, 2, 5]
    # first-sibling path, stop at leaf 3 whatever its argmax is
    assert tree.walk_greedy(torch.tensor([7, 9, 0, 5, 0, 0])) == [0, 1, 3]
    # mismatch at the root: only the root is accepted
    assert tree.walk_greedy(torch.tensor([4, 9, 9, 0, 0, 0])) == [0]
    # accept node 2, then mismatch: 7 is not a child token of node 2
    assert tree.walk_greedy(torch.tensor([3, 9, 7, 0, 0, 0])) == [0, 2]
    # argmax only consulted along the walked path
    assert tree.walk_greedy(torch.tensor([3, 9, 9, 0, 0, 0])) == [0, 2, 4]
    assert tree.path(5) == [0, 2, 5]
    assert tree.visibility().tolist()[5] == [True, False, True, False, False, True]


@SETTINGS
@given(ddtree_cases(), st.data())
def test_walk_greedy_property(case: tuple[int, torch.Tensor, int], data: st.DataObject) -> None:
    root, lp, budget = case
    tree = build_ddtree(root, lp, budget)
    vocab = lp.shape[1]
    target = torch.tensor(
        data.draw(st.lists(st.integers(0, vocab - 1), min_size=tree.num_nodes, max_size=tree.num_nodes)),
        dtype=torch.int64,
    )
    acc = tree.walk_greedy(target)
    assert acc == tree.path(acc[-1])
    for a, b in zip(acc, acc[1:]):
        assert tree.tokens[b].item() == target[a].item()
    assert target[acc[-1]].item() not in tree.children(acc[-1])


# -------------------------------------------------------------- bad inputs
def good_lp() -> torch.Tensor:
    return torch.log_softmax(torch.randn(3, 5), dim=-1)


@pytest.mark.parametrize(
    "args",
    [
        (0, good_lp(), -1),  # negative budget
        (0, good_lp(), 2.0),  # non-int budget
        (0, good_lp(), True),  # bool budget
        (0, good_lp()[0], 3),  # 1-D log-probs
        (0, good_lp()[None], 3),  # 3-D log-probs
        (0, good_lp().tolist(), 3),  # not a tensor
        (0, torch.zeros(3, 5, dtype=torch.int64), 3),  # integer dtype
        (0, torch.tensor([[0.0, math.nan], [0.0, -1.0]]), 3),  # NaN
        (0, torch.tensor([[math.inf, 0.0]]), 3),  # +inf
        (0, torch.tensor([[2.0, -1.0]]), 3),  # logits, not log-probs
        (5, good_lp(), 3),  # root out of range
        (-1, good_lp(), 3),  # root out of range
        (0, torch.zeros(2, 0), 3),  # empty vocab: no valid root
    ],
)
def test_build_ddtree_rejects_bad_input(args: tuple) -> None:
    with pytest.raises(TreeError):
        build_ddtree(*args)


def test_build_ddtree_nan_even_with_zero_budget() -> None:
    with pytest.raises(TreeError):
        build_ddtree(0, torch.tensor([[math.nan, 0.0]]), 0)


@pytest.mark.parametrize(
    "args",
    [
        (0, torch.randn(5), None),
        (0, torch.randn(3, 4), 4),  # depth > L
        (0, torch.randn(3, 4), -1),
        (4, torch.randn(3, 4), None),
        (0, torch.tensor([[math.nan, 0.0]]), None),
        (0, torch.tensor([[math.inf, 0.0]]), None),
        (0, torch.tensor([[-math.inf, -math.inf]]), None),
    ],
)
def test_build_chain_rejects_bad_input(args: tuple) -> None:
    with pytest.raises(TreeError):
        build_chain(*args)


def test_tree_error_is_value_error() -> None:
    assert issubclass(TreeError, ValueError)


def _mutated(**kw: torch.Tensor) -> Tree:
    base = hand_tree()
    fields = {f: getattr(base, f) for f in ("tokens", "parents", "depths", "ranks", "scores")}
    fields.update(kw)
    return Tree(**fields)


@pytest.mark.parametrize(
    "kw",
    [
        {"parents": torch.tensor([0, 0, 0, 1, 2, 2])},  # root parent != -1
        {"parents": torch.tensor([-1, 0, 0, 4, 2, 2])},  # parent after child
        {"depths": torch.tensor([0, 1, 1, 3, 2, 2])},  # depth != parent + 1
        {"tokens": torch.tensor([5, 7, 7, 9, 9, 8])},  # duplicate sibling tokens (+ rank clash)
        {"tokens": torch.tensor([5, 7, 3, 9, 9, 9]), "ranks": torch.tensor([0, 0, 1, 0, 0, 0])},  # dup siblings
        {"ranks": torch.tensor([0, 0, 1, 0, 1, 1])},  # depth-2 token 9 has two ranks
        {"scores": torch.tensor([0.0, -0.5, -1.0, -0.2, -1.5, -2.5])},  # child above parent
        {"scores": torch.tensor([0.1, -0.5, -1.0, -1.2, -1.5, -2.5])},  # root score != 0
        {"scores": torch.tensor([0.0, -0.5, math.nan, -1.2, -1.5, -2.5])},
        {"scores": torch.tensor([0.0, -0.5, -1.0, -1.2, -1.5, -2.5], dtype=torch.float64)},
        {"tokens": torch.tensor([5, 7, 3, 9, 9], dtype=torch.int64)},  # length mismatch
        {"tokens": torch.tensor([5, 7, 3, 9, 9, 8], dtype=torch.int32)},  # dtype
        {"tokens": torch.tensor([5, -7, 3, 9, 9, 8])},  # negative token
    ],
)
def test_validate_rejects_broken_trees(kw: dict[str, torch.Tensor]) -> None:
    with pytest.raises(TreeError):
        _mutated(**kw).validate()


def test_tree_methods_reject_bad_arguments() -> None:
    tree = hand_tree()
    for bad in (-1, 6):
        with pytest.raises(TreeError):
            tree.path(bad)
        with pytest.raises(TreeError):
            tree.children(bad)
    with pytest.raises(TreeError):
        tree.walk_greedy(torch.tensor([3, 0, 8]))  # wrong length
    with pytest.raises(TreeError):
        tree.walk_greedy(torch.zeros(6))  # float dtype
    with pytest.raises(TreeError):
        tree.walk_greedy(torch.zeros(6, 1, dtype=torch.int64))  # 2-D


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), st.integers(200, 3000), st.integers(1, 40), st.booleans(), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 0.5, 0.995]))
def test_large_vocab_top_k_equals_the_full_stable_sort(depths, vocab, k, ties, seed, masked):
    """The top-k prefilter used for large vocabularies keeps the full sort's entries and tie order,
    also when most of a row is masked to -inf (then the k-th value itself can be a -inf tie)."""
    from ddtree_reference.tree import _sorted_rows

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(depths, vocab, generator=g)
    if ties:  # coarse values: many equal log-probs, ties at the k-th value included
        x = (x * 2).round() / 2
    if masked:
        x = x.masked_fill(torch.rand(depths, vocab, generator=g) < masked, float("-inf"))
        x[:, 0] = 0.0  # every row keeps a finite entry
    lp = torch.log_softmax(x, -1)
    vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    assert _sorted_rows(lp, k) == (vals[:, :k].tolist(), ids[:, :k].tolist())
