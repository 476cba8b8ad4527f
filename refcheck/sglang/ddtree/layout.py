"""DDTree trees in the layout SGLang's tree verify reads (pure functions).

Contract: SGLang's NGRAM path takes, per request, ``N`` draft tokens (node 0 the root, i.e. the
last emitted token) and an ``N x N`` boolean mask whose row ``i`` marks node ``i`` and its
ancestors; ``reconstruct_indices_from_tree_mask`` then derives positions and first-child /
next-sibling links, taking each node's parent to be its largest-index ancestor, which holds for any
tree whose parents precede their children (DDTree's pop order). :func:`batch_layout` concatenates
requests: drafts ``[bs*N]`` int64 and the mask flattened ``[bs*N*N]``, as ``NgramCorpus.batch_get``
returns them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TreeLayoutError(ValueError):
    """A tree that SGLang's tree verify cannot take as given."""


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[N] parents (parents[0] = -1, parents[i] < i) -> [N, N] bool, row i = i and its ancestors."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        p = int(parents[i])
        if i == 0:
            if p != -1:
                raise TreeLayoutError(f"node 0 must be the root (parent -1), got parent {p}")
        elif not 0 <= p < i:
            raise TreeLayoutError(f"parents[{i}] = {p}: parents must precede their children")
        else:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def batch_layout(trees: Sequence[tuple[Sequence[int], Sequence[int]]], nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, parents) per request, each exactly ``nodes`` long -> (drafts [bs*N], mask [bs*N*N])."""
    drafts, masks = [], []
    for b, (tokens, parents) in enumerate(trees):
        if len(tokens) != nodes or len(parents) != nodes:
            raise TreeLayoutError(f"request {b}: a tree of {len(tokens)} nodes, the engine verifies {nodes} "
                                  "(budget + 1; a vocabulary smaller than the budget cannot fill the tree)")
        drafts.append(np.asarray(tokens, dtype=np.int64))
        masks.append(ancestor_mask(parents).reshape(-1))
    return np.concatenate(drafts), np.concatenate(masks)
