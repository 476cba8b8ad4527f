"""refcheck.sglang.capture.long_product: the sketches' long, narrow float32 product cut along K gives the one
product's result to float32 rounding, whatever K's slices and remainder; and the state sketches through it."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang.capture import long_product as module
from refcheck.sglang.capture.long_product import long_product


def _cut(rows: torch.Tensor, proj: torch.Tensor, slice_: int) -> torch.Tensor:
    """long_product with its slices :data:`SLICE` set to ``slice_`` features."""
    with mock.patch.object(module, "SLICE", slice_):
        return long_product(rows, proj)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 700), r=st.integers(1, 9), slice_=st.integers(1, 300),
       seed=st.integers(0, 2**16))
def test_the_cut_product_is_the_whole_product(m, k, r, slice_, seed):
    g = torch.Generator().manual_seed(seed)
    rows, proj = torch.randn(m, k, generator=g), torch.randn(k, r, generator=g)
    got = _cut(rows, proj, slice_)
    want = rows.double() @ proj.double()
    assert got.shape == (m, r) and got.dtype == torch.float32
    # float32 sums of k terms of unit size: a few ulps of sqrt(k) apart whatever the order
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * (k ** 0.5) * 8)


def test_a_remainder_past_the_last_slice_is_counted():
    rows = torch.zeros(2, 10)
    rows[:, 9] = 1.0  # only the feature past the last whole slice of 4 (8 features) is nonzero
    proj = torch.arange(30, dtype=torch.float32).view(10, 3)
    assert torch.equal(_cut(rows, proj, 4), proj[9].expand(2, 3))
    rows[:, 9], rows[:, 0] = 0.0, 2.0  # the first slice's first feature alone
    assert torch.equal(_cut(rows, proj, 4), 2 * proj[0].expand(2, 3))


def test_fewer_than_two_slices_is_one_product():
    g = torch.Generator().manual_seed(3)
    rows, proj = torch.randn(4, 7, generator=g), torch.randn(7, 2, generator=g)
    assert torch.equal(_cut(rows, proj, 4), rows @ proj)
    assert torch.equal(_cut(rows, proj, 100), rows @ proj)
