"""The children-first tree sampler: a lossless rule for drawing a tree walk from the target alone.

Contract
========

This is the rule SGLang's ``tree_speculative_sampling_target_only`` kernel implements (NGRAM, and
EAGLE-family trees at temperature > 0, with its accept thresholds at their default 1), restated
here so that a trace of the engine's own random numbers can be replayed exactly:

* At a node with sampling distribution ``q`` (:func:`ddtree_reference.sampling.tempered_probs` of its
  logits) and its own uniform ``u``, the node's children are tried in sibling order (increasing node
  index: SGLang's ``reconstruct_indices_from_tree_mask`` links each child to the next one with a
  higher index) with a running sum ``S_j = q[c_1] + ... + q[c_j]``; the first child with ``u <= S_j``
  is accepted and the walk moves to it, with that child's own uniform.
* When ``u`` exceeds the sum over every child (or the node has none), the walk stops there and the
  bonus is drawn with the step's *residual* uniform ``r`` from ``q`` with the rejected children's
  tokens removed (``relu(q - p)`` where ``p`` holds ``q`` at the rejected tokens): the first token,
  in token-id order, whose cumulative residual mass exceeds ``r`` times the residual total.

So at each node the token that comes out is an inverse-CDF draw from ``q`` over the order "children
first, then every other token": lossless, with one uniform per node and one per step. (The kernel
accepts when ``u <= S_j`` and the inverse CDF takes "first cumulative sum > u*total"; the two differ
only when a uniform equals an edge exactly.)

:func:`draw` gives the token a node produces under the rule; :func:`outside` how far (in units of
probability mass) the node's uniforms lie from the region that produces a given token (0 inside it,
``inf`` where no uniform produces it); :func:`walk` the accepted nodes and the bonus of a whole
tree. All three are pure torch / float64, CPU only.
"""

from __future__ import annotations

import math

import torch

from ddtree_reference.sampling import boundary_margin, inverse_cdf

__all__ = ["bonus", "draw", "outside", "residual", "walk"]


def _prefix(q: torch.Tensor, children: list[int]) -> list[float]:
    """Running sums of ``q`` ``[V]`` over the children's tokens, in sibling order."""
    out, acc = [], 0.0
    for t in children:
        acc += float(q[t])
        out.append(acc)
    return out


def residual(q: torch.Tensor, children: list[int]) -> torch.Tensor:
    """``q`` ``[V]`` with the (rejected) children's tokens removed, unnormalised: ``[V]`` float64."""
    r = q.to(torch.float64).clone()  # float64: the same arithmetic as tempered_probs
    if children:
        r[torch.tensor(children, dtype=torch.long)] = 0.0
    return r


def bonus(q: torch.Tensor, children: list[int], residual_u: float) -> int:
    """The bonus at a node whose children were all rejected: the inverse CDF of ``residual_u`` under
    :func:`residual` (when every token of the support is a child, the last child: the edge a rounding crossed)."""
    r = residual(q, children)[None]  # [1, V]
    if float(r.sum()) <= 0:
        return int(children[-1])
    return int(inverse_cdf(r, torch.tensor([residual_u], dtype=torch.float64))[0])


def draw(q: torch.Tensor, children: list[int], u: float, residual_u: float) -> int:
    """The token a node with distribution ``q`` ``[V]`` and child tokens ``children`` (sibling order)
    produces with its uniform ``u`` (and, when every child is rejected, the step's ``residual_u``)."""
    for t, s in zip(children, _prefix(q, children)):
        if u <= s:
            return int(t)
    return bonus(q, children, residual_u)


def outside(q: torch.Tensor, children: list[int], u: float, residual_u: float, token: int) -> float:
    """How far the node's uniforms lie from producing ``token`` (probability-mass units; 0 when they do,
    ``inf`` when no uniforms could): for a child, ``u``'s distance from its running-sum interval; for another
    token, the larger of ``u``'s distance past the children's sum and ``residual_u``'s (scaled by the residual
    total) from the token's interval of the residual distribution."""
    sums = _prefix(q, children)
    if token in children:
        j = children.index(token)  # the first sibling with this token is the one that can be accepted
        lo, hi = (sums[j - 1] if j else 0.0), sums[j]
        if hi <= lo:
            return math.inf
        return max(lo - u, u - hi, 0.0)
    r = residual(q, children)[None]  # [1, V]
    if float(r[0, token]) <= 0:
        return math.inf
    first = max((sums[-1] if sums else 0.0) - u, 0.0)
    rest = -float(boundary_margin(r, torch.tensor([residual_u], dtype=torch.float64), torch.tensor([token]))[0])
    return max(first, rest, 0.0)


def walk(probs: torch.Tensor, tokens: list[int], children: list[list[int]], coins: list[float],
         residual_u: float) -> tuple[list[int], int]:
    """The accepted nodes (root first) and the bonus of a tree: ``probs`` ``[N, V]`` at every node,
    ``tokens`` ``[N]``, ``children[i]`` node i's child nodes in sibling order, ``coins`` ``[N]``."""
    path, cur = [0], 0
    while True:
        kids = children[cur]
        tok = draw(probs[cur], [tokens[c] for c in kids], coins[cur], residual_u)
        nxt = next((c for c in kids if tokens[c] == tok), None)
        if nxt is None:
            return path, tok
        path.append(nxt)
        cur = nxt
