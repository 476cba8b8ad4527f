"""The GDN kernel-replay harness (refcheck/sglang/capture/gdn_replay.py) on CPU, with PyTorch kernels:
its inputs are the reference layer's own, exact kernels replay clean, and kernels with a tree bug are
caught at exactly the nodes the bug touches. SGLang's kernels themselves run only on a GPU
(scripts/sglang_gdn_replay.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.errors import UsageError
from refcheck.goldens import REPO_GOLDEN
from refcheck.pool import ReferencePool, reference_spec_for
from refcheck.sglang.capture.gdn_replay import ReferenceKernels, gdn_inputs, parents_from_links, replay, tree_links
from refcheck.trace.io import read_trace


@pytest.fixture(scope="module")
def b64():
    trace = read_trace(REPO_GOLDEN / "sglang-hybrid-ddtree-b64.arrow")
    return trace, ReferencePool().runner(reference_spec_for(trace)).target


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=40))
def test_tree_links_round_trip_and_follow_index_order(draws):
    parents = [-1] + [d % i for i, d in enumerate(draws, start=1)]  # node i hangs below an earlier node
    nt, ns = tree_links(torch.tensor(parents))
    assert parents_from_links(nt, ns).tolist() == parents
    for i, c in enumerate(nt.tolist()):  # first child: the smallest child index; siblings ascend
        kids = [j for j, p in enumerate(parents) if p == i]
        assert c == (kids[0] if kids else -1)
        chain = []
        while c != -1:
            chain.append(c)
            c = int(ns[c])
        assert chain == kids


def test_the_inputs_are_the_reference_layer_s_own(b64):
    """The harness's core output, through the layer's gated norm and out-projection, is the reference
    mixer's output; and exact kernels replay every node clean."""
    from ddtree_reference.layers import TreePlan, deltanet_tree

    trace, target = b64
    (inp,) = gdn_inputs(trace, "code-1", 13, target, [0])
    assert inp.nodes == 65 and inp.conv_out.shape == inp.mixed_qkv.shape
    gdn = target.layers[0].linear_attn
    s = [x for x in trace.steps_of("code-1") if x.step == 13][0]
    x = target.layers[0].input_layernorm(target.body.embed_tokens(torch.tensor(s.tree_tokens)))
    from ddtree_reference.layers import gdn_projections

    hv, dv = inp.core.shape[1], inp.core.shape[2]
    with torch.no_grad():
        _, z, _, _ = gdn_projections(gdn, x)
        mine = gdn.out_proj(gdn.norm(inp.core.reshape(-1, dv), z.reshape(-1, dv)).reshape(inp.nodes, hv * dv))
        want = deltanet_tree(gdn, x, inp.parents, inp.conv_state, inp.recurrent_state, method="chunk",
                             plan=TreePlan.build(inp.parents, need_levels=False)).hidden
    assert float((mine - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    res = replay(inp, ReferenceKernels())
    assert max(res.conv_rel) < 1e-6 and max(res.core_rel) < 1e-6 and res.parents_agree


class _FlatConv(ReferenceKernels):
    """A conv kernel with the flattened-tree bug: every node's window is the flat order before it."""

    def conv(self, inp, next_token, next_sibling):
        flat = torch.arange(-1, inp.nodes - 1)
        nt, ns = tree_links(flat)
        out, _ = super().conv(inp, nt, ns)
        return out, flat


class _StaleRecurrence(ReferenceKernels):
    """A recurrence that starts node 32 from the committed state instead of its parent's."""

    def recurrent(self, inp, q, k, v, parents):
        wrong = parents.clone()
        wrong[32] = -1
        return super().recurrent(inp, q, k, v, wrong)


def test_kernel_bugs_are_caught_at_the_nodes_they_touch(b64):
    trace, target = b64
    (inp,) = gdn_inputs(trace, "code-1", 13, target, [0])
    res = replay(inp, _FlatConv())
    flat_ok = {i for i in range(inp.nodes) if all(int(inp.parents[j]) == j - 1 for j in range(max(1, i - 2), i + 1))}
    bad = {i for i, e in enumerate(res.conv_rel) if e > 1e-3}
    assert bad and bad.isdisjoint(flat_ok) and not res.parents_agree
    assert max(res.core_rel) < 1e-6  # the recurrence ran on the reference's conv output: not blamed
    res = replay(inp, _StaleRecurrence())
    assert [i for i, e in enumerate(res.core_rel) if e > 1e-3] == [32] and max(res.conv_rel) < 1e-6


def test_bad_layer_and_step_are_usage_errors(b64):
    trace, target = b64
    with pytest.raises(UsageError, match="not a Gated DeltaNet layer"):
        gdn_inputs(trace, "code-1", 13, target, [0, 2])
    with pytest.raises(UsageError, match="no step 999"):
        gdn_inputs(trace, "code-1", 999, target, [0])
