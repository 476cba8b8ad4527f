"""Token mixers of the target, evaluated over a draft tree with explicit state.

Contract: these functions take a transformers decoder layer's *own* attention or Gated DeltaNet
module (its weights and norms; nothing is copied or monkeypatched) and evaluate it for a set of
new tokens ("nodes") that hang below an already committed prefix:

* every node ``t`` has a parent ``parents[t]`` (``-1`` = the last committed token) and an absolute
  position; nodes are in topological order (``parents[t] < t``);
* full attention sees the committed prefix plus the node's ancestors and itself (``visible``);
* a Gated DeltaNet node builds its causal-conv window from its ancestors' conv inputs (falling back
  to the committed conv state) and starts its recurrence from its **parent's** post-state, never
  from a sibling's. The recurrence is evaluated depth level by depth level, vectorised over all
  nodes of a level; projections, convolution and output gating are computed once for all nodes.

A chain (prefill) is a tree whose parents are ``t - 1``. ``leaky=True`` reproduces the classic
engine bug (the flattened tree runs through the recurrent layers as one sequence) for tests.

Layouts: hidden [n, H]; attention KV [Hkv, P, D] (post-norm, post-RoPE); conv state [K-1, C] (the
last K-1 conv inputs, oldest first); recurrent state [HV, Dk, Dv] in float32 (transformers' order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree_reference.fused import ATTENTION, GATED_DELTANET, project
from ddtree_reference.treechunk import ancestor_matrix, gated_delta_tree_chunk


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels (partial rotary leaves the rest unchanged).

    x: [heads, n, D]; cos/sin: [n, R] with R <= D.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


def repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[Hkv, P, D] -> [Hkv * n_rep, P, D], each kv head serving n_rep consecutive query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=0)


@dataclass(slots=True)
class AttentionOut:
    hidden: torch.Tensor  # [n, H]
    keys: torch.Tensor  # [Hkv, n, D] new nodes' keys (post-norm, post-RoPE)
    values: torch.Tensor  # [Hkv, n, D]


def attention_tree(
    attn: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past_keys: torch.Tensor,
    past_values: torch.Tensor,
    visible: torch.Tensor,
    prefix_valid: torch.Tensor | None = None,
    fused: torch.Tensor | None = None,
) -> AttentionOut:
    """Full attention for n nodes over the committed prefix and their own ancestors.

    x: [n, H] (already input-layernormed); cos/sin: [n, R]; past_*: [Hkv, P, D];
    visible: [n, n] bool, visible[i, j] = node j is an ancestor-or-self of node i;
    prefix_valid: [P] bool, which past slots hold committed tokens (fixed-size caches,
    ddtree_reference/static.py); None = all of them. fused: q | k | v's fused weight (ddtree_reference/fused.py).
    Handles Qwen3 (plain) and Qwen3.5 / Qwen3-Next (output gate packed into q_proj).
    """
    n = x.shape[0]
    d = attn.head_dim
    n_heads = attn.q_proj.out_features // d
    gate = None
    q, k, v = project(attn, x, ATTENTION, fused)  # [n, out] each (one GEMM when fused)
    if attn.o_proj.in_features * 2 == attn.q_proj.out_features:  # gated attention
        n_heads //= 2
        q, gate = torch.chunk(q.view(n, n_heads, 2 * d), 2, dim=-1)  # [n, Hq, D] each
        gate = gate.reshape(n, n_heads * d)
    q = attn.q_norm(q.reshape(n, n_heads, d)).transpose(0, 1)  # [Hq, n, D]
    k = attn.k_norm(k.view(n, -1, d)).transpose(0, 1)  # [Hkv, n, D]
    v = v.view(n, -1, d).transpose(0, 1)  # [Hkv, n, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    keys = torch.cat([past_keys, k], dim=1)  # [Hkv, P+n, D]
    values = torch.cat([past_values, v], dim=1)
    n_rep = n_heads // k.shape[0]
    if prefix_valid is None:
        prefix = torch.ones(n, past_keys.shape[1], dtype=torch.bool, device=x.device)  # [n, P]
    else:
        prefix = prefix_valid[None, :].expand(n, -1)  # [n, P]
    mask = torch.cat([prefix, visible], dim=1)  # [n, P+n], True = may attend
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        repeat_heads(keys, n_rep).unsqueeze(0),
        repeat_heads(values, n_rep).unsqueeze(0),
        attn_mask=mask.view(1, 1, n, -1),
        scale=attn.scaling,
    )[0]  # [Hq, n, D]
    out = out.transpose(0, 1).reshape(n, n_heads * d)  # [n, Hq*D]
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return AttentionOut(hidden=attn.o_proj(out), keys=k, values=v)


class LazyStates:
    """Per-node recurrent post-states rebuilt on demand from a tree chunk: ``states[node]``."""

    __slots__ = ("chunk",)

    def __init__(self, chunk) -> None:
        self.chunk = chunk

    def __getitem__(self, node) -> torch.Tensor:
        return self.chunk.state(int(node))  # [HV, Dk, Dv]

    @property
    def shape(self) -> tuple[int, ...]:
        k, v = self.chunk._k, self.chunk._v_new
        return (self.chunk.num_nodes, k.shape[0], k.shape[-1], v.shape[-1])


@dataclass(slots=True)
class DeltaNetOut:
    hidden: torch.Tensor  # [n, H]
    conv_windows: torch.Tensor  # [n, K-1, C] each node's conv state after it (oldest first)
    states: torch.Tensor | LazyStates  # [n, HV, Dk, Dv] float32, each node's recurrent post-state


def gdn_projections(gdn: torch.nn.Module, x: torch.Tensor,
                    fused: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Input projections of one Gated DeltaNet layer for n tokens.

    Returns mixed_qkv [n, C], z [n, HV, Dv], b [n, HV], a [n, HV] in the model dtype.
    Qwen3.5 has separate projections (one GEMM with their ``fused`` weight, ddtree_reference/fused.py);
    Qwen3-Next packs them per key-head group.
    """
    n = x.shape[0]
    if hasattr(gdn, "in_proj_qkv"):
        mixed, z, b, a = project(gdn, x, GATED_DELTANET, fused)
        return mixed, z.view(n, -1, gdn.head_v_dim), b, a
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(
        gdn.in_proj_qkvz(x).unsqueeze(0), gdn.in_proj_ba(x).unsqueeze(0)
    )
    mixed = torch.cat([t.reshape(n, -1) for t in (q, k, v)], dim=-1)  # [n, C]
    return mixed, z[0], b[0], a[0]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_window_rows(parents: torch.Tensor, kernel: int) -> torch.Tensor:
    """Row indices of each node's conv window in ``cat([conv_state, nodes])``.

    parents: [n] (-1 = committed). Rows 0..K-2 hold the committed conv state, row K-1+t node t.
    Returns [n, K] int64, oldest first; the last column is the node itself.
    """
    n = parents.shape[0]
    base = kernel - 1
    # prev[r]: the row before row r on its own path (committed rows are a plain sequence).
    prev_committed = torch.arange(-1, base - 1, device=parents.device).clamp(min=0)
    prev_nodes = torch.where(parents >= 0, parents + base, torch.full_like(parents, base - 1))
    prev = torch.cat([prev_committed, prev_nodes])  # [K-1+n]
    rows = [torch.arange(n, device=parents.device) + base]
    for _ in range(kernel - 1):
        rows.append(prev[rows[-1]])
    return torch.stack(rows[::-1], dim=1)  # [n, K]


def _depth_levels(parents: torch.Tensor, leaky: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Recurrence parents and node groups that can be updated together.

    Exact: each node after its parent, grouped by depth. Leaky: the flattened order as a chain.
    """
    n = parents.shape[0]
    if leaky:
        chain = torch.arange(-1, n - 1, device=parents.device)
        return chain, [torch.tensor([t], device=parents.device) for t in range(n)]
    depth = [0] * n
    par = parents.tolist()  # one host copy per tree (parents usually live on the host already)
    for t in range(n):
        depth[t] = 0 if par[t] < 0 else depth[par[t]] + 1
    by_level: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for t, d in enumerate(depth):
        by_level[d].append(t)
    levels = [torch.tensor(ix, dtype=torch.long, device=parents.device) for ix in by_level]
    return parents, levels


@dataclass(slots=True)
class TreePlan:
    """Index structures of one tree, computed once per forward and shared by every layer."""

    parents: torch.Tensor  # [n] recurrence parents (the flat chain when leaky)
    levels: list[torch.Tensor]  # node indices per depth level (device)
    window_rows: dict[int, torch.Tensor]  # conv kernel size -> [n, K] rows into cat([conv_state, nodes])
    ancestors: torch.Tensor | None = None  # [n, n] ancestor-or-self of ``parents`` (tree-chunk method)

    @classmethod
    def build(cls, parents: torch.Tensor, leaky: bool = False, need_levels: bool = True,
              ancestors: torch.Tensor | None = None) -> TreePlan:
        """need_levels=False (tree-chunk method) builds nothing on the host, so it can be graphed;
        it also derives the ancestor matrix once, for every Gated DeltaNet layer of the forward
        (``ancestors``: that of ``parents``, when the caller has it; ignored when leaky)."""
        if not need_levels:
            n = parents.shape[0]
            rec = torch.arange(-1, n - 1, device=parents.device) if leaky else parents
            return cls(rec, [], {}, ancestor_matrix(rec) if leaky or ancestors is None else ancestors)
        rec_parents, levels = _depth_levels(parents, leaky)
        return cls(rec_parents, levels, {})

    def rows(self, kernel: int) -> torch.Tensor:
        if kernel not in self.window_rows:
            self.window_rows[kernel] = conv_window_rows(self.parents, kernel)
        return self.window_rows[kernel]


def deltanet_tree(
    gdn: torch.nn.Module,
    x: torch.Tensor,
    parents: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    leaky: bool = False,
    method: str = "levels",
    plan: TreePlan | None = None,
    fused: torch.Tensor | None = None,
) -> DeltaNetOut:
    """Gated DeltaNet for n tree nodes with exact per-branch conv window and recurrent state.

    x: [n, H] (already input-layernormed); parents: [n] int64 (-1 = committed prefix);
    conv_state: [K-1, C] committed conv inputs; recurrent_state: [HV, Dk, Dv] float32.
    method: "levels" (recurrence depth level by depth level, all per-node states materialised) or
    "chunk" (the whole tree as one ancestor-masked chunk of the chunked delta rule,
    ddtree_reference/treechunk.py; per-node states rebuilt on demand). Both are exact. fused: the input
    projections' fused weight (ddtree_reference/fused.py).
    """
    mixed, z, b, a = gdn_projections(gdn, x, fused)
    plan = plan or TreePlan.build(parents, leaky)
    conv, windows = tree_conv(gdn, mixed, conv_state, plan)
    q, k, v, g, beta = delta_rule_inputs(gdn, conv, b, a)
    if method == "chunk":  # the committed state enters in float32, the recurrence's dtype
        chunk = gated_delta_tree_chunk(q, k, v, g, beta, plan.parents, recurrent_state.float(), plan.ancestors)
        hidden = gated_output(gdn, chunk.out, z, x.dtype)
        return DeltaNetOut(hidden=hidden, conv_windows=windows[:, 1:], states=LazyStates(chunk))
    if method != "levels":
        raise ValueError(f"unknown Gated DeltaNet tree method {method!r} (levels, chunk)")
    states, core = delta_rule_levels(q, k, v, g, beta, plan, recurrent_state)
    return DeltaNetOut(hidden=gated_output(gdn, core, z, x.dtype), conv_windows=windows[:, 1:], states=states)


def tree_conv(gdn: torch.nn.Module, mixed: torch.Tensor, conv_state: torch.Tensor,
              plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over each node's own path (conv in the weight dtype, as transformers).

    mixed: [n, C]; conv_state: [K-1, C]. Returns the activated conv output [n, C] in mixed's dtype and
    each node's window [n, K, C] of conv inputs, oldest first (the node itself last).
    """
    weight = gdn.conv1d.weight.squeeze(1)  # [C, K]
    rows = torch.cat([conv_state.to(mixed.dtype), mixed], dim=0)  # [K-1+n, C]
    windows = rows[plan.rows(gdn.conv_kernel_size)]  # [n, K, C]
    # Summed in float32 and rounded once to the weight dtype, as a conv kernel's accumulator does; an
    # elementwise product and a K-term sum (not a per-channel batched GEMV) so that a compiled layer fuses it.
    conv = (windows.float() * weight.t().float()).sum(dim=1).to(weight.dtype)  # [n, K, C] * [K, C] -> [n, C]
    if gdn.conv1d.bias is not None:
        conv = conv + gdn.conv1d.bias
    return F.silu(conv).to(mixed.dtype), windows  # [n, C], [n, K, C]


def delta_rule_inputs(gdn: torch.nn.Module, conv: torch.Tensor, b: torch.Tensor,
                      a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The delta rule's per-head inputs from the conv output [n, C] and the gates b, a [n, HV].

    Returns q, k [n, HV, Dk] (l2-normalised; q also scaled by 1/sqrt(Dk)), v [n, HV, Dv], g (log decay)
    and beta [n, HV], all float32.
    """
    n = conv.shape[0]
    q, k, v = torch.split(conv, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    hv = gdn.num_v_heads
    rep = hv // gdn.num_k_heads
    # The recurrence runs in float32 whatever the model dtype, like transformers' kernels.
    q = q.reshape(n, -1, gdn.head_k_dim).repeat_interleave(rep, dim=1).float()  # [n, HV, Dk]
    k = k.reshape(n, -1, gdn.head_k_dim).repeat_interleave(rep, dim=1).float()  # [n, HV, Dk]
    v = v.reshape(n, hv, gdn.head_v_dim).float()  # [n, HV, Dv]
    q = l2norm(q) / (gdn.head_k_dim**0.5)
    k = l2norm(k)
    beta = b.sigmoid().float()  # [n, HV]
    # A_log and a in float32 so that exp/softplus cannot overflow in half precision.
    g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)  # [n, HV]
    return q, k, v, g, beta


def delta_rule_levels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      plan: TreePlan, recurrent_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence depth level by depth level, each node from its parent's post-state.

    Inputs as :func:`delta_rule_inputs` returns them; recurrent_state: [HV, Dk, Dv]. Returns every
    node's post-state [n, HV, Dk, Dv] and output [n, HV, Dv], float32.
    """
    n, hv, dk = k.shape
    dv = v.shape[-1]
    states = torch.empty(n, hv, dk, dv, dtype=torch.float32, device=q.device)
    core = torch.empty(n, hv, dv, dtype=torch.float32, device=q.device)
    start = recurrent_state.float().unsqueeze(0)  # [1, HV, Dk, Dv], float32 like the whole recurrence
    for idx in plan.levels:
        par = plan.parents[idx]
        prev = torch.where((par >= 0).view(-1, 1, 1, 1), states[par.clamp(min=0)], start)  # [m, HV, Dk, Dv]
        s = prev * g[idx].exp()[..., None, None]
        kt = k[idx]
        kv_mem = (s * kt[..., None]).sum(dim=-2)  # [m, HV, Dv]
        delta = (v[idx] - kv_mem) * beta[idx][..., None]
        s = s + kt[..., None] * delta[..., None, :]
        states[idx] = s
        core[idx] = (s * q[idx][..., None]).sum(dim=-2)
    return states, core


def gated_output(gdn: torch.nn.Module, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gated norm and output projection of the recurrence's output core [n, HV, Dv]: hidden [n, H]."""
    n = core.shape[0]
    # Back in the model dtype: the norm and the projection run in it, as transformers' layer does.
    core = core.to(dtype).reshape(-1, gdn.head_v_dim)  # [n, HV, Dv] -> [n*HV, Dv]
    out = gdn.norm(core, z.reshape(-1, gdn.head_v_dim)).reshape(n, -1)  # [n, HV*Dv]
    return gdn.out_proj(out)
