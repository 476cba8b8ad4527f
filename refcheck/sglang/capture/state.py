"""SGLang's KV and mamba pools -> the committed state of a batch's requests after a step, sketched on the device.

Contract: :func:`batch_state` takes views of SGLang's pools (the caller resolves them: ``kv`` maps a global
layer id to that layer's K and V buffers ``[slots_total, H_kv, D]``; ``mamba`` (:class:`MambaPools`) holds the
stacked conv buffers ``[L, mamba_slots, conv_dim, K-1]`` (or ``[..., K-1, conv_dim]`` when
``conv_window_axis``, SGLang's axis of the window in one slot's state, is 0) and SSM buffers ``[L,
mamba_slots, HV, V, K]`` as SGLang keeps them, so every linear-attention layer is gathered and sketched in one
operation each), the token slots ``[b, W]`` of the KV rows each request's step may have appended (W = the
step's widest possible commit) and the requests' mamba slots ``[b]``. Everything stays on the pools' device
(gathers and projections, no host copy). Every entry is sketched as :func:`refcheck.sketch.state_sketch`
does it, each row by its own projection: KV entries are name -> (layer, kind, row sketches ``[b, W, r]``
float32, full rows ``[b, W, F]`` or None), summed on the host over the request's accepted rows (the rows past
them dropped); the mamba part keeps the layers stacked with the rows already summed, ``conv`` and ``rec``
``[L, b, r]``. :func:`request_state` turns both into one request's entries, sketches ``[1, r]``, with the
names and row layouts of :func:`refcheck.sketch.state_rows`: ``kv_k.L``/``kv_v.L`` ``[a, H_kv*D]``,
``conv.L`` ``[K-1, conv_dim]``, ``rec.L`` ``[HV, K*V]``. The recurrent state is sketched in SGLang's own
``[V, K]`` order with each head's projection rows permuted to match (the same linear map as the reference
layout's, without transposing the state). Under tensor parallelism (``shard``) a rank sketches its slice
with the full tensor's projections of the features and heads it holds, and :func:`combine_shards` adds the
ranks' sketches (and joins their full rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from refcheck.sglang.capture.long_product import long_product
from refcheck.sglang.layout import conv_to_reference, ssm_to_reference
from refcheck.sglang.vocab_rows import by_row_chunks
from refcheck.sketch import SKETCH_DIM, row_projections

#: name -> (layer, kind, sketch, full rows or None)
Entry = tuple[int, str, torch.Tensor, "torch.Tensor | None"]


@lru_cache(maxsize=64)
def _ssm_projection(heads: int, k: int, v: int, device: str) -> torch.Tensor:
    """Each head's projection of its ``[K*V]`` reference row, reordered for SGLang's ``[V*K]`` rows."""
    p = row_projections(k * v, heads, SKETCH_DIM, "cpu")  # [HV, K*V, r]
    return p.view(heads, k, v, -1).transpose(1, 2).reshape(heads, v * k, -1).to(device)  # [HV, K, V, r] -> [HV, V*K, r]


#: (tp rank, tp size, conv groups, KV replicas) of a rank's shard under tensor parallelism: with more ranks than the
#: target has KV heads, SGLang gives each rank one head, held by ``KV replicas`` consecutive ranks
Shard = tuple[int, int, "tuple[int, ...] | None", int]


def _projections(kind: str, rows: int, local: int, shard: Shard | None, device: str) -> torch.Tensor:
    """Row ``w``'s projection for ``w < rows`` of one kind's ``local``-wide rows, [rows, F_local, r]: the full
    tensor's projection rows of the features a rank holds under TP (built once per device)."""
    if shard is None:
        return row_projections(local, rows, SKETCH_DIM, device)
    return _shard_projections(kind, rows, local, *shard, device)


@lru_cache(maxsize=256)
def _shard_projections(kind: str, rows: int, local: int, rank: int, size: int, groups: tuple[int, ...] | None,
                       replicas: int, device: str) -> torch.Tensor:
    idx = feature_index(kind, local, rank, size, groups, replicas)
    if kind in ("kv_k", "kv_v"):
        n_full = local * (size // replicas)
        if rank % replicas:  # a replica of a head another rank sketches: it adds nothing to the sum
            return torch.zeros(rows, local, SKETCH_DIM, device=device)
    else:
        n_full = local * size if kind != "conv" else sum(groups or ())
    return row_projections(n_full, rows, SKETCH_DIM, "cpu")[:, idx].to(device)  # [rows, F_local, r]


@dataclass(frozen=True)
class MambaPools:
    """SGLang's mamba pools as it keeps them, every linear-attention layer stacked: ``conv`` ``[L, slots, C, K-1]``
    (or ``[L, slots, K-1, C]``), ``ssm`` ``[L, slots, HV, V, K]``; ``layers``: the global layer id of each of the
    ``L`` rows recorded, ``rows``: their rows in the stack."""

    layers: list[int]
    rows: list[int]
    conv: torch.Tensor
    ssm: torch.Tensor
    conv_window_axis: int = -1


def batch_state(kv: dict[int, tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, mamba: MambaPools | None,
                mamba_slots: torch.Tensor | None, full: bool = False, shard: Shard | None = None) -> dict[str, Any]:
    """The module docstring's batch state: ``kv`` name -> entry, and ``mamba``, every linear-attention layer at
    once (:func:`_mamba_state`); ``shard`` = (tp rank, tp size, conv groups, KV replicas) under TP."""
    out: dict[str, Entry] = {}
    b, w = slots.shape
    for layer, (k_buf, v_buf) in sorted(kv.items()):
        idx = slots.reshape(-1).long().to(k_buf.device)  # [b*W]
        for kind, buf in (("kv_k", k_buf), ("kv_v", v_buf)):
            rows = buf[idx].reshape(b, w, -1)  # [b*W, H_kv, D] -> [b, W, H_kv*D]
            proj = _projections(kind, w, rows.shape[-1], shard, str(rows.device))  # [W, F, r]
            # float32: bf16 accumulation would swamp the signal; [W, b, F] @ [W, F, r] -> [W, b, r] -> [b, W, r]
            sketch = torch.bmm(rows.float().transpose(0, 1), proj).transpose(0, 1)
            out[f"{kind}.{layer}"] = (layer, kind, sketch, rows if full else None)
    if mamba is None:
        return {"kv": out, "mamba": None}
    if mamba_slots is None:
        raise ValueError("a hybrid model's state needs the requests' mamba slots")
    return {"kv": out, "mamba": _mamba_state(mamba, mamba_slots, full, shard)}


def _mamba_state(m: MambaPools, mamba_slots: torch.Tensor, full: bool, shard: Shard | None) -> dict[str, Any]:
    """Every recorded layer's conv and recurrent state of the requests: ``conv`` and ``rec`` ``[L, b, r]`` (and their
    rows when ``full``). The conv state in one gather and one projection; the recurrent state (a request's is
    ``HV*V*K`` floats a layer: 3 MiB at Qwen3.6's widths) in row chunks of (layer, request) pairs
    (:func:`_rec_sketch`), so the gathered copy it is projected from stays bounded whatever the batch and depth;
    with ``full`` rows, gathered whole once for both."""
    ms = mamba_slots.long().to(m.conv.device)  # [b]
    every = m.rows == list(range(m.conv.shape[0]))
    picked = None if every else _rows_on(tuple(m.rows), str(m.conv.device))
    conv = m.conv[:, ms] if picked is None else m.conv[picked[:, None], ms[None, :]]  # [L, b, C, K-1]: those rows alone
    # the pool's axis counts in one slot's [conv_dim, K-1] state: -1 or 1 put the window last
    conv = conv_to_reference(conv) if m.conv_window_axis in (-1, 1) else conv  # [L, b, K-1, C]
    layers = (torch.arange(len(m.rows), device=m.ssm.device) if every  # [L]: the recorded layers' rows in the stack
              else _rows_on(tuple(m.rows), str(m.ssm.device)))
    n, b, (hv, v, k) = len(m.rows), int(ms.shape[0]), m.ssm.shape[2:]
    first = shard[0] * hv if shard is not None else 0  # a rank's heads are the full tensor's [rank*HV, (rank+1)*HV)
    rec_proj = _ssm_projection(first + hv, k, v, str(m.ssm.device))[first:]  # [HV, V*K, r]
    slots = ms.to(m.ssm.device)
    rec = m.ssm[layers[:, None], slots[None, :]] if full else None  # [L, b, HV, V, K]: those rows alone, gathered once
    rec_sketch = (_rec_rows_sketch(rec.reshape(n * b, -1), rec_proj) if rec is not None  # [L*b, HV*V*K]
                  else _rec_sketch(m.ssm, layers, slots, rec_proj)).view(n, b, -1)  # [L*b, r] -> [L, b, r]
    conv_proj = _projections("conv", conv.shape[2], conv.shape[3], shard, str(conv.device))  # [K-1, C, r]
    km1, c = conv.shape[2], conv.shape[3]
    # float32: bf16 accumulation would swamp the signal; [L*b, (K-1)*C] @ [(K-1)*C, r] -> [L*b, r] -> [L, b, r]
    conv_sketch = long_product(conv.reshape(n * b, km1 * c).float(), conv_proj.reshape(km1 * c, -1)).view(n, b, -1)
    rec_rows = ssm_to_reference(rec).reshape(n, b, hv, k * v) if rec is not None else None  # [L, b, HV, K*V]
    return {"layers": list(m.layers), "conv": conv_sketch, "rec": rec_sketch,
            "conv_rows": conv if full else None, "rec_rows": rec_rows}


@lru_cache(maxsize=64)
def _rows_on(rows: tuple[int, ...], device: str) -> torch.Tensor:
    """The recorded layers' rows in the pool's stack as an index on ``device``, made once (no host-to-device copy in
    a later call: the state sketch runs inside the engine's step and is captured as a CUDA graph)."""
    return torch.tensor(rows, dtype=torch.long, device=device)


def _rec_sketch(ssm: torch.Tensor, layers: torch.Tensor, slots: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """The recurrent sketches of every (layer, request) pair, layer-major, ``[L*b, r]``: pool rows ``layers`` [L] x
    ``slots`` [b] of ``ssm`` ``[L_pool, slots, HV, V, K]`` through ``proj`` ``[HV, V*K, r]``, one product per row
    chunk of pairs (:func:`refcheck.sglang.vocab_rows.by_row_chunks`, its float32 rows bounded in bytes)."""
    n, b, f = int(layers.shape[0]), int(slots.shape[0]), int(proj.shape[0] * proj.shape[1])

    def rows(li: torch.Tensor, si: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"rec": _rec_rows_sketch(ssm[li, si].reshape(-1, f), proj)}  # [c, HV, V, K] -> [c, HV*V*K]

    pairs_l, pairs_s = layers.repeat_interleave(b), slots.repeat(n)  # [L*b] each, layer-major
    return by_row_chunks(rows, (pairs_l, pairs_s), n * b, f)["rec"]


def _rec_rows_sketch(rows: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Gathered recurrent states ``[c, HV*V*K]`` through ``proj`` ``[HV, V*K, r]``: ``[c, r]``."""
    # float32: bf16 accumulation would swamp the signal; one product over heads and features at once, cut along them
    return long_product(rows.float(), proj.reshape(rows.shape[-1], -1))  # [HV, V*K, r] -> [HV*V*K, r]


def request_state(batch: dict[str, Any], b: int, kv_rows: int) -> dict[str, Entry]:
    """Request ``b``'s entries of a (host) batch state, one per layer and kind with a ``[1, r]`` sketch: its first
    ``kv_rows`` KV rows' sketches summed, its conv and recurrent sketches."""
    out: dict[str, Entry] = {}
    for name, (layer, kind, sketch, rows) in batch["kv"].items():
        out[name] = (layer, kind, sketch[b, :kv_rows].sum(0, keepdim=True), None if rows is None else rows[b, :kv_rows].clone())
    m = batch.get("mamba")
    if m:
        for i, layer in enumerate(m["layers"]):
            for kind in ("conv", "rec"):
                rows = m[f"{kind}_rows"]
                out[f"{kind}.{layer}"] = (layer, kind, m[kind][i, b][None].clone(), None if rows is None else rows[i, b].clone())
    return out


# -- tensor parallelism ----------------------------------------------------------------------------------
# With TP, each rank holds a slice of every state: KV heads (contiguous blocks), SSM value heads (rows),
# conv channels ([q_r, k_r, v_r] of the full [q, k, v]). Sketches are linear, so a rank can sketch its
# slice with the *full* tensor's projections of the features and rows it holds; the full sketch is then
# the sum of the ranks' partial sketches.

def feature_index(kind: str, local_features: int, tp_rank: int, tp_size: int,
                  conv_groups: tuple[int, ...] | None = None, kv_replicas: int = 1) -> torch.Tensor | None:
    """Positions of a rank's local features in the full feature axis; None for row-split kinds. KV heads replicated
    over ``kv_replicas`` consecutive ranks (more ranks than heads) place a rank at its head's position."""
    if kind == "rec":
        return None
    if kind in ("kv_k", "kv_v"):
        head_rank = tp_rank // kv_replicas
        return torch.arange(head_rank * local_features, (head_rank + 1) * local_features)
    if kind == "conv":
        if not conv_groups:
            raise ValueError("conv state under tensor parallelism needs the full sub-block sizes (q, k, v)")
        if sum(g // tp_size for g in conv_groups) != local_features:
            raise ValueError(f"conv groups {conv_groups} over {tp_size} ranks do not give {local_features} channels")
        parts, off = [], 0
        for g in conv_groups:
            share = g // tp_size
            parts.append(torch.arange(off + tp_rank * share, off + (tp_rank + 1) * share))
            off += g
        return torch.cat(parts)
    raise ValueError(f"unknown state kind {kind!r}")


def combine_shards(shards: list[tuple[int, str, torch.Tensor, torch.Tensor | None]],
                   conv_groups: tuple[int, ...] | None = None,
                   kv_replicas: int = 1) -> tuple[int, str, torch.Tensor, torch.Tensor | None]:
    """Ranks' entries (rank order) of one state -> the full entry (a replicated KV head's rows taken once)."""
    from refcheck.sglang.layout import gather_conv_channels

    layer, kind = shards[0][0], shards[0][1]
    sketch = torch.stack([s[2] for s in shards]).sum(0)
    if kind in ("kv_k", "kv_v") and kv_replicas > 1:
        shards = shards[::kv_replicas]
    if kind == "rec":
        full = torch.cat([s[3] for s in shards], dim=0) if shards[0][3] is not None else None
    else:
        full = None
        if shards[0][3] is not None:
            parts = [s[3] for s in shards]
            full = (gather_conv_channels(parts, conv_groups[0], conv_groups[2], dim=-1) if kind == "conv"
                    else torch.cat(parts, dim=-1))
    return layer, kind, sketch, full
