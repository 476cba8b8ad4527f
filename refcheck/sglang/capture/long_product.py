"""A sketch's projection product, ``[M, K] @ [K, r]`` with K long and r narrow, cut along K.

Contract: :func:`long_product` returns ``rows @ proj`` for float32 ``rows`` ``[M, K]`` and ``proj`` ``[K, r]``, on
their device, with no host copy (it runs inside the engine's step and its CUDA graphs). A GPU runs a float32
product of this shape (K from tens of thousands to a million, M a few hundred (layer, request) rows, r the sketch
width) as a handful of thread blocks that each walk the whole of K. Cut into slices of :data:`SLICE` features,
the product becomes a batch of S small products over strided views of the same memory (no copy), summed: many
blocks at once. The sum runs in another order than one product's, so the two differ by float32 rounding alone.
"""

from __future__ import annotations

import torch

#: features per slice of K
SLICE = 4096


def long_product(rows: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[M, K]`` @ ``proj`` ``[K, r]`` -> ``[M, r]``, as S = K // :data:`SLICE` (read at call time) slice
    products summed (one product when K holds fewer than two slices); the features past the last whole slice as one
    more product."""
    slice_ = SLICE
    m, k = rows.shape
    r = proj.shape[-1]
    s = k // slice_
    if s < 2:
        return rows @ proj
    cut = s * slice_
    # [M, S*C] -> [M, S, C] -> [S, M, C] (strided views) @ [S*C, r] -> [S, C, r]: [S, M, r], summed over S
    out = torch.bmm(rows[:, :cut].reshape(m, s, slice_).transpose(0, 1), proj[:cut].reshape(s, slice_, r)).sum(0)
    if cut < k:
        out = out + rows[:, cut:] @ proj[cut:]
    return out
