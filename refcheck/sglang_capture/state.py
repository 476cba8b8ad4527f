"""SGLang's KV and mamba pools -> the committed state of one request after a step, in refcheck's layouts.

Contract: :func:`committed_rows` takes per-layer views of SGLang's pools (the caller resolves them:
``kv`` maps a global layer id to that layer's K and V buffers ``[slots_total, H_kv, D]``; ``mamba``
maps a global layer id to its conv buffer ``[mamba_slots, conv_dim, K-1]`` (or ``[..., K-1,
conv_dim]`` when ``conv_window_axis`` is 0) and SSM buffer ``[mamba_slots, HV, V, K]``), the token
slots of the KV rows the step appended, and the request's mamba slot. It returns name -> (layer,
kind, rows) with the same names and row layouts as :func:`refcheck.sketch.state_rows`:
``kv_k.L``/``kv_v.L`` ``[a, H_kv*D]``, ``conv.L`` ``[K-1, conv_dim]``, ``rec.L`` ``[HV, K*V]``.
:func:`summarise` turns rows into trace entries (seeded sketch, optional full copy). Under tensor
parallelism :func:`summarise_shard` sketches a rank's slice with the full tensor's projection rows and
:func:`combine_shards` adds (feature-split KV and conv) or stacks (row-split SSM) the ranks' sketches.
"""

from __future__ import annotations

import torch

from refcheck.sglang_capture.layout import conv_to_reference, ssm_to_reference
from refcheck.sketch import sketch_rows, sketch_slice


def committed_rows(kv: dict[int, tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor,
                   mamba: dict[int, tuple[torch.Tensor, torch.Tensor]], mamba_slot: int | None,
                   conv_window_axis: int = -1) -> dict[str, tuple[int, str, torch.Tensor]]:
    rows: dict[str, tuple[int, str, torch.Tensor]] = {}
    idx = slots.long()
    for layer, (k_buf, v_buf) in sorted(kv.items()):
        for kind, buf in (("kv_k", k_buf), ("kv_v", v_buf)):
            sel = buf[idx.to(buf.device)]  # [a, H_kv, D]
            rows[f"{kind}.{layer}"] = (layer, kind, sel.reshape(sel.shape[0], -1))  # [a, H_kv*D]
    if mamba and mamba_slot is None:
        raise ValueError("a hybrid model's state needs the request's mamba slot")
    for layer, (conv_buf, ssm_buf) in sorted(mamba.items()):
        conv = conv_buf[mamba_slot]
        conv = conv_to_reference(conv) if conv_window_axis in (-1, conv.dim() - 1) else conv  # [K-1, conv_dim]
        rec = ssm_to_reference(ssm_buf[mamba_slot])  # [HV, V, K] -> [HV, K, V]
        rows[f"conv.{layer}"] = (layer, "conv", conv)
        rows[f"rec.{layer}"] = (layer, "rec", rec.reshape(rec.shape[0], -1))  # [HV, K*V]
    return rows


def summarise(rows: dict[str, tuple[int, str, torch.Tensor]], full: bool) -> dict[str, tuple[int, str, torch.Tensor, torch.Tensor | None]]:
    """name -> (layer, kind, sketch [rows, r] float32 on the CPU, full rows on the CPU or None)."""
    return {name: (layer, kind, sketch_rows(t), t.detach().cpu().clone() if full else None)
            for name, (layer, kind, t) in rows.items()}


# -- tensor parallelism ----------------------------------------------------------------------------------
# With TP, each rank holds a slice of every state: KV heads (contiguous blocks), SSM value heads (rows),
# conv channels ([q_r, k_r, v_r] of the full [q, k, v]). Sketches are linear, so a rank can sketch its
# slice with the *full* tensor's projection rows for the features it holds; the full sketch is then the
# sum of the ranks' partial sketches (features split) or their concatenation (rows split).

def feature_index(kind: str, local_features: int, tp_rank: int, tp_size: int,
                  conv_groups: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """Positions of a rank's local features in the full feature axis; None for row-split kinds."""
    if kind == "rec":
        return None
    if kind in ("kv_k", "kv_v"):
        return torch.arange(tp_rank * local_features, (tp_rank + 1) * local_features)
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


def summarise_shard(rows: dict[str, tuple[int, str, torch.Tensor]], tp_rank: int, tp_size: int,
                    conv_groups: tuple[int, ...] | None, full: bool) -> dict[str, tuple[int, str, torch.Tensor, torch.Tensor | None]]:
    """A rank's partial sketches (see above) and, when asked, its raw shard."""
    out = {}
    for name, (layer, kind, t) in rows.items():
        idx = feature_index(kind, t.shape[-1], tp_rank, tp_size, conv_groups)
        if idx is None:
            sk = sketch_rows(t)
        else:
            n_full = t.shape[-1] * tp_size if kind != "conv" else sum(conv_groups)
            sk = sketch_slice(t, idx, n_full)
        out[name] = (layer, kind, sk, t.detach().cpu().clone() if full else None)
    return out


def combine_shards(shards: list[tuple[int, str, torch.Tensor, torch.Tensor | None]],
                   conv_groups: tuple[int, ...] | None = None) -> tuple[int, str, torch.Tensor, torch.Tensor | None]:
    """Ranks' entries (rank order) of one state -> the full entry."""
    from refcheck.sglang_capture.layout import gather_conv_channels

    layer, kind = shards[0][0], shards[0][1]
    if kind == "rec":
        sketch = torch.cat([s[2] for s in shards], dim=0)
        full = torch.cat([s[3] for s in shards], dim=0) if shards[0][3] is not None else None
    else:
        sketch = torch.stack([s[2] for s in shards]).sum(0)
        full = None
        if shards[0][3] is not None:
            parts = [s[3] for s in shards]
            full = (gather_conv_channels(parts, conv_groups[0], conv_groups[2], dim=-1) if kind == "conv"
                    else torch.cat(parts, dim=-1))
    return layer, kind, sketch, full
