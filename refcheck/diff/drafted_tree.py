"""The tree an engine's own drafts give: rebuilt from its recorded draft top-k and held against the tree it verified.

Contract: :func:`rebuild` runs the engine's drafting rule (``ddtree`` at a budget, or ``chain``: the top-1
token per depth, ties to the lower token id) on the engine's recorded draft top-k (``ids`` / ``logprobs``
``[L][k]``; the tokens outside the recorded top-k read as impossible). It returns ``None`` where the recorded
top-k cannot decide the tree: a DDTree that pops a node of the last recorded rank (the next rank, which
was not recorded, could have been popped after it), or NaN / +inf scores, which no rule orders (the draft check
fails them). :func:`compare` holds two trees as sets of root paths
(token sequences), so a node order of the engine's own (SGLang's tree layout) does not matter, and returns
``None`` when they are the same tree, else a :class:`TreeDifference` naming the first path each has that
the other lacks and the score margin between them under the engine's own draft log-probs: under
:data:`TIE_MARGIN` the two paths tie within float32 rounding of a path score (the builder's order among
equal scores is the engine's own choice), beyond it the engine's tree is not what its drafts give.
Nothing here reads a trace file or a runner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree_reference.tree import Tree, build_chain, build_ddtree

#: path-score margin (nats) under which two paths tie: float32 rounding of a sum of up to 64 log-probs
TIE_MARGIN = 1e-4


@dataclass(frozen=True, slots=True)
class TreeDifference:
    engine_only: tuple[int, ...]  # a root path (tokens below the root) in the engine's tree, not in the rebuilt one
    rebuilt_only: tuple[int, ...]  # ... and one in the rebuilt tree, not in the engine's
    margin: float  # |score(engine_only) - score(rebuilt_only)| under the engine's draft log-probs (inf: outside top-k)

    @property
    def near_tie(self) -> bool:
        return self.margin <= TIE_MARGIN

    def describe(self) -> str:
        return (f"the engine's tree has path {list(self.engine_only)} where its own drafts give {list(self.rebuilt_only)}"
                f" (score margin {self.margin:.3g})")


def _dense(ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], vocab: int) -> torch.Tensor:
    """[L, V] float32 log-probs: the recorded top-k, -inf elsewhere."""
    lp = torch.full((len(ids), vocab), -math.inf, dtype=torch.float32)
    if ids:
        lp.scatter_(1, torch.tensor(ids, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32))
    return lp


def rebuild(rule: str, root: int, ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], vocab: int,
            budget: int | None) -> Tree | None:
    """The tree ``rule`` (``ddtree`` / ``chain``: one node per recorded depth) builds from the recorded draft; None
    when undecidable (module docstring)."""
    lp = _dense(ids, logprobs, vocab)
    if bool((lp.isnan() | (lp == math.inf)).any()):
        return None
    if rule == "chain":
        return build_chain(root, lp)
    if rule != "ddtree" or budget is None:
        raise ValueError(f"no tree rule {rule!r} at budget {budget}")
    tree = build_ddtree(root, lp, budget)
    k = min((len(r) for r in ids), default=0)
    if k < min(budget, vocab) and tree.num_nodes > 1 and int(tree.ranks[1:].max()) >= k - 1:
        return None
    if tree.num_nodes > 1 and not bool(torch.isfinite(tree.scores).all()):
        return None  # a node outside every recorded top-k was needed to fill the budget
    return tree


def paths(tokens: Sequence[int], parents: Sequence[int]) -> dict[tuple[int, ...], int]:
    """Root path (tokens below the root) -> node index, for every node but the root."""
    out: dict[tuple[int, ...], int] = {}
    memo: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, len(tokens)):
        memo[i] = memo[int(parents[i])] + (int(tokens[i]),)
        out[memo[i]] = i
    return out


def path_score(path: tuple[int, ...], ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]) -> float:
    """Sum of the recorded draft log-probs along ``path`` (-inf where a token is outside its depth's top-k)."""
    total = 0.0
    for d, tok in enumerate(path):
        if d >= len(ids) or tok not in ids[d]:
            return -math.inf
        total += float(logprobs[d][list(ids[d]).index(tok)])
    return total


def compare(tokens: Sequence[int], parents: Sequence[int], rebuilt: Tree, ids: Sequence[Sequence[int]],
            logprobs: Sequence[Sequence[float]]) -> TreeDifference | None:
    """The engine's tree (``tokens``, ``parents``) against ``rebuilt``; None when they are the same tree."""
    mine, want = paths(tokens, parents), paths(rebuilt.tokens.tolist(), rebuilt.parents.tolist())
    if int(tokens[0]) != int(rebuilt.tokens[0]):
        return TreeDifference((), (), math.inf)
    extra = sorted(set(mine) - set(want), key=lambda p: (len(p), mine[p]))  # shallowest first: where they part
    missing = sorted(set(want) - set(mine), key=lambda p: (len(p), want[p]))
    if not extra and not missing:
        return None
    if not extra or not missing:  # one tree holds the other: a different size, not a different choice
        return TreeDifference(extra[0] if extra else (), missing[0] if missing else (), math.inf)
    a, b = extra[0], missing[0]
    sa, sb = path_score(a, ids, logprobs), path_score(b, ids, logprobs)
    margin = abs(sa - sb) if math.isfinite(sa) and math.isfinite(sb) else math.inf
    return TreeDifference(a, b, margin)
