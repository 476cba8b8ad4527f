"""SGLang <-> refcheck conversions: tree links, accept indices, state layouts, tensor-parallel gather."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from refcheck.sglang.layout import (
    accepted_from_accept_index,
    conv_to_reference,
    depths_from_parents,
    gather_conv_channels,
    gather_heads,
    kv_to_reference,
    links_from_parents,
    parents_from_links,
    shard_conv_channels,
    ssm_to_reference,
)

from strategies import rooted_parents  # tests/strategies.py


def test_worked_example_from_sglang_source():
    # 0 -> {1, 2}, 1 -> 3 (the comment above SGLang's _causal_conv1d_update_kernel)
    nt, ns = [1, 3, -1, -1], [-1, 2, -1, -1]
    assert parents_from_links(nt, ns) == [-1, 0, 0, 1]
    assert links_from_parents([-1, 0, 0, 1]) == (nt, ns)
    assert depths_from_parents([-1, 0, 0, 1]) == [0, 1, 1, 2]
    assert accepted_from_accept_index([8, 10, -1, -1], batch_row=2, n=4) == [0, 2]


@settings(max_examples=60, deadline=None)
@given(rooted_parents())
def test_links_round_trip(parents):
    nt, ns = links_from_parents(parents)
    assert parents_from_links(nt, ns) == parents
    for p in range(len(parents)):  # first child is the smallest-index child
        kids = [i for i, q in enumerate(parents) if q == p]
        assert nt[p] == (kids[0] if kids else -1)


def test_malformed_links_raise():
    with pytest.raises(ValueError):
        parents_from_links([2, -1, -1], [-1, -1, 1])  # node 1 only reachable backwards
    with pytest.raises(ValueError):
        parents_from_links([1, -1, -1], [-1, -1, -1])  # node 2 unreachable
    with pytest.raises(ValueError):
        accepted_from_accept_index([0, 5], batch_row=0, n=4)


def test_layouts_match_the_reference(hybrid):
    target, _ = hybrid
    state, _ = target.prefill(torch.arange(3, 20))
    layer = next(i for i in range(len(target.layers)) if target.is_linear(i))
    rec, conv = state.recurrent[layer], state.conv[layer]  # [HV, K, V], [K-1, C]
    assert torch.equal(ssm_to_reference(rec.transpose(-1, -2).contiguous()), rec)
    assert torch.equal(conv_to_reference(conv.T.contiguous()), conv)
    attn = next(i for i in range(len(target.layers)) if not target.is_linear(i))
    k = state.keys[attn]  # [Hkv, P, D]
    pool = torch.zeros(64, k.shape[0], k.shape[2])
    slots = torch.randperm(64)[: k.shape[1]]  # a request's token slots, scattered in the pool
    pool[slots] = k.transpose(0, 1)
    assert torch.equal(kv_to_reference(pool, slots), k)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_gather(tp):
    key_dim, value_dim, km1 = 64, 128, 3
    full = torch.randn(2 * key_dim + value_dim, km1)  # conv state [conv_dim, K-1]
    shards = shard_conv_channels(full, key_dim, value_dim, tp)
    assert all(s.shape[0] == full.shape[0] // tp for s in shards)
    assert torch.equal(gather_conv_channels(shards, key_dim, value_dim), full)
    ssm = torch.randn(8, 16, 16)  # [HV, V, K]
    assert torch.equal(gather_heads(list(ssm.chunk(tp, 0)), 0), ssm)
