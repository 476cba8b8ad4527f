"""ddtree_reference/fused.py: one GEMM per group of projections, the weights held once, the eager path untouched."""

from __future__ import annotations

import copy

import torch

from ddtree_reference.fused import ATTENTION, GATED_DELTANET, MLP, fuse_block, fuse_layer, project


def _model(hybrid):
    return copy.deepcopy(hybrid[0].model)  # compile-style fusion re-points weights: never the session's model


def test_fusing_a_layer_holds_each_weight_once_and_projects_what_the_modules_did(hybrid):
    model = _model(hybrid)
    layers = list(model.model.layers)
    for layer in layers:
        linear = getattr(layer, "linear_attn", None) is not None
        block = layer.linear_attn if linear else layer.self_attn
        names = GATED_DELTANET if linear else ATTENTION
        x = torch.randn(5, model.config.hidden_size)
        with torch.no_grad():
            before = [getattr(block, n)(x) for n in names]
            before_mlp = [getattr(layer.mlp, n)(x) for n in MLP]
        fusion = fuse_layer(layer)
        assert fusion.mixer is not None and fusion.mlp is not None
        for owner, group, fused in ((block, names, fusion.mixer), (layer.mlp, MLP, fusion.mlp)):
            start = 0
            for name in group:  # each module's weight is a view of its rows of the fused tensor
                w = getattr(owner, name).weight
                assert w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                assert torch.equal(w, fused[start : start + w.shape[0]])
                start += w.shape[0]
            assert start == fused.shape[0]
        with torch.no_grad():
            after = project(block, x, names, fusion.mixer)
            after_mlp = project(layer.mlp, x, MLP, fusion.mlp)
            unfused = project(block, x, names)  # no fused weight given: the modules, one by one
        for got, want, own in zip(list(after) + list(after_mlp), before + before_mlp, list(unfused) + [None, None]):
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            if own is not None:
                assert torch.equal(own, want)  # the modules compute exactly what they did


def test_a_group_with_a_bias_or_a_missing_member_is_not_fused():
    block = torch.nn.Module()
    block.q_proj = torch.nn.Linear(8, 8, bias=False)
    block.k_proj = torch.nn.Linear(8, 4, bias=True)
    block.v_proj = torch.nn.Linear(8, 4, bias=False)
    weight = block.k_proj.weight
    assert fuse_block(block, ATTENTION) is None
    assert block.k_proj.weight is weight  # untouched
    del block.v_proj
    block.k_proj = torch.nn.Linear(8, 4, bias=False)
    assert fuse_block(block, ATTENTION) is None
    assert fuse_block(None, ATTENTION) is None


def test_a_target_sharing_the_model_computes_bit_for_bit_what_it_did_after_another_fuses(hybrid):
    from ddtree_reference.target import Target

    eager_model = _model(hybrid)
    plain = Target(eager_model)
    ids = torch.arange(3, 20)
    _, before = plain.prefill(ids)
    other = Target(eager_model)
    other.fusions = [fuse_layer(layer) for layer in other.layers]  # what compile() does, without Inductor
    _, after = plain.prefill(ids)
    assert torch.equal(before.logits, after.logits)
    _, fused = other.prefill(ids)  # the fused GEMMs: equal to float rounding
    assert torch.allclose(fused.logits, before.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused.logits.argmax(-1), before.logits.argmax(-1))


def test_releasing_another_ranks_layers_drops_their_fused_weights(hybrid):
    """A layer-sharded target that moves other ranks' layers to the meta device drops their fused weights too
    (the modules' weights are views of them: kept, they would hold the layer's memory), and keeps its own."""
    from ddtree_reference.fused import UNFUSED
    from ddtree_reference.sharded import PipelineTarget
    from ddtree_reference.target import Target

    target = Target(_model(hybrid))
    target.fusions = [fuse_layer(layer) for layer in target.layers]
    rank = PipelineTarget.__new__(PipelineTarget)  # the rank's view of the target, without a process group
    rank.__dict__.update(target.__dict__)
    rank.mine = range(0, 3)
    rank.release_foreign_layers()
    assert all(f is not UNFUSED and f.mixer is not None for f in rank.fusions[:3])
    assert all(f is UNFUSED for f in rank.fusions[3:])
    assert all(f is not UNFUSED for f in target.fusions)  # the wrapped target's list is its own
    assert all(p.device.type == "meta" for layer in rank.layers[3:] for p in layer.parameters())
