"""SGLang's KV and mamba pools -> the committed state of one request after a step, in refcheck's layouts.

Contract: :func:`committed_rows` takes per-layer views of SGLang's pools (the caller resolves them:
``kv`` maps a global layer id to that layer's K and V buffers ``[slots_total, H_kv, D]``; ``mamba``
maps a global layer id to its conv buffer ``[mamba_slots, conv_dim, K-1]`` (or ``[..., K-1,
conv_dim]`` when ``conv_window_axis`` is 0) and SSM buffer ``[mamba_slots, HV, V, K]``), the token
slots of the KV rows the step appended, and the request's mamba slot. It returns name -> (layer,
kind, rows) with the same names and row layouts as :func:`refcheck.sketch.state_rows`:
``kv_k.L``/``kv_v.L`` ``[a, H_kv*D]``, ``conv.L`` ``[K-1, conv_dim]``, ``rec.L`` ``[HV, K*V]``.
:func:`summarise` turns rows into trace entries (seeded sketch, optional full copy).
"""

from __future__ import annotations

import torch

from refcheck.runners.sglang_layout import conv_to_reference, ssm_to_reference
from refcheck.sketch import sketch_rows


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
