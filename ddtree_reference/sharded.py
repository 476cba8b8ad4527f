"""The reference target split by layers over the ranks of a torch.distributed process group.

Contract: :class:`PipelineTarget` wraps a loaded :class:`~ddtree_reference.target.Target` on every rank of
an initialised process group (gloo on CPUs, NCCL on GPUs). Rank r owns a contiguous block of layers
(:func:`split_layers`) and keeps only their KV / conv / recurrent state (other layers' entries are
None); the hidden states of a forward travel rank to rank (point-to-point), the last rank computes
the logits, and every rank receives the logits and the drafter's captured layer outputs (broadcast).
Everything above the target (drafter, tree builder, walk, commit bookkeeping) runs identically on
every rank, SPMD, so a :class:`~ddtree_reference.decode.DDTreeDecoder` over a PipelineTarget behaves like
one over the whole model: the same per-layer operations run on the same inputs, so fp32 results are
bit-identical to one process on the same device type.

Why layers and not heads: the reference's exactness lives inside each layer (ancestor-masked
attention, the tree-chunk delta rule, per-node conv windows); splitting by layers leaves every one
of those computations whole, and costs one [n, H] transfer per rank boundary per forward. Splitting
by heads would cut each of them and add two all-reduces per layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddtree_reference.fused import UNFUSED
from ddtree_reference.state import TargetState
from ddtree_reference.target import Target


def split_layers(n_layers: int, world: int) -> list[range]:
    """Contiguous, balanced layer blocks, one per rank (earlier ranks take the remainder)."""
    if world < 1 or world > n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {world} ranks")
    base, extra = divmod(n_layers, world)
    out, lo = [], 0
    for r in range(world):
        hi = lo + base + (1 if r < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


class PipelineTarget(Target):
    def __init__(self, target: Target, group: dist.ProcessGroup | None = None) -> None:
        self.__dict__.update(target.__dict__)  # share the loaded model; only this rank's layers run
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.blocks = split_layers(len(self.layers), self.world)
        self.mine = self.blocks[self.rank]

    def local_layers(self) -> range:
        return self.mine

    def release_foreign_layers(self) -> None:
        """Free the weights of layers other ranks evaluate (moved to the meta device); the embedding
        and head stay, since the drafter borrows them on every rank. Their fused projection weights
        (:meth:`Target.compile`) are dropped too: the modules' weights are views of them."""
        self.fusions = list(self.fusions)  # this rank's own: the wrapped target keeps its list
        for i, layer in enumerate(self.layers):
            if i not in self.mine:
                layer.to("meta")
                self.fusions[i] = UNFUSED

    def empty_state(self) -> TargetState:
        full = super().empty_state()
        for i in range(len(self.layers)):
            if i not in self.mine:
                full.keys[i] = full.values[i] = full.conv[i] = full.recurrent[i] = None
        return full

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _stage_input(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return super()._stage_input(tokens)
        h = torch.empty(tokens.shape[0], self.hidden_size, dtype=self.dtype, device=self.device)  # [n, H]
        dist.recv(h, src=self._global(self.rank - 1), group=self.group)
        return h

    def _layer_ids(self) -> range:
        return self.mine

    def _stage_logits(self, h: torch.Tensor) -> torch.Tensor:
        last = self.world - 1
        if self.rank < last:
            dist.send(h.contiguous(), dst=self._global(self.rank + 1), group=self.group)
            logits = torch.empty(h.shape[0], self.vocab_size, dtype=torch.float32, device=self.device)  # [n, V]
        else:
            logits = super()._stage_logits(h)
        dist.broadcast(logits, src=self._global(last), group=self.group)
        return logits

    def _layer_output(self, layer: int, held: dict[int, torch.Tensor], n: int) -> torch.Tensor:
        """Layer ``layer``'s output [n, H] on every rank (broadcast by the rank that computed it)."""
        owner = next(r for r, b in enumerate(self.blocks) if layer in b)
        t = held[layer].contiguous() if owner == self.rank else torch.empty(n, self.hidden_size, dtype=self.dtype,
                                                                           device=self.device)
        dist.broadcast(t, src=self._global(owner), group=self.group)
        return t
