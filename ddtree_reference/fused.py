"""Fused projections: one GEMM where the checkpoint has several linear layers reading the same input.

Contract
========

:func:`fuse_layer` takes one transformers decoder layer and, for each group of bias-free
``nn.Linear`` modules that read the same input, concatenates their weights into one
``[sum(out_features), in_features]`` tensor:

* Gated DeltaNet (Qwen3.5 layout): ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a``;
* attention: ``q_proj | k_proj | v_proj``;
* dense MLP: ``gate_proj | up_proj``.

Each original module's ``weight`` is then re-pointed at its rows of the fused tensor (a view: the
weights are held once, and every module computes exactly what it computed before, for any other
user of the model too). The caller keeps the fused tensors (:class:`LayerFusion`) and passes them
to :func:`project`, the read side: the outputs of the named projections, as one GEMM split by rows
when given the group's fused weight, else one call per projection. Nothing is attached to the
modules, so a target that does not pass the fused weights computes what it did.

The fused GEMM computes the same products; its outputs may differ from the separate GEMMs' by float
rounding (the BLAS library may split the reduction differently for a wider matrix). Fusion is
therefore part of :meth:`ddtree_reference.target.Target.compile`'s fast path, never of the eager
reference. A group whose members differ in dtype, device or input width, or have a bias, is not
fused (its entry is None). Fuse after the model is on its device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "GATED_DELTANET", "MLP", "UNFUSED", "LayerFusion", "fuse_block", "fuse_layer", "project"]

GATED_DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class LayerFusion:
    """The fused weights of one decoder layer, None where a group was not fused."""

    mixer: torch.Tensor | None = None  # [sum(out), H]: the token mixer's input projections
    mlp: torch.Tensor | None = None  # [2 * I, H]: gate | up


UNFUSED = LayerFusion()  # a layer computing every projection on its own (the eager reference)


def _fusable(linears: list) -> bool:
    if not all(isinstance(m, torch.nn.Linear) and m.bias is None for m in linears):
        return False
    first = linears[0].weight
    return all(m.weight.dtype == first.dtype and m.weight.device == first.device
               and m.weight.shape[1] == first.shape[1] for m in linears)


def fuse_block(block: torch.nn.Module | None, names: tuple[str, ...]) -> torch.Tensor | None:
    """The fused weight [sum(out), in] of ``block``'s projections ``names`` (their weights re-pointed at
    its rows), or None when the block lacks them or they cannot be fused."""
    linears = [getattr(block, name, None) for name in names]
    if block is None or not _fusable(linears):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears], dim=0)  # [sum(out), in]
    start = 0
    for m in linears:  # each module now reads its rows of the one fused tensor: no second copy
        rows = int(m.weight.shape[0])
        m.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    return weight


def fuse_layer(layer: torch.nn.Module) -> LayerFusion:
    """Fuse the token mixer's input projections and the dense MLP's gate | up of one decoder layer."""
    if getattr(layer, "linear_attn", None) is not None:
        mixer = fuse_block(layer.linear_attn, GATED_DELTANET)
    else:
        mixer = fuse_block(getattr(layer, "self_attn", None), ATTENTION)
    return LayerFusion(mixer=mixer, mlp=fuse_block(getattr(layer, "mlp", None), MLP))


def project(block: torch.nn.Module, x: torch.Tensor, names: tuple[str, ...],
            fused: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``block``'s projections ``names`` of x [n, in]: [n, out_i] each; one GEMM when ``fused`` (the
    group's weight from :func:`fuse_block`) is given, then split by the modules' output widths."""
    if fused is None:
        return tuple(getattr(block, name)(x) for name in names)
    sizes = [getattr(block, name).out_features for name in names]
    return torch.split(F.linear(x, fused), sizes, dim=-1)  # [n, sum(out)] -> [n, out_i] each
