"""Gated DeltaNet over a draft tree as ONE chunk of the chunked (UT / WY) delta rule.

Contract
========

Inputs (all for ``n`` tree nodes, already projected, convolved, l2-normalised and, for ``q``,
scaled by ``1 / sqrt(Dk)``, exactly as in :func:`ddtree_reference.layers.deltanet_tree`):

* ``q, k``: ``[n, HV, Dk]``; ``v``: ``[n, HV, Dv]``; ``g`` (log decay, ``<= 0``), ``beta``:
  ``[n, HV]``; ``initial_state`` ``S0``: ``[HV, Dk, Dv]`` (the committed prefix's state). All
  floating tensors share one dtype, float32 (production) or float64 (tests), and one device.
* ``parents``: ``[n]`` integer, topological (``-1 <= parents[t] < t``); ``-1`` = attached to the
  committed prefix. Several nodes may hang from ``-1`` (a forest).

The exact recurrence, from the parent's post-state ``P`` (``S0`` when the parent is ``-1``)::

    S = P * exp(g_t);  kv_mem = S^T k_t;  delta = (v_t - kv_mem) * beta_t
    S_t = S + k_t (x) delta;  o_t = S_t^T q_t

What is computed
----------------
:func:`gated_delta_tree_chunk` evaluates every node at once (per head; heads are a batch dim).
With ``A`` the ancestor-or-self mask (``A[i, j]`` iff ``j`` is on the root path of ``i``,
``i`` included), ``cum = A @ g`` (the log decay summed along each root path) and
``D[i, j] = exp(cum_i - cum_j)`` on ``A`` (0 elsewhere)::

    T = I + strict_lower(A) * (k_beta @ k^T) * D              (unit lower triangular)
    u = T^-1 v_beta - T^-1 (k_beta * exp(cum)) @ S0           (the per-node delta, "v_new")
    o = (q * exp(cum)) @ S0 + ((q @ k^T) * D) @ u
    S_t = exp(cum_t) S0 + sum_{j in anc-or-self(t)} D[t, j] k_j (x) u_j

This is the chain-chunk algorithm of transformers' ``torch_chunk_gated_delta_rule`` with the
causal mask replaced by the ancestor mask; topological order keeps ``T`` unit lower triangular,
so the only sequential step is one triangular solve. Decay differences are masked in log space
before ``exp`` so that non-ancestor pairs (whose difference may be large and positive) never
overflow. Per-node states are produced lazily by :meth:`TreeChunk.state` /
:meth:`TreeChunk.states`.

:func:`gated_delta_tree_levels` is the slow exact oracle: the recurrence above evaluated depth
level by depth level (the same math as ``ddtree_reference.layers.deltanet_tree``'s loop).

Results are in the inputs' dtype and on their device. Bad shapes, dtypes or parents raise
:class:`ValueError`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = [
    "TreeChunk",
    "ancestor_matrix",
    "gated_delta_tree_chunk",
    "gated_delta_tree_levels",
    "path_cumsum",
]

_FLOAT_DTYPES = (torch.float32, torch.float64)


# ------------------------------------------------------------------------------------- validation
_VALIDATE = [True]  # value checks read tensors on the host: off while a CUDA graph is captured


@contextmanager
def unchecked():
    """Skip the host-side value checks of parents (they synchronise the device; graphs forbid it)."""
    before = _VALIDATE[0]  # re-entrant: a nested use leaves the outer one's setting in force
    _VALIDATE[0] = False
    try:
        yield
    finally:
        _VALIDATE[0] = before


def checks_enabled() -> bool:
    """False inside :func:`unchecked` (a forward that must not read the device on the host)."""
    return _VALIDATE[0]


def _check_parents(parents: torch.Tensor) -> torch.Tensor:
    """Validate a topological parent vector; return it as int64 (same device)."""
    if not isinstance(parents, torch.Tensor) or parents.dim() != 1:
        shape = tuple(getattr(parents, "shape", ()))
        raise ValueError(f"parents must be a 1-d tensor [n], got shape {shape}")
    if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
        raise ValueError(f"parents must have an integer dtype, got {parents.dtype}")
    # int64 so that it can be used directly as an index tensor.
    parents = parents.to(torch.int64)
    n = parents.shape[0]
    if n and _VALIDATE[0]:
        idx = torch.arange(n, device=parents.device)
        bad = (parents < -1) | (parents >= idx)
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                "parents must satisfy -1 <= parents[t] < t (topological order); "
                f"parents[{t}] = {int(parents[t])}"
            )
    return parents


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[int, int, int, int, torch.Tensor]:
    """Shape/dtype checks shared by the chunk and the levels evaluators. Returns (n, HV, Dk, Dv, parents)."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [n, HV, Dk], got shape {tuple(q.shape)}")
    n, hv, dk = q.shape
    if v.dim() != 3:
        raise ValueError(f"v must be [n, HV, Dv], got shape {tuple(v.shape)}")
    dv = v.shape[-1]
    expected = {
        "q": (n, hv, dk),
        "k": (n, hv, dk),
        "v": (n, hv, dv),
        "g": (n, hv),
        "beta": (n, hv),
        "initial_state": (hv, dk, dv),
    }
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(named[name].shape)}")
    dtype = q.dtype
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"inputs must be float32 or float64, got {dtype}")
    for name, x in named.items():
        if x.dtype != dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, expected {dtype} like q")
    parents = _check_parents(parents)
    if parents.shape[0] != n:
        raise ValueError(f"parents must have shape ({n},), got {tuple(parents.shape)}")
    return n, hv, dk, dv, parents.to(q.device)


# ------------------------------------------------------------------------------------ tree algebra
def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask ``A[i, j]`` = node ``j`` lies on the root path of node ``i`` (``i`` included).

    parents: [n] integer, topological (``-1 <= parents[t] < t``). Returns [n, n] bool on the same
    device, lower triangular with a true diagonal. Built by pointer doubling: after round ``r``
    row ``i`` holds the ancestors at distance ``< 2^r``; ``ceil(log2 n)`` rounds of row gathers.
    """
    parents = _check_parents(parents)
    n = parents.shape[0]
    device = parents.device
    anc = torch.eye(n, dtype=torch.bool, device=device)  # [n, n] distance < 1
    if n == 0:
        return anc
    # A row of all-false at index n stands for "no ancestor": jump[i] == n means off the tree.
    pad = torch.zeros(1, n, dtype=torch.bool, device=device)  # [1, n]
    jump = torch.where(parents >= 0, parents, torch.full_like(parents, n))  # [n] ancestor at 2^r
    rounds = max(1, (n - 1).bit_length())  # depth <= n - 1 < 2^rounds
    for _ in range(rounds):
        rows = torch.cat([anc, pad], dim=0)  # [n + 1, n]
        anc = anc | rows[jump]  # [n, n] distance < 2^(r+1)
        jump_pad = torch.cat([jump, jump.new_full((1,), n)])  # [n + 1]
        jump = jump_pad[jump]  # [n] ancestor at distance 2^(r+1)
    return anc


def path_cumsum(g: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Log decay summed along each node's root path: ``cum[t] = sum_{j in anc-or-self(t)} g[j]``.

    g: [n, HV] float; parents: [n]. Returns cum [n, HV] in g's dtype (a node attached to -1 has
    ``cum = g``: the committed prefix contributes 0).
    """
    if not isinstance(g, torch.Tensor) or g.dim() != 2 or not g.dtype.is_floating_point:
        raise ValueError(f"g must be a floating [n, HV] tensor, got shape {tuple(getattr(g, 'shape', ()))}")
    parents = _check_parents(parents)
    if parents.shape[0] != g.shape[0]:
        raise ValueError(f"parents has {parents.shape[0]} nodes but g has {g.shape[0]}")
    anc = ancestor_matrix(parents.to(g.device))
    # The bool mask becomes g's dtype so the path sum is one matmul.
    return anc.to(g.dtype) @ g  # [n, n] @ [n, HV] -> [n, HV]


# ------------------------------------------------------------------------------------------ chunk
@dataclass
class TreeChunk:
    """Result of :func:`gated_delta_tree_chunk`.

    ``out`` [n, HV, Dv]: every node's output ``S_t^T q_t``. Per-node post-states are rebuilt on
    demand from the chunk factors (``state(t)`` [HV, Dk, Dv], ``states()`` [n, HV, Dk, Dv]).
    ``ancestors`` [n, n] bool and ``cum`` [n, HV] (root-path log decay) are kept for inspection.
    """

    out: torch.Tensor  # [n, HV, Dv]
    ancestors: torch.Tensor  # [n, n] bool, ancestor-or-self
    cum: torch.Tensor  # [n, HV]
    _decay: torch.Tensor = field(repr=False)  # [HV, n, n] exp(cum_i - cum_j) on ancestors-or-self, else 0
    _k: torch.Tensor = field(repr=False)  # [HV, n, Dk]
    _v_new: torch.Tensor = field(repr=False)  # [HV, n, Dv] per-node delta u
    _initial_state: torch.Tensor = field(repr=False)  # [HV, Dk, Dv]

    @property
    def num_nodes(self) -> int:
        return self.out.shape[0]

    def state(self, node: int) -> torch.Tensor:
        """Post-state of ``node`` (0 <= node < n): [HV, Dk, Dv]."""
        n = self.num_nodes
        if not 0 <= int(node) < n:
            raise IndexError(f"node {node} out of range for a tree of {n} nodes")
        return self.state_at(torch.tensor(int(node), device=self.cum.device))

    def state_at(self, node: torch.Tensor) -> torch.Tensor:
        """Post-state of the node a device scalar names: [HV, Dk, Dv]. Like :meth:`state`, without
        reading the index on the host (CUDA-graph capture); the caller guarantees 0 <= node < n."""
        at = node.view(1)
        w = self._decay.index_select(1, at)[:, 0, :]  # [HV, n] weights of every node's update in this node's state
        carry = self.cum.index_select(0, at)[0].exp()[:, None, None] * self._initial_state  # [HV, Dk, Dv]
        return carry + (self._k * w[..., None]).transpose(-1, -2) @ self._v_new  # [HV, Dk, n] @ [HV, n, Dv]

    def states(self) -> torch.Tensor:
        """Post-states of all nodes: [n, HV, Dk, Dv] (materialises n * HV * Dk * Dv values)."""
        decay = self._decay.transpose(0, 1)  # [n, HV, n]: row t weighs every node's update in S_t
        weighted_k = self._k.transpose(-1, -2)[None] * decay[:, :, None, :]  # [n, HV, Dk, n]
        upd = weighted_k @ self._v_new[None]  # [n, HV, Dk, n] @ [1, HV, n, Dv] -> [n, HV, Dk, Dv]
        # In place: the decayed initial state is added without another [n, HV, Dk, Dv] temporary.
        return upd.addcmul_(self.cum.exp()[..., None, None], self._initial_state)  # [n, HV, Dk, Dv]


def gated_delta_tree_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    ancestors: torch.Tensor | None = None,
) -> TreeChunk:
    """All tree nodes as one chunk of the chunked gated delta rule (see the module docstring).

    q, k: [n, HV, Dk]; v: [n, HV, Dv]; g, beta: [n, HV]; parents: [n] (-1 = committed);
    initial_state: [HV, Dk, Dv]. Same float dtype (float32 / float64) for all floating inputs.
    ancestors: ``ancestor_matrix(parents)`` [n, n] bool when the caller has it already (a forward
    computes it once for all its layers); not re-derived or checked against ``parents``.
    """
    n, _, _, _, parents = _check_inputs(q, k, v, g, beta, parents, initial_state)
    if ancestors is not None and tuple(ancestors.shape) != (n, n):
        raise ValueError(f"ancestors must have shape ({n}, {n}), got {tuple(ancestors.shape)}")
    anc = ancestor_matrix(parents) if ancestors is None else ancestors  # [n, n]
    # The bool mask becomes the compute dtype so the root-path sum is one matmul.
    cum = anc.to(g.dtype) @ g  # [n, HV]

    # Heads as the batch dim of every matmul.
    qh = q.transpose(0, 1)  # [HV, n, Dk]
    kh = k.transpose(0, 1)  # [HV, n, Dk]
    vh = v.transpose(0, 1)  # [HV, n, Dv]
    bh = beta.T[..., None]  # [HV, n, 1]
    ch = cum.T  # [HV, n]
    decay = _path_decay(ch, anc)  # [HV, n, n]
    v_new, out = _solve_chunk(qh, kh, vh, bh, ch, decay, initial_state)
    return TreeChunk(
        out=out,
        ancestors=anc,
        cum=cum,
        _decay=decay,
        _k=kh,
        _v_new=v_new,
        _initial_state=initial_state,
    )


def _path_decay(ch: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """D[h, i, j] = exp(cum_i - cum_j) for j ancestor-or-self of i, else 0: [HV, n, n] from ch [HV, n]."""
    # Masked in log space before exp (a non-ancestor pair can have a large positive difference that would overflow).
    log_decay = (ch[:, :, None] - ch[:, None, :]).masked_fill(~anc, float("-inf"))  # [HV, n, n]
    return log_decay.exp()  # [HV, n, n]


def _solve_chunk(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, bh: torch.Tensor, ch: torch.Tensor,
                 decay: torch.Tensor, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The UT system and the outputs, heads first (q, k [HV, n, Dk], v [HV, n, Dv], beta [HV, n, 1], cum
    [HV, n], decay [HV, n, n]). Returns the per-node delta u [HV, n, Dv] and the outputs [n, HV, Dv]."""
    hv, n, dk = kh.shape
    dv = vh.shape[-1]
    k_beta = kh * bh  # [HV, n, Dk]
    v_beta = vh * bh  # [HV, n, Dv]
    # The beta-keys and the queries against every key, one batched matmul (rows n.. are the queries').
    scores = (torch.cat([k_beta, qh], dim=1) @ kh.transpose(-1, -2)).view(hv, 2, n, n)  # [HV, 2n, n] -> [HV, 2, n, n]
    # Unit lower-triangular UT system; the diagonal is never read (unitriangular=True) and the
    # upper triangle is zero because ancestors have smaller indices.
    system, attn = (scores * decay[:, None]).unbind(1)  # [HV, n, n] each
    rhs = torch.cat([v_beta, k_beta * ch.exp()[..., None]], dim=-1)  # [HV, n, Dv + Dk]
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [HV, n, Dv + Dk]
    new_values, k_cumdecay = sol.split([dv, dk], dim=-1)  # [HV, n, Dv], [HV, n, Dk]

    # What the committed state gives the keys' UT rows and the queries, one batched matmul.
    from_state = torch.cat([k_cumdecay, qh * ch.exp()[..., None]], dim=1) @ initial_state  # [HV, 2n, Dv]
    v_new = new_values - from_state[:, :n]  # [HV, n, Dv]
    inter = from_state[:, n:]  # [HV, n, Dv]
    intra = attn @ v_new  # [HV, n, n] @ [HV, n, Dv]
    return v_new, (inter + intra).transpose(0, 1).contiguous()  # [n, HV, Dv]


# ----------------------------------------------------------------------------------------- oracle
def gated_delta_tree_levels(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow exact oracle: the recurrence depth level by depth level.

    Same inputs as :func:`gated_delta_tree_chunk`. Returns (out [n, HV, Dv], states [n, HV, Dk, Dv]).
    """
    n, hv, dk, dv, parents = _check_inputs(q, k, v, g, beta, parents, initial_state)
    par = parents.cpu()
    depth = torch.zeros(n, dtype=torch.long)
    for t in range(n):
        depth[t] = 0 if par[t] < 0 else depth[par[t]] + 1
    max_depth = int(depth.max()) if n else -1
    levels = [torch.nonzero(depth == d).flatten().to(q.device) for d in range(max_depth + 1)]

    states = torch.empty(n, hv, dk, dv, dtype=q.dtype, device=q.device)
    out = torch.empty(n, hv, dv, dtype=q.dtype, device=q.device)
    start = initial_state.unsqueeze(0)  # [1, HV, Dk, Dv]
    for idx in levels:
        p = parents[idx]
        prev = torch.where((p >= 0).view(-1, 1, 1, 1), states[p.clamp(min=0)], start)  # [m, HV, Dk, Dv]
        s = prev * g[idx].exp()[..., None, None]
        kt = k[idx]  # [m, HV, Dk]
        kv_mem = (s * kt[..., None]).sum(dim=-2)  # [m, HV, Dv]
        delta = (v[idx] - kv_mem) * beta[idx][..., None]
        s = s + kt[..., None] * delta[..., None, :]
        states[idx] = s
        out[idx] = (s * q[idx][..., None]).sum(dim=-2)
    return out, states
