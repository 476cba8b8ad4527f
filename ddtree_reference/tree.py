"""Reference construction of draft token trees for tree speculative decoding.

Contract
========

What it builds
--------------
* :func:`build_ddtree` -- the DDTree draft tree (Ringel & Romano, "DDTree",
  Algorithm 1).  Given per-depth draft log-probabilities ``lp`` of shape
  ``[L, V]`` (depth ``d = 1..L`` is row ``d - 1``) and a node budget ``B``, it
  returns the ``B`` highest-scoring *rank paths* ``(r_1, ..., r_d)``
  (``1 <= d <= L``, each ``r_j < K = min(B, V)``), where the score of a rank
  path is ``sum_j lp_sorted[j - 1][r_j]`` and ``lp_sorted[j - 1]`` is row
  ``j - 1`` sorted in descending order.  The node at rank path
  ``(r_1..r_d)`` carries token ``topk_ids[d - 1][r_d]``.
* :func:`build_chain` -- the vanilla DFlash linear draft: the top-1 token at
  every depth, chained root -> depth 1 -> ... -> depth ``depth``.

Conventions
-----------
* Node 0 is the root: the bonus token sampled at the previous verification
  step.  It is *not* drafted and is *not* counted by the budget.  Its depth,
  rank and score are 0 and its parent is -1.
* ``N = num_nodes = 1 + num_drafted``.  Nodes 1..N-1 of a DDTree appear in
  best-first pop order, so scores are non-increasing in node index.
* Per-depth token ranking is by log-prob descending; equal log-probs are
  ordered by *lower token id first* (a stable descending sort), so the tree
  is a deterministic function of the input values.
* Ties between equal path scores in the best-first heap are broken by the
  lexicographically smaller rank path, i.e. the heap key is
  ``(-score, rank_path)``.  Because a prefix is lexicographically smaller
  than its extensions and log-probs are <= 0, this total order is consistent
  with the tree structure: every node's generator (its parent, for
  ``r_d == 0``, or its previous sibling, for ``r_d > 0``) precedes it.  Hence
  the popped set is *exactly* the first ``B`` rank paths in that order, and
  it is prefix-closed.
* All arithmetic on log-probs is done on the fp32 values, accumulated from
  the root downwards as Python floats (IEEE double); the stored ``scores``
  are those sums rounded to fp32.  A node's score is computed as
  ``parent_score + lp`` (never by the equivalent "subtract the old sibling's
  log-prob, add the new one" update, which drifts in floating point and
  yields NaN on ``-inf`` log-probs).
* ``-inf`` log-probs (masked tokens) are accepted; such nodes get score
  ``-inf`` and are only drafted when nothing finite is left.  NaN, ``+inf``
  and clearly positive values (> ``LOGPROB_POS_TOL``, i.e. logits passed by
  mistake) are rejected; tiny positive round-off is clamped to 0.
* Output tensors always live on the CPU.

Invariants (checked by :meth:`Tree.validate`)
---------------------------------------------
* all fields are 1-D of the same length ``N >= 1``; ``tokens``, ``parents``,
  ``depths``, ``ranks`` are int64 and ``scores`` is float32;
* ``parents[0] == -1`` and ``0 <= parents[i] < i`` for ``i >= 1``;
* ``depths[0] == 0`` and ``depths[i] == depths[parents[i]] + 1``;
* ``ranks[0] == 0``, ``ranks >= 0``, ``tokens >= 0``;
* siblings carry distinct tokens;
* at a given depth, rank and token determine each other
  (``token == topk_ids[depth - 1][rank]``);
* ``scores[0] == 0``, no NaN / ``+inf`` score, and
  ``scores[i] <= scores[parents[i]]`` (log-probs are <= 0).
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass

import torch

__all__ = [
    "LOGPROB_POS_TOL",
    "Tree",
    "TreeError",
    "build_chain",
    "build_ddtree",
]

#: Largest positive value tolerated (then clamped to 0) in draft log-probs.
#: Anything above is treated as "these are logits, not log-probs".
LOGPROB_POS_TOL: float = 1e-4


class TreeError(ValueError):
    """Bad input to a tree builder, or a tree violating its invariants."""


@dataclass(frozen=True, slots=True, eq=False)
class Tree:
    """A draft token tree; node 0 is the root (see the module docstring).

    ``eq=False``: fields are tensors, whose ``==`` is elementwise, so the
    generated ``__eq__`` would raise; trees compare (and hash) by identity.
    """

    tokens: torch.Tensor  # [N] int64; tokens[0] is the root (bonus) token
    parents: torch.Tensor  # [N] int64; parents[0] == -1; parents[i] < i
    depths: torch.Tensor  # [N] int64; depths[0] == 0
    ranks: torch.Tensor  # [N] int64; rank of the token at its depth; root 0
    scores: torch.Tensor  # [N] float32; sum of draft log-probs on the path

    # ------------------------------------------------------------------ sizes
    @property
    def num_nodes(self) -> int:
        """``N``: number of nodes including the root."""
        return int(self.tokens.shape[0])

    @property
    def num_drafted(self) -> int:
        """``N - 1``: number of drafted (non-root) nodes."""
        return self.num_nodes - 1

    @property
    def max_depth(self) -> int:
        """Largest node depth (0 for a root-only tree)."""
        return int(self.depths.max().item())

    # -------------------------------------------------------------- structure
    def _check_index(self, i: int) -> int:
        try:
            idx = operator.index(i)
        except TypeError as exc:
            raise TreeError(f"node index must be an int, got {type(i).__name__}") from exc
        if not 0 <= idx < self.num_nodes:
            raise TreeError(f"node index {idx} out of range [0, {self.num_nodes})")
        return idx

    def visibility(self) -> torch.Tensor:
        """``[N, N]`` bool mask: ``vis[i, j]`` iff ``j`` is ancestor-or-self of ``i``."""
        n = self.num_nodes
        parents = self.parents.tolist()
        vis = torch.zeros((n, n), dtype=torch.bool)
        for i in range(n):
            p = parents[i]
            if p >= 0:
                vis[i] = vis[p]
            vis[i, i] = True
        return vis

    def path(self, i: int) -> list[int]:
        """Node indices from the root to node ``i`` inclusive."""
        idx = self._check_index(i)
        parents = self.parents.tolist()
        out = [idx]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        out.reverse()
        return out

    def children(self, i: int) -> dict[int, int]:
        """Map ``token -> child index`` for the children of node ``i``."""
        idx = self._check_index(i)
        return {
            tok: c
            for c, (p, tok) in enumerate(zip(self.parents.tolist(), self.tokens.tolist()))
            if p == idx
        }

    def _children_table(self) -> list[dict[int, int]]:
        table: list[dict[int, int]] = [{} for _ in range(self.num_nodes)]
        for c, (p, tok) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if p >= 0:
                table[p].setdefault(tok, c)  # duplicate siblings (engine trees): the first in index order wins, as in SGLang
        return table

    # ------------------------------------------------------------- validation
    def validate(self, structural_only: bool = False) -> None:
        """Raise :class:`TreeError` if any invariant of the module docstring fails.

        ``structural_only``: check only what any verify tree must satisfy (root first, parents
        precede children, depths consistent, tokens non-negative), not the DDTree rank/score and
        distinct-sibling rules: engine trees such as SGLang NGRAM's are not DDTree trees."""
        n = self._check_fields()
        tokens = self.tokens.tolist()
        parents = self.parents.tolist()
        depths = self.depths.tolist()
        ranks = self.ranks.tolist()
        scores = self.scores.tolist()
        _check_root_node(parents[0], depths[0], ranks[0], scores[0])
        ddtree = _DDTreeRules()
        for i in range(n):
            _check_node_values(i, tokens[i], ranks[i], scores[i])
            if i == 0:
                continue
            p, d = parents[i], depths[i]
            if not 0 <= p < i:
                raise TreeError(f"parents[{i}] = {p} must satisfy 0 <= parent < {i}")
            if d != depths[p] + 1:
                raise TreeError(f"depths[{i}] = {d} != depths[parent {p}] + 1 = {depths[p] + 1}")
            if not structural_only:
                ddtree.check(i, p, d, tokens[i], ranks[i], scores[i], scores[p])

    def _check_fields(self) -> int:
        """Check every field's type, shape, dtype and length; returns ``N``."""
        fields = {
            "tokens": (self.tokens, torch.int64),
            "parents": (self.parents, torch.int64),
            "depths": (self.depths, torch.int64),
            "ranks": (self.ranks, torch.int64),
            "scores": (self.scores, torch.float32),
        }
        for name, (t, dtype) in fields.items():
            if not isinstance(t, torch.Tensor):
                raise TreeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 1:
                raise TreeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
            if t.dtype != dtype:
                raise TreeError(f"{name} must be {dtype}, got {t.dtype}")
        n = int(self.tokens.shape[0])
        for name, (t, _) in fields.items():
            if int(t.shape[0]) != n:
                raise TreeError(f"{name} has length {t.shape[0]}, expected {n}")
        if n < 1:
            raise TreeError("a tree needs at least the root node")
        return n

    # ----------------------------------------------------------- verification
    def walk_greedy(self, target_argmax: torch.Tensor) -> list[int]:
        """Greedy acceptance walk.

        ``target_argmax[i]`` is the target model's argmax token at node ``i``
        (i.e. its prediction for the token *after* node ``i``).  Starting at
        the root, move to the child whose token equals the target's argmax
        while one exists.  Returns the accepted node indices, starting with 0.
        """
        if not isinstance(target_argmax, torch.Tensor):
            raise TreeError(
                f"target_argmax must be a torch.Tensor, got {type(target_argmax).__name__}"
            )
        if target_argmax.dim() != 1 or int(target_argmax.shape[0]) != self.num_nodes:
            raise TreeError(
                f"target_argmax must have shape [{self.num_nodes}], got {tuple(target_argmax.shape)}"
            )
        if target_argmax.dtype.is_floating_point or target_argmax.dtype.is_complex or (
            target_argmax.dtype == torch.bool
        ):
            raise TreeError(f"target_argmax must be an integer tensor, got {target_argmax.dtype}")
        want = target_argmax.tolist()
        table = self._children_table()
        accepted = [0]
        cur = 0
        while (nxt := table[cur].get(want[cur])) is not None:
            accepted.append(nxt)
            cur = nxt
        return accepted


# ----------------------------------------------------------------- invariants
def _check_root_node(parent: int, depth: int, rank: int, score: float) -> None:
    if parent != -1:
        raise TreeError(f"parents[0] must be -1, got {parent}")
    if depth != 0:
        raise TreeError(f"depths[0] must be 0, got {depth}")
    if rank != 0:
        raise TreeError(f"ranks[0] must be 0, got {rank}")
    if score != 0.0:
        raise TreeError(f"scores[0] must be 0.0, got {score}")


def _check_node_values(i: int, tok: int, r: int, s: float) -> None:
    if tok < 0:
        raise TreeError(f"tokens[{i}] = {tok} is negative")
    if r < 0:
        raise TreeError(f"ranks[{i}] = {r} is negative")
    if s != s or s == float("inf"):
        raise TreeError(f"scores[{i}] = {s} is NaN or +inf")


class _DDTreeRules:
    """The DDTree-only invariants, checked node by node in index order: siblings carry distinct tokens, rank
    and token determine each other at a given depth, and no score exceeds its parent's."""

    def __init__(self) -> None:
        self.rank_to_token: dict[tuple[int, int], int] = {}
        self.token_to_rank: dict[tuple[int, int], int] = {}
        self.sibling_tokens: set[tuple[int, int]] = set()

    def check(self, i: int, p: int, d: int, tok: int, r: int, s: float, parent_score: float) -> None:
        """Node ``i`` (parent ``p``, depth ``d``, token, rank, score) against the nodes checked before it."""
        if (p, tok) in self.sibling_tokens:
            raise TreeError(f"node {i} repeats token {tok} among the children of {p}")
        self.sibling_tokens.add((p, tok))
        if self.rank_to_token.setdefault((d, r), tok) != tok:
            raise TreeError(
                f"depth {d} rank {r} maps to tokens {self.rank_to_token[(d, r)]} and {tok}"
            )
        if self.token_to_rank.setdefault((d, tok), r) != r:
            raise TreeError(
                f"depth {d} token {tok} has ranks {self.token_to_rank[(d, tok)]} and {r}"
            )
        if s > parent_score:
            raise TreeError(
                f"scores[{i}] = {s} exceeds its parent's score {parent_score} "
                "(log-probs must be <= 0)"
            )


# --------------------------------------------------------------------- inputs
def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TreeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TreeError(f"{name} must be an int, got {type(value).__name__}") from exc


def _as_fp32_matrix(name: str, x: object) -> torch.Tensor:
    """Validate a ``[L, V]`` floating tensor and return it as float32 on its own device (the top-k
    selection runs there, so a GPU drafter's [L, V] rows never cross to the host whole)."""
    if not isinstance(x, torch.Tensor):
        raise TreeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise TreeError(f"{name} must be 2-D [L, V], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TreeError(f"{name} must be a floating tensor, got {x.dtype}")
    # Canonical precision: the contract is fp32 log-probs.  bf16/fp16 inputs
    # are upcast (exactly) and fp64 inputs rounded, so that the ranking, the
    # heap order and the stored fp32 scores are a function of one fixed set of
    # fp32 values no matter what dtype the caller's drafter produced.
    out = x.detach().to(dtype=torch.float32)
    has_nan, has_posinf = torch.stack([torch.isnan(out).any(), torch.isposinf(out).any()]).tolist()  # one host read
    if has_nan:
        raise TreeError(f"{name} contains NaN")
    if has_posinf:
        raise TreeError(f"{name} contains +inf")
    return out


def _check_root(root_token: object, vocab: int) -> int:
    root = _check_int("root_token", root_token)
    if not 0 <= root < vocab:
        raise TreeError(f"root_token {root} out of range [0, {vocab})")
    return root


def _sorted_rows(lp: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Top-``k`` per row, log-prob descending, ties -> lower token id first."""
    # torch.topk does not specify its order among equal values; a stable
    # descending sort keeps equal values in ascending token-id order.
    if 4 * k >= lp.shape[1]:
        vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
        return vals[:, :k].tolist(), ids[:, :k].tolist()
    # Large vocabularies: sorting every row whole costs ~250 ms at V = 248k. Only entries at least as
    # large as the row's k-th largest value can be among its first k (ties at that value included),
    # so sort just those, in ascending token-id order, stably: the same k entries in the same order.
    # One batch for all rows (a per-row loop read the device ~4 times a row: ~4 ms a tree on an H200).
    n_rows = lp.shape[0]
    kth = torch.topk(lp, k, dim=-1).values[:, -1:]  # [L, 1]
    rows, cols = torch.nonzero(lp >= kth, as_tuple=True)  # [c] each, row-major: rows, then ids, ascending
    v = lp[rows, cols]  # [c]
    order = torch.sort(v, descending=True, stable=True).indices  # value descending; equal values keep id order
    order = order[torch.sort(rows[order], stable=True).indices]  # grouped by row, each group still in that order
    counts = torch.bincount(rows, minlength=n_rows)  # [L], each >= k
    starts = torch.cumsum(counts, 0) - counts  # [L]
    take = order[starts[:, None] + torch.arange(k, device=lp.device)]  # [L, k]
    # float64 holds every fp32 value and every token id exactly: one host read for both
    vals, ids = torch.stack([v[take].double(), cols[take].double()]).tolist()
    return vals, [[int(i) for i in row] for row in ids]


def _make_tree(
    tokens: list[int], parents: list[int], depths: list[int], ranks: list[int], scores: list[float]
) -> Tree:
    tree = Tree(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor(depths, dtype=torch.int64),
        ranks=torch.tensor(ranks, dtype=torch.int64),
        scores=torch.tensor(scores, dtype=torch.float32),
    )
    tree.validate()
    return tree


# ------------------------------------------------------------------- builders
def build_ddtree(root_token: int, draft_logprobs: torch.Tensor, budget: int) -> Tree:
    """Build the DDTree draft tree (DDTree Algorithm 1, best-first).

    Args:
        root_token: the bonus token from the previous step, in ``[0, V)``.
        draft_logprobs: ``[L, V]`` log-softmax over the full vocabulary for
            depths ``1..L`` (row ``d - 1`` is depth ``d``).  Non-fp32 floating
            inputs are cast to fp32.
        budget: ``B >= 0``, the number of drafted (non-root) nodes.

    Returns:
        A tree with ``1 + min(B, sum_{d=1..L} K**d)`` nodes, ``K = min(B, V)``,
        whose nodes 1.. are in pop order (non-increasing score).

    Raises:
        TreeError: on a negative / non-int budget, a non-2-D or non-floating
            ``draft_logprobs``, NaN / +inf / positive log-probs, or a root
            token outside ``[0, V)``.
    """
    b = _check_int("budget", budget)
    if b < 0:
        raise TreeError(f"budget must be >= 0, got {b}")
    lp = _as_fp32_matrix("draft_logprobs", draft_logprobs)
    n_depth, vocab = int(lp.shape[0]), int(lp.shape[1])
    root = _check_root(root_token, vocab)
    lp = _clamp_logprobs(lp)
    k = min(b, vocab)
    if k == 0 or n_depth == 0:
        return _make_tree([root], [-1], [0], [0], [0.0])
    return _best_first(root, lp, k, b)


def _clamp_logprobs(lp: torch.Tensor) -> torch.Tensor:
    """Reject logits passed as log-probs; clamp the round-off above 0."""
    max_val = float(lp.max()) if lp.numel() else 0.0
    if max_val > LOGPROB_POS_TOL:
        raise TreeError(
            f"draft_logprobs has a positive value {max_val} (> {LOGPROB_POS_TOL}); "
            "expected log-probs (log_softmax), not logits"
        )
    # Round-off can leave log_softmax outputs a hair above 0; clamp so that a
    # child's score never exceeds its parent's (the top-B proof needs lp <= 0).
    return lp.clamp(max=0.0)


def _best_first(root: int, lp: torch.Tensor, k: int, budget: int) -> Tree:
    """Pop the ``budget`` best rank paths over the per-depth top-``k`` of ``lp`` [L, V] (DDTree Algorithm 1)."""
    n_depth = int(lp.shape[0])
    tokens, parents, depths, ranks, scores = [root], [-1], [0], [0], [0.0]
    vals, ids = _sorted_rows(lp, k)
    # Heap entry: (-score, rank_path, parent_index, parent_score).  rank_path
    # is unique per candidate, so the trailing fields are never compared.
    heap: list[tuple[float, tuple[int, ...], int, float]] = [(-vals[0][0], (0,), 0, 0.0)]
    while heap and len(tokens) - 1 < budget:
        neg_score, rank_path, parent, parent_score = heapq.heappop(heap)
        score = -neg_score
        depth = len(rank_path)
        rank = rank_path[-1]
        idx = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(score)
        # (a) next sibling: same parent, next-ranked token at this depth.
        if rank + 1 < k:
            sib_score = parent_score + vals[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib_score, rank_path[:-1] + (rank + 1,), parent, parent_score))
        # (b) first child: best token at the next depth, under the popped node.
        if depth + 1 <= n_depth:
            child_score = score + vals[depth][0]
            heapq.heappush(heap, (-child_score, rank_path + (0,), idx, score))
    return _make_tree(tokens, parents, depths, ranks, scores)


def build_chain(root_token: int, draft_logits: torch.Tensor, depth: int | None = None) -> Tree:
    """Build the linear (vanilla DFlash) draft: the top-1 token at each depth.

    Args:
        root_token: the bonus token from the previous step, in ``[0, V)``.
        draft_logits: ``[L, V]`` draft logits for depths ``1..L`` (any
            floating dtype; log-softmaxed in fp32 for the scores).
        depth: number of drafted nodes, ``0 <= depth <= L``; defaults to ``L``.

    Returns:
        A tree with ``depth + 1`` nodes, ``parents[i] == i - 1``, all ranks 0,
        tokens the per-depth argmax (ties -> lower token id).

    Raises:
        TreeError: on a non-2-D / non-floating / NaN / +inf ``draft_logits``,
            a depth outside ``[0, L]``, or a root token outside ``[0, V)``.
    """
    logits = _as_fp32_matrix("draft_logits", draft_logits).cpu()  # the log-softmax below rounds on the CPU, whatever device the logits are on
    n_depth, vocab = int(logits.shape[0]), int(logits.shape[1])
    root = _check_root(root_token, vocab)
    d = n_depth if depth is None else _check_int("depth", depth)
    if not 0 <= d <= n_depth:
        raise TreeError(f"depth must be in [0, {n_depth}], got {d}")
    if d > 0 and bool(torch.isneginf(logits[:d]).all(dim=-1).any()):
        raise TreeError("draft_logits has a row that is entirely -inf")

    lp = torch.log_softmax(logits[:d], dim=-1).clamp(max=0.0)
    vals, ids = _sorted_rows(lp, 1)
    tokens, parents, depths, ranks, scores = [root], [-1], [0], [0], [0.0]
    score = 0.0
    for j in range(d):
        score = score + vals[j][0]
        tokens.append(ids[j][0])
        parents.append(j)
        depths.append(j + 1)
        ranks.append(0)
        scores.append(score)
    return _make_tree(tokens, parents, depths, ranks, scores)
