"""Explaining one failing node at the first layer where the engine's output departs from the reference.

Contract: :func:`explain_layer` needs an engine trace with per-layer sketches (SGLang:
``--layer-sketches``). It rebuilds the reference's committed state at the step, runs the step's
tree with every layer's output kept, and finds the node's first layer whose sketch differs beyond the
trace's tensor tolerance (or takes ``layer``). Up to that layer the engine and the reference agree,
so the reference's output of the layer before is the layer's input on both sides; the layer alone is
then re-run under hypotheses, each scored by the relative L2 distance between the engine's sketch of
the node's output and the reference's (the replay's own measure):

| hypothesis | layers | what it tests |
|---|---|---|
| another input token | the first layer | every vocabulary id as the node's token |
| another parent: conv window and recurrence / the conv window only / the recurrence only | Gated DeltaNet | every earlier node and the committed prefix (-1) |
| the committed conv state / recurrent state zeroed | Gated DeltaNet | an engine that starts from a cleared slot |
| another attention visibility | attention | as :mod:`refcheck.diff.explain` |
| another node's output row | all | a row mix-up in some buffer (the reference's exact output at every other node) |

A hypothesis *explains* the node when its distance is within the tolerance while the exact
layer's is not. Nothing that reproduces the engine means the fault is not in which rows, states or
tokens the layer read, but in how it computed on them (a kernel), which is what the note should say.
Bad input (no such request / step / node / layer, no layer sketches) is a :class:`UsageError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree_reference.layers import TreePlan, conv_window_rows
from ddtree_reference.state import TargetState
from ddtree_reference.target import Target
from ddtree_reference.treechunk import ancestor_matrix
from refcheck.diff.explain import committed_state, find_step, visibility_variants
from refcheck.diff.tolerance import tolerance_of
from refcheck.errors import UsageError
from refcheck.sketch import layer_sketch, rel_l2, rel_l2_rows, sketch_rows
from refcheck.trace.io import Trace

TOKEN_CHUNK = 1024  # candidate tokens per layer-0 pass (a 248k vocabulary runs in ~240 passes)


@dataclass(slots=True)
class LayerHypothesis:
    kind: str  # exact | token | parent | conv_parent | recurrent_parent | zero_state | visibility | row
    detail: str
    rel_l2: float  # engine's sketch of the node's layer output vs the reference's under the hypothesis
    explains: bool = False


@dataclass(slots=True)
class LayerExplanation:
    request_id: str
    step: int
    node: int
    layer: int
    layer_type: str  # linear_attention | attention
    tolerance: float
    per_layer: list[float]  # the node's rel L2 at every layer (exact reference)
    median_other_nodes: list[float]  # per layer, the median over the step's other nodes (the noise floor)
    hypotheses: list[LayerHypothesis] = field(default_factory=list)

    @property
    def explained_by(self) -> list[LayerHypothesis]:
        return sorted((h for h in self.hypotheses if h.explains), key=lambda h: h.rel_l2)


@torch.no_grad()
def explain_layer(trace: Trace, request_id: str, step: int, node: int, target: Target,
                  layer: int | None = None) -> LayerExplanation:
    req, s = find_step(trace, request_id, step, node)
    if s.layer_sketch is None:
        raise UsageError(f"step {step} of {request_id} carries no layer sketches: record the engine with per-layer "
                         "sketches (SGLang: diff --layer-sketches, or the suite's *-layers configurations)")
    tol = tolerance_of(trace.provenance).tensor_rel_l2
    state = committed_state(req, s, target)
    dev = target.device
    tokens, parents, depths = (torch.tensor(v, dtype=torch.long, device=dev)
                               for v in (s.tree_tokens, s.tree_parents, s.tree_depths))
    n = tokens.shape[0]
    outs, ref, eng = _sketches(target, state, tokens, parents, depths, s.layer_sketch)
    per_layer, medians, layer = _layer_errors(eng, ref, node, layer, tol, f"node {node} of {request_id} step {step}")
    linear = target.is_linear(layer)
    out = LayerExplanation(request_id, step, node, layer, "linear_attention" if linear else "attention", tol,
                           per_layer, medians)

    h_in = target.body.embed_tokens(tokens) if layer == 0 else outs[layer - 1]  # [n, H]
    cos, sin = target.rope(h_in, state.length + depths)
    visible = ancestor_matrix(parents)

    def plan_of(conv_parents: torch.Tensor, rec_parents: torch.Tensor) -> TreePlan:
        plan = TreePlan(rec_parents, [], {}, ancestor_matrix(rec_parents))
        for k in target.conv_kernels:
            plan.window_rows[k] = conv_window_rows(conv_parents, k)
        return plan

    def run(h: torch.Tensor = h_in, conv_parents: torch.Tensor = parents, rec_parents: torch.Tensor = parents,
            vis: torch.Tensor = visible, st: TargetState = state) -> torch.Tensor:
        h_out, _ = target.layer(layer, h, st, plan_of(conv_parents, rec_parents), vis, cos, sin)
        return sketch_rows(h_out)  # [n', r]

    def add(kind: str, detail: str, sk_row: torch.Tensor) -> None:
        out.hypotheses.append(LayerHypothesis(kind, detail, rel_l2(eng[layer, node], sk_row)))

    exact = run()
    add("exact", "the exact reference (what the replay compares)", exact[node])

    if layer == 0:  # every vocabulary id as the node's token: extra leaves under its parent
        token_errs = _token_errors(target, state, tokens, parents, depths, node, eng[layer, node], plan_of)  # [V]
        for v in token_errs.argsort()[:5].tolist():
            if v != int(tokens[node]):
                out.hypotheses.append(LayerHypothesis("token", f"token {v} fed at this node instead of "
                                                      f"{int(tokens[node])}", float(token_errs[v])))

    if linear:
        _state_hypotheses(state, parents, node, layer, run, add)
    else:
        for what, vis_row in visibility_variants(visible, parents, node).items():
            vis = visible.clone()
            vis[node] = vis_row
            add("visibility", f"attention to {what}", run(vis=vis)[node])

    for j in range(n):
        if j != node:
            add("row", f"node {j}'s output row (a row mix-up)", exact[j])
    return _judged(out)


def _layer_errors(eng: torch.Tensor, ref: torch.Tensor, node: int, layer: int | None, tol: float,
                  what: str) -> tuple[list[float], list[float], int]:
    """The node's rel L2 per layer, the other nodes' median per layer, and the layer to explain: ``layer``,
    or the first one over ``tol`` (none: a :class:`UsageError`, as is a layer the target lacks)."""
    n = ref.shape[1]
    per_layer = [rel_l2(eng[i, node], ref[i, node]) for i in range(ref.shape[0])]
    others = [j for j in range(n) if j != node]
    medians = [float(torch.tensor([rel_l2(eng[i, j], ref[i, j]) for j in others]).median()) if others else 0.0
               for i in range(ref.shape[0])]
    if layer is None:
        layer = next((i for i, e in enumerate(per_layer) if e > tol), None)
        if layer is None:
            raise UsageError(f"{what} agrees with the reference at every layer "
                             f"(largest rel L2 {max(per_layer):.3g} <= {tol:g}): nothing to explain")
    if not 0 <= layer < ref.shape[0]:
        raise UsageError(f"the target has layers 0..{ref.shape[0] - 1}, not {layer}")
    return per_layer, medians, layer


def _token_errors(target: Target, state: TargetState, tokens: torch.Tensor, parents: torch.Tensor,
                  depths: torch.Tensor, node: int, eng_row: torch.Tensor,
                  plan_of: Callable[[torch.Tensor, torch.Tensor], TreePlan]) -> torch.Tensor:
    """Layer 0 with every vocabulary id as the node's token (extra leaves under its parent): the rel L2
    of each against the engine's sketch row ``eng_row`` ([V])."""
    n, dev, errs = tokens.shape[0], target.device, []
    for lo in range(0, target.vocab_size, TOKEN_CHUNK):  # in chunks: the tree chunk is [n', n'] per head
        vocab = torch.arange(lo, min(lo + TOKEN_CHUNK, target.vocab_size), device=dev)
        ext_p = torch.cat([parents, torch.full_like(vocab, int(parents[node]))])
        ext_d = torch.cat([depths, torch.full_like(vocab, int(depths[node]))])
        h_ext = target.body.embed_tokens(torch.cat([tokens, vocab]))
        cos_e, sin_e = target.rope(h_ext, state.length + ext_d)
        h_out, _ = target.layer(0, h_ext, state, plan_of(ext_p, ext_p), ancestor_matrix(ext_p), cos_e, sin_e)
        errs.append(rel_l2_rows(eng_row, sketch_rows(h_out[n:])))  # [chunk]
    return torch.cat(errs)


def _state_hypotheses(state: TargetState, parents: torch.Tensor, node: int, layer: int,
                      run: Callable[..., torch.Tensor], add: Callable[[str, str, torch.Tensor], None]) -> None:
    """A Gated DeltaNet layer: another parent for the conv window and/or the recurrence, and each committed
    state zeroed at this layer (``run`` the layer with one input changed, ``add`` a hypothesis)."""
    for p in range(-1, node):
        if p == int(parents[node]):
            continue
        alt = parents.clone()
        alt[node] = p
        what = "the committed prefix" if p < 0 else f"node {p}"
        add("parent", f"conv window and recurrence from {what}", run(conv_parents=alt, rec_parents=alt)[node])
        add("conv_parent", f"conv window from {what}, recurrence from the parent", run(conv_parents=alt)[node])
        add("recurrent_parent", f"recurrence from {what}, conv window from the parent", run(rec_parents=alt)[node])
    for what in ("conv", "recurrent"):
        per_layer_state = list(getattr(state, what))
        per_layer_state[layer] = torch.zeros_like(per_layer_state[layer])
        changed: dict[str, Any] = {what: per_layer_state}
        zeroed = dataclasses.replace(state, **changed)  # only this layer's slot cleared
        add("zero_state", f"the committed {what} state zeroed", run(st=zeroed)[node])


def _sketches(target: Target, state: TargetState, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
              engine_sketch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's layer outputs ``[layers, n, H]``, their sketch and the engine's ``[layers, n, r]``
    (of another shape: a :class:`UsageError`)."""
    fwd = target.forward(state, tokens, parents, depths, keep_layer_outputs=True)
    assert fwd.layer_outputs is not None  # kept: keep_layer_outputs=True
    outs = torch.stack(fwd.layer_outputs)  # [layers, n, H]
    ref = layer_sketch(outs)  # [layers, n, r]
    eng = torch.as_tensor(engine_sketch).float()
    if eng.shape != ref.shape:
        raise UsageError(f"the trace's layer sketches have shape {tuple(eng.shape)}, the reference's {tuple(ref.shape)}")
    return outs, ref, eng


def _judged(out: LayerExplanation) -> LayerExplanation:
    """Mark the hypotheses that explain the deviation: within the tolerance where the exact reference is not."""
    exact_err = out.hypotheses[0].rel_l2
    for hyp in out.hypotheses[1:]:
        hyp.explains = exact_err > out.tolerance and hyp.rel_l2 <= out.tolerance
    return out
