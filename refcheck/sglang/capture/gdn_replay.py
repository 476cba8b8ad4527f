"""SGLang's Gated DeltaNet tree-verify kernels, replayed on the reference's own inputs, node by node.

Contract: for one step of an engine trace, :func:`gdn_inputs` builds what each asked-for Gated
DeltaNet layer's mixer receives there, computed by the reference (fp32 or bf16): the pre-conv projections
``mixed_qkv`` [T, C], the gate inputs ``a``, ``b`` [T, HV], the committed conv state [K-1, C] and
recurrent state [HV, Dk, Dv], and the reference's outputs: the post-SiLU conv ``conv_out`` [T, C]
and the core output ``core`` [T, HV, Dv] (before the gated norm). :func:`replay` hands those inputs
to a kernel set and reports, per node, the relative L2 distance of the kernels' conv output and
core output from the reference's. The recurrent kernel is fed the *reference's* conv output, so
each kernel is judged on exact inputs: a node that deviates is that kernel's doing, with no engine,
scheduler or capture in between — the smallest reproduction of an engine finding.

Kernel sets share one contract (``conv(inp, next_token, next_sibling) -> (conv_out [T, C],
parent [T])`` and ``recurrent(inp, q, k, v, parent) -> core [T, HV, Dv]``):

* :class:`SGLangKernels` calls SGLang's own target-verify kernels the way its GDN backend does
  (0.5.17: ``causal_conv1d_update`` with the tree's first-child / next-sibling links, then
  ``fused_sigmoid_gating_delta_rule_update`` with the parent links the conv kernel wrote), with
  one request in pool slot 0 and fresh intermediate buffers. GPU and SGLang only.
* :class:`ReferenceKernels` is the same contract in PyTorch (the reference's math), so the harness
  itself is tested on CPU: it must report every node exact, and a deliberately wrong variant must be
  caught at the right nodes.

The tree links are SGLang's: :func:`tree_links` gives each node's first child and next sibling in
index order, as ``reconstruct_indices_from_tree_mask`` derives them from the ancestor mask.
``scripts/sglang_gdn_replay.py`` is the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree_reference.layers import conv_window_rows, gdn_projections, l2norm
from ddtree_reference.target import Target
from ddtree_reference.treechunk import gated_delta_tree_chunk
from refcheck.diff.explain import committed_state, find_step
from refcheck.errors import UsageError
from refcheck.sketch import rel_l2
from refcheck.trace.io import Trace


@dataclass(slots=True)
class GDNStepInputs:
    layer: int
    parents: torch.Tensor  # [T] int64, -1 = the committed prefix (node 0, the root)
    mixed_qkv: torch.Tensor  # [T, C] projections before the conv, model dtype
    a: torch.Tensor  # [T, HV] model dtype
    b: torch.Tensor  # [T, HV] model dtype
    conv_state: torch.Tensor  # [K-1, C] committed conv inputs, oldest first
    recurrent_state: torch.Tensor  # [HV, Dk, Dv] float32
    weight: torch.Tensor  # [C, K] depthwise conv taps
    bias: torch.Tensor | None  # [C]
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]
    dims: tuple[int, int, int, int, int]  # key_dim, value_dim, num_k_heads, num_v_heads, head_k_dim
    conv_out: torch.Tensor  # [T, C] the reference's post-SiLU conv
    core: torch.Tensor  # [T, HV, Dv] float32, the reference's core output

    @property
    def nodes(self) -> int:
        return int(self.parents.shape[0])


def tree_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] parents -> (next_token [T], next_sibling [T]) int64: first child and next sibling, both
    the smallest larger index (-1: none), as SGLang's reconstruct_indices_from_tree_mask."""
    par = parents.tolist()
    n = len(par)
    first = [-1] * n
    sibling = [-1] * n
    last_child: dict[int, int] = {}
    for i in range(1, n):
        p = par[i]
        if p in last_child:
            sibling[last_child[p]] = i
        else:
            first[p] = i
        last_child[p] = i
    return torch.tensor(first, dtype=torch.long), torch.tensor(sibling, dtype=torch.long)


def parents_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tree_links` (the root's parent is -1)."""
    nt, ns = next_token.tolist(), next_sibling.tolist()
    par = [-1] * len(nt)
    for i in range(len(nt)):
        c = nt[i]
        while c != -1:
            par[c] = i
            c = ns[c]
    return torch.tensor(par, dtype=torch.long)


@torch.no_grad()
def gdn_inputs(trace: Trace, request_id: str, step: int, target: Target, layers: list[int]) -> list[GDNStepInputs]:
    """The step's mixer inputs and reference outputs at each of ``layers`` (one prefill, one forward)."""
    req, s = find_step(trace, request_id, step, 0)
    linear = [i for i in range(len(target.layers)) if target.is_linear(i)]
    bad = [i for i in layers if i not in linear]
    if bad:
        raise UsageError(f"layer {bad[0]} is not a Gated DeltaNet layer of this target (those are {linear})")
    if s.tree_parents[0] != -1 or any(p >= i for i, p in enumerate(s.tree_parents) if i):
        raise UsageError(f"step {step} of {request_id}: the tree is not rooted at node 0 in topological order")
    state = committed_state(req, s, target)
    dev = target.device
    tokens, parents, depths = (torch.tensor(v, dtype=torch.long, device=dev)
                               for v in (s.tree_tokens, s.tree_parents, s.tree_depths))
    fwd = target.forward(state, tokens, parents, depths, keep_layer_outputs=True)
    nt, ns = tree_links(parents.cpu())
    ref = ReferenceKernels()
    out = []
    for layer in layers:
        h_in = target.body.embed_tokens(tokens) if layer == 0 else fwd.layer_outputs[layer - 1]  # [T, H]
        gdn = target.layers[layer].linear_attn
        mixed, _z, b, a = gdn_projections(gdn, target.layers[layer].input_layernorm(h_in))
        inp = GDNStepInputs(layer, parents, mixed, a, b, state.conv[layer], state.recurrent[layer].float(),
                            gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.A_log, gdn.dt_bias,
                            (gdn.key_dim, gdn.value_dim, gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim),
                            conv_out=torch.empty(0), core=torch.empty(0))
        inp.conv_out, par = ref.conv(inp, nt, ns)
        inp.core = ref.recurrent(inp, *split_qkv(inp, inp.conv_out), par)
        out.append(inp)
    return out


def split_qkv(inp: GDNStepInputs, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, C] -> q, k [1, T, Hk, Dk] and v [1, T, HV, Dv], contiguous (as SGLang's GDN backend splits)."""
    key_dim, value_dim, hk, hv, dk = inp.dims
    t = conv_out.shape[0]
    q, k, v = torch.split(conv_out, [key_dim, key_dim, value_dim], dim=-1)
    return (q.reshape(1, t, hk, dk).contiguous(), k.reshape(1, t, hk, dk).contiguous(),
            v.reshape(1, t, hv, value_dim // hv).contiguous())


class ReferenceKernels:
    """The kernel contract in PyTorch, with the reference's math (conv in the model dtype, then the
    recurrence in float32 from each node's parent), walking the tree through the SGLang links."""

    def conv(self, inp: GDNStepInputs, next_token: torch.Tensor, next_sibling: torch.Tensor):
        parents = parents_from_links(next_token, next_sibling).to(inp.mixed_qkv.device)
        rows = torch.cat([inp.conv_state.to(inp.mixed_qkv.dtype), inp.mixed_qkv], dim=0)  # [K-1+T, C]
        windows = rows[conv_window_rows(parents, inp.weight.shape[1])]  # [T, K, C]
        conv = torch.einsum("nkc,ck->nc", windows.to(inp.weight.dtype), inp.weight)
        if inp.bias is not None:
            conv = conv + inp.bias
        return F.silu(conv).to(inp.mixed_qkv.dtype), parents  # [T, C], [T]

    def recurrent(self, inp: GDNStepInputs, q, k, v, parents: torch.Tensor) -> torch.Tensor:
        _, _, hk, hv, dk = inp.dims
        rep = hv // hk
        # float32 for the recurrence whatever the model dtype, as the reference and SGLang's kernel do
        qf = q[0].repeat_interleave(rep, dim=1).float()  # [T, HV, Dk]
        kf = k[0].repeat_interleave(rep, dim=1).float()
        qf, kf = l2norm(qf) / dk**0.5, l2norm(kf)
        beta = inp.b.float().sigmoid()  # [T, HV]
        g = -inp.A_log.float().exp() * F.softplus(inp.a.float() + inp.dt_bias.float())  # [T, HV]
        chunk = gated_delta_tree_chunk(qf, kf, v[0].float(), g, beta, parents.to(qf.device), inp.recurrent_state)
        return chunk.out  # [T, HV, Dv]


class SGLangKernels:
    """SGLang's target-verify kernels (0.5.17 names; see the module docstring), one request in slot 0."""

    def __init__(self) -> None:
        try:
            from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (
                fused_sigmoid_gating_delta_rule_update,
            )
            from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
        except ImportError as exc:
            raise UsageError(f"SGLang's GDN kernels are not importable here ({exc}); run on the GPU machine "
                             "with SGLang: scripts/sglang_bundle.sh run python3 scripts/sglang_gdn_replay.py ...") from exc
        self._conv, self._recurrent = causal_conv1d_update, fused_sigmoid_gating_delta_rule_update

    def conv(self, inp: GDNStepInputs, next_token: torch.Tensor, next_sibling: torch.Tensor):
        t, c = inp.mixed_qkv.shape
        dev = inp.mixed_qkv.device
        x = inp.mixed_qkv.reshape(1, t, c).transpose(1, 2)  # [1, C, T] strided view, as the backend passes it
        conv_state = inp.conv_state.T.contiguous().unsqueeze(0)  # [slots=1, C, K-1]
        window = torch.zeros(1, t, c, inp.weight.shape[1] - 1, dtype=inp.mixed_qkv.dtype, device=dev)  # [1, T, C, K-1]
        slot = torch.zeros(1, dtype=torch.int32, device=dev)
        nt, ns = next_token.view(1, t).to(dev), next_sibling.view(1, t).to(dev)
        parent = torch.empty_like(nt)
        out = self._conv(x, conv_state, inp.weight, inp.bias, "silu", conv_state_indices=slot,
                         intermediate_conv_window=window, intermediate_state_indices=slot,
                         retrieve_next_token=nt, retrieve_next_sibling=ns, retrieve_parent_token=parent)
        return out.transpose(1, 2).reshape(t, c), parent.view(t)  # [T, C], [T]

    def recurrent(self, inp: GDNStepInputs, q, k, v, parents: torch.Tensor) -> torch.Tensor:
        t = q.shape[1]
        hv, dv, dk = v.shape[2], v.shape[3], q.shape[3]
        dev = q.device
        ssm = inp.recurrent_state.transpose(-1, -2).contiguous().unsqueeze(0)  # [slots=1, HV, V, K] float32
        inter = torch.zeros(1, t, hv, dv, dk, dtype=torch.float32, device=dev)  # [slots, steps, HV, V, K]
        slot = torch.zeros(1, dtype=torch.int32, device=dev)
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        o = self._recurrent(A_log=inp.A_log, a=inp.a.contiguous(), dt_bias=inp.dt_bias, softplus_beta=1.0,
                            softplus_threshold=20.0, q=q, k=k, v=v, b=inp.b.contiguous(), initial_state_source=ssm,
                            initial_state_indices=slot, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                            disable_state_update=True, intermediate_states_buffer=inter,
                            intermediate_state_indices=slot, cache_steps=t,
                            retrieve_parent_token=parents.view(1, t).to(dev))
        return o.reshape(t, hv, dv).float()  # [T, HV, Dv]


@dataclass(slots=True)
class NodeReplay:
    conv_rel: list[float]  # per node: kernel conv output vs the reference's
    core_rel: list[float]  # per node: kernel core output (on the reference's conv output) vs the reference's
    parents_agree: bool  # the parent links the conv kernel wrote equal the tree's parents


@torch.no_grad()
def replay(inp: GDNStepInputs, kernels) -> NodeReplay:
    nt, ns = tree_links(inp.parents.cpu())
    conv_out, parent = kernels.conv(inp, nt, ns)
    conv_rel = [rel_l2(conv_out[i].float(), inp.conv_out[i].float()) for i in range(inp.nodes)]
    # the recurrence on exact inputs: the reference's conv output and the tree's own parents
    core = kernels.recurrent(inp, *split_qkv(inp, inp.conv_out), inp.parents.to(inp.conv_out.device))
    core_rel = [rel_l2(core[i], inp.core[i]) for i in range(inp.nodes)]
    got = parent.cpu().tolist()
    agree = all(got[i] == int(inp.parents[i]) for i in range(1, inp.nodes))  # the root's entry is unused
    return NodeReplay(conv_rel, core_rel, agree)
