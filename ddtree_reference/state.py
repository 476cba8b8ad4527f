"""Committed target state: attention KV and Gated DeltaNet conv/recurrent state, per layer.

Contract: a :class:`TargetState` is immutable in spirit: ``commit`` returns a new state and never
modifies the tensors of the old one, so a caller can keep the state before a step (the per-path
oracle and replay diffs fork from it freely). ``commit`` appends the accepted nodes' KV **in path
order** and takes the conv window and recurrent state of the **last accepted node** (not of the
flat index ``len(path) - 1``).

Layouts per layer: keys/values [Hkv, P, D] (attention layers, else None); conv [K-1, C] and
recurrent [HV, Dk, Dv] float32 (Gated DeltaNet layers, else None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class TreeForward:
    """What one target forward over n nodes produced (everything the commit and diffs need)."""

    logits: torch.Tensor  # [n, V] float32
    context: torch.Tensor  # [n, len(capture)*H] hidden states after the drafter's target layers
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, n, D]
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, n, D]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, K-1, C]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, HV, Dk, Dv]
    layer_outputs: list[torch.Tensor] | None = None  # per layer [n, H], only when asked for
    visible: torch.Tensor | None = None  # [n, n] bool: the attention mask used (the tree's ancestor-or-self)


@dataclass(slots=True)
class TargetState:
    length: int  # committed tokens (the next token's position)
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]

    def commit(self, fwd: TreeForward, path: list[int]) -> TargetState:
        """State after accepting ``path`` (node indices, root first) of ``fwd``'s nodes."""
        if not path:
            return self
        idx = torch.tensor(path, dtype=torch.long, device=fwd.logits.device)
        last = path[-1]
        keys, values, conv, rec = list(self.keys), list(self.values), list(self.conv), list(self.recurrent)
        for layer, k in fwd.keys.items():
            keys[layer] = torch.cat([self.keys[layer], k[:, idx]], dim=1)  # [Hkv, P+len(path), D]
            values[layer] = torch.cat([self.values[layer], fwd.values[layer][:, idx]], dim=1)
        for layer, c in fwd.conv.items():
            conv[layer] = c[last].clone()
            rec[layer] = fwd.recurrent[layer][last].clone()
        return TargetState(self.length + len(path), keys, values, conv, rec)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor view for diffs and traces (``kv.3.k``, ``conv.0``, ``rec.0``)."""
        out: dict[str, torch.Tensor] = {}
        for i, (k, v, c, r) in enumerate(zip(self.keys, self.values, self.conv, self.recurrent)):
            if k is not None:
                out[f"kv.{i}.k"], out[f"kv.{i}.v"] = k, v
            if c is not None:
                out[f"conv.{i}"], out[f"rec.{i}"] = c, r
        return out
