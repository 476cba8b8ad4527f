"""Fixed-shape verify, greedy walk and commit: one reference step that a CUDA graph can capture.

Contract: :class:`StaticState` holds the committed target state in buffers of fixed size. Attention
KV is ``[Hkv, capacity, D]`` per layer, with the committed length as a device scalar (positions at
or past it are masked out of attention). The Gated DeltaNet conv and recurrent state have the same
layout as in :class:`~ddtree_reference.state.TargetState`.

:func:`verify_walk_commit` reads one tree from device tensors of a fixed node count (budget + 1)
and, without reading anything back to the host, does four things:
- runs the target's exact tree-chunk forward over the buffers;
- walks the tree greedily on the device (:func:`device_walk`);
- commits in place: the accepted path's KV written at ``length ..``, the accepted leaf's conv and
  recurrent state copied, and ``length`` advanced;
- returns the step's outputs as device tensors.

One captured graph therefore serves every step whose tree has that node count; the caller copies
each new tree into the graph's input tensors. With a :class:`~ddtree_reference.static_draft.StaticDraftContext`
the same call also extends the drafter's context with the accepted nodes, so a whole decode step is
two graphs (draft; verify + walk + commit + extend) around the host-side tree builder.

It equals ``Target.forward`` + ``Tree.walk_greedy`` + ``TargetState.commit`` whenever sibling
tokens are distinct, which holds for every DDTree tree: then at most one child of a node can match
its argmax, and the accepted nodes are exactly the deepest node whose whole root path matches, with
its ancestors. ``tests/test_static.py`` checks the equality on CPU.

The caller must leave room: ``length + max_depth + 1 <= capacity`` before each step. The commit
writes ``max_depth + 1`` KV rows; rows past the accepted ones are scratch, masked out and
overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_reference.errors import PromptError
from ddtree_reference.layers import LazyStates
from ddtree_reference.state import TargetState, TreeForward
from ddtree_reference.static_draft import StaticDraftContext
from ddtree_reference.target import Target
from ddtree_reference.treechunk import unchecked


class StaticState:
    """The committed target state in fixed-size buffers (duck-types ``TargetState`` for the forward)."""

    def __init__(self, length: torch.Tensor, keys: list, values: list, conv: list, recurrent: list,
                 capacity: int) -> None:
        self.length = length  # [] int64 on the device: committed tokens
        self.keys, self.values = keys, values  # per layer [Hkv, capacity, D] or None
        self.conv, self.recurrent = conv, recurrent  # per layer [K-1, C] / [HV, Dk, Dv] or None
        self.capacity = capacity
        device = length.device
        self._slots = torch.arange(capacity, device=device)  # [capacity]

    @property
    def prefix_valid(self) -> torch.Tensor:
        """[capacity] bool: which KV slots hold committed tokens (device op, capture-safe)."""
        return self._slots < self.length

    @classmethod
    def from_state(cls, state: TargetState, capacity: int) -> StaticState:
        if capacity < state.length:
            raise PromptError(f"capacity {capacity} is below the committed length {state.length}")
        ref = next(t for t in state.conv + state.keys if t is not None)
        device = ref.device
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        for k, v in zip(state.keys, state.values):
            if k is None:
                keys.append(None)
                values.append(None)
                continue
            kb = k.new_zeros(k.shape[0], capacity, k.shape[2])  # [Hkv, capacity, D]
            vb = v.new_zeros(v.shape[0], capacity, v.shape[2])
            kb[:, : state.length] = k
            vb[:, : state.length] = v
            keys.append(kb)
            values.append(vb)
        conv = [None if c is None else c.clone() for c in state.conv]
        rec = [None if r is None else r.clone() for r in state.recurrent]
        length = torch.tensor(state.length, dtype=torch.long, device=device)
        return cls(length, keys, values, conv, rec, capacity)

    def snapshot(self) -> tuple:
        """What a step overwrites (length, conv, recurrent), to undo warm-up or capture runs."""
        return (self.length.clone(), [None if c is None else c.clone() for c in self.conv],
                [None if r is None else r.clone() for r in self.recurrent])

    def restore(self, snap: tuple) -> None:
        """Back to a :meth:`snapshot` in place (KV rows past the length are scratch: nothing to undo)."""
        length, conv, rec = snap
        self.length.copy_(length)
        for dst, src in zip(self.conv + self.recurrent, conv + rec):
            if dst is not None:
                dst.copy_(src)

    def to_state(self) -> TargetState:
        """A ``TargetState`` copy of the committed part (reads the length: not for graphs)."""
        n = int(self.length)
        keys = [None if k is None else k[:, :n].clone() for k in self.keys]
        values = [None if v is None else v[:, :n].clone() for v in self.values]
        return TargetState(n, keys, values, [None if c is None else c.clone() for c in self.conv],
                           [None if r is None else r.clone() for r in self.recurrent])


@dataclass(slots=True)
class StepOut:
    """One step's results, all device tensors (the graph's outputs)."""

    leaf: torch.Tensor  # [] int64: the last accepted node
    path: torch.Tensor  # [max_depth + 1] int64: accepted nodes root first; entries past n_accepted are scratch
    n_accepted: torch.Tensor  # [] int64: accepted nodes, root included (τ)
    bonus: torch.Tensor  # [] int64: the target's token after the leaf
    forward: TreeForward  # logits [n, V] float32, context [n, len(capture)*H], per-node KV and state


def device_walk(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, argmax: torch.Tensor,
                visible: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance on the device: (leaf [], path [max_depth + 1], n_accepted []).

    A node is on the accepted path when every node of its root path (itself included, the root
    excepted) carries the token its parent's argmax predicts; the leaf is the deepest such node,
    the smallest index among equals (with distinct sibling tokens there is only one).
    """
    n = tokens.shape[0]
    predicted = argmax[parents.clamp(min=0)]  # [n]: what each node's parent predicts
    match = (tokens == predicted) | (parents < 0)  # [n]: the root always stands
    on_path = ~(visible & ~match[None, :]).any(dim=1)  # [n]: every ancestor-or-self matches
    order = torch.arange(n, device=tokens.device)
    score = torch.where(on_path, depths * (n + 1) + (n - order), torch.full_like(depths, -1))  # deepest, then first
    leaf = score.argmax()
    levels = torch.arange(max_depth + 1, device=tokens.device)
    # a 0-dim index tensor would be read on the host (item): index with [1]-shaped ones instead
    at_leaf = leaf.view(1)  # [1]
    on_leaf_path = visible.index_select(0, at_leaf) & (depths[None, :] == levels[:, None])  # [max_depth + 1, n]
    path = on_leaf_path.to(torch.int8).argmax(dim=1)  # [max_depth + 1] (int8: argmax needs a number type)
    return leaf, path, depths.index_select(0, at_leaf)[0] + 1


def _select_state(states: torch.Tensor | LazyStates, node: torch.Tensor) -> torch.Tensor:
    """One node's recurrent post-state, indexed by a device scalar (no host read)."""
    if isinstance(states, LazyStates):
        return states.chunk.state_at(node)  # [HV, Dk, Dv]
    return states.index_select(0, node.view(1))[0]


def verify_walk_commit(target: Target, state: StaticState, tokens: torch.Tensor, parents: torch.Tensor,
                       depths: torch.Tensor, max_depth: int, capture: tuple[int, ...] = (),
                       draft: StaticDraftContext | None = None) -> StepOut:
    """Verify one tree exactly, walk it greedily and commit, all on the device; ``state`` is updated
    in place. tokens/parents/depths: [n] int64 on the target's device. With ``draft`` (and
    ``capture`` = its target layers), the accepted nodes' hidden states extend the drafter's
    context too, at their positions, as the decoder does after every step."""
    if target.gdn_method != "chunk":
        raise PromptError("the fixed-shape step needs the tree-chunk Gated DeltaNet method (target.gdn_method = 'chunk')")
    with unchecked():  # no host-side value checks anywhere in the step: they read the device
        return _step(target, state, tokens, parents, depths, max_depth, capture, draft)


def _step(target: Target, state: StaticState, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
          max_depth: int, capture: tuple[int, ...], draft: StaticDraftContext | None) -> StepOut:
    fwd = target.forward(state, tokens, parents, depths, capture=capture, validate=False)
    argmax = fwd.logits.argmax(dim=-1)  # [n]
    leaf, path, n_acc = device_walk(tokens, parents, depths, argmax, fwd.visible, max_depth)  # the tree's own mask
    if draft is not None:  # before the commit moves the length: the root sits at the committed length
        draft.extend(fwd.context[path], state.length + depths[path], n_acc)
    slots = state.length + torch.arange(max_depth + 1, device=tokens.device)  # [max_depth + 1]
    for layer, k in fwd.keys.items():
        state.keys[layer][:, slots] = k[:, path]  # [Hkv, max_depth + 1, D]
        state.values[layer][:, slots] = fwd.values[layer][:, path]
    for layer, windows in fwd.conv.items():
        state.conv[layer].copy_(windows.index_select(0, leaf.view(1))[0])  # [K-1, C]
        state.recurrent[layer].copy_(_select_state(fwd.recurrent[layer], leaf))
    state.length.add_(n_acc)
    return StepOut(leaf=leaf, path=path, n_accepted=n_acc, bonus=argmax.index_select(0, leaf.view(1))[0], forward=fwd)
