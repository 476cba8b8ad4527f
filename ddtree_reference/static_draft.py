"""A DFlash drafter's context in fixed-size buffers: the draft step that a CUDA graph can capture.

Contract: :class:`StaticDraftContext` holds, per draft layer, the context keys and values in
buffers of shape ``[Hkv, capacity, D]``. The number of context tokens is a device scalar; slots at
or past it are masked out of attention.

- :meth:`StaticDraftContext.propose` drafts the full block ``[bonus, MASK × (block_size - 1)]``.
  The bonus and the start position are device scalars.
- :meth:`StaticDraftContext.extend` appends a fixed number of rows and advances the length by a
  device count. Rows past the count are scratch, masked out and overwritten later.

Neither method reads anything back to the host. Both reuse the drafter's own computations
(``DFlashDrafter.context_kv`` / ``block_hidden`` / ``logits_of``). They equal ``DFlashDrafter.propose`` /
``extend`` for full blocks; ``tests/test_static.py`` checks this on CPU, step after step of a
decode. Shorter last blocks (z-lab's convention near ``max_new_tokens``) stay with the eager
drafter.
"""

from __future__ import annotations

import torch

from ddtree_reference.drafter import DFlashDrafter
from ddtree_reference.errors import PromptError


class StaticDraftContext:
    def __init__(self, drafter: DFlashDrafter, capacity: int) -> None:
        dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.drafter = drafter
        self.capacity = capacity
        self.keys = [torch.zeros(drafter.n_kv, capacity, drafter.head_dim, dtype=dtype, device=dev)
                     for _ in drafter.layers]  # per layer [Hkv, capacity, D]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.length = torch.zeros((), dtype=torch.long, device=dev)  # context tokens
        self._slots = torch.arange(capacity, device=dev)  # [capacity]
        bs = drafter.block_size
        self._offsets = torch.arange(bs, device=dev)  # [bs]
        self._block = torch.full((bs,), drafter.mask_token_id, dtype=torch.long, device=dev)  # [bs]

    @classmethod
    def from_drafter(cls, drafter: DFlashDrafter, capacity: int) -> StaticDraftContext:
        """The drafter's current (eager) context copied into fixed-size buffers."""
        if capacity < drafter.ctx_len:
            raise PromptError(f"capacity {capacity} is below the drafter's context of {drafter.ctx_len} tokens")
        out = cls(drafter, capacity)
        for i, (k, v) in enumerate(zip(drafter.ctx_keys, drafter.ctx_values)):
            if k is not None:
                out.keys[i][:, : k.shape[1]] = k
                out.values[i][:, : v.shape[1]] = v
        out.length.fill_(drafter.ctx_len)
        return out

    def snapshot(self) -> torch.Tensor:
        """What a step changes that is not scratch: the length (to undo warm-up or capture runs)."""
        return self.length.clone()

    def restore(self, snap: torch.Tensor) -> None:
        self.length.copy_(snap)

    @torch.no_grad()
    def extend(self, context: torch.Tensor, positions: torch.Tensor, count: torch.Tensor) -> None:
        """Write the context rows of target hidden states [m, len(target_layer_ids)*H] at
        ``positions`` [m] into slots ``length ..``; the first ``count`` ([] device) become context."""
        slots = self.length + torch.arange(context.shape[0], device=self.length.device)  # [m]
        for i, (k, v) in enumerate(self.drafter.context_kv(context, positions)):
            self.keys[i][:, slots] = k
            self.values[i][:, slots] = v
        self.length.add_(count)

    @torch.no_grad()
    def propose(self, bonus: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Log-probs [block_size - 1, V] float32 for the full block after ``bonus`` at ``start``
        (both [] int64 device scalars)."""
        ids = torch.where(self._offsets == 0, bonus, self._block)  # [bs]: the bonus, then masks
        valid = self._slots < self.length  # [capacity]
        context = list(zip(self.keys, self.values))
        h = self.drafter.block_hidden(ids, start + self._offsets, context, valid)  # [bs, H]
        return torch.log_softmax(self.drafter.logits_of(h[1:]), dim=-1)
