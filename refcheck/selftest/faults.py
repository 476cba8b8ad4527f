"""Deliberately broken variants of the reference decoder, one per known engine bug class.

Contract: each fault is a :class:`~reference.decode.DDTreeDecoder` subclass that overrides exactly
one of the decoder's engine steps (verify, commit, draft context, what is reported) the way a real
engine got it wrong; real bug reports exist for every class (DESIGN §5). ``FAULTS`` maps the fault
name to (class, the diff category that must catch it). The clean decoder is the control.
"""

from __future__ import annotations

import math

import torch

from reference.decode import DDTreeDecoder
from reference.state import TargetState, TreeForward
from reference.tree import Tree


def _commit(state: TargetState, fwd: TreeForward, kv_nodes: list[int], state_node: int, conv_node: int) -> TargetState:
    """A commit with explicit choices of KV rows and of the nodes that give recurrent/conv state."""
    idx = torch.tensor(kv_nodes, dtype=torch.long, device=fwd.logits.device)
    keys, values, conv, rec = list(state.keys), list(state.values), list(state.conv), list(state.recurrent)
    for layer, k in fwd.keys.items():
        keys[layer] = torch.cat([state.keys[layer], k[:, idx]], dim=1)
        values[layer] = torch.cat([state.values[layer], fwd.values[layer][:, idx]], dim=1)
    for layer, c in fwd.conv.items():
        conv[layer] = c[conv_node].clone()
        rec[layer] = fwd.recurrent[layer][state_node].clone()
    return TargetState(state.length + len(kv_nodes), keys, values, conv, rec)


class SiblingLeak(DDTreeDecoder):
    """Recurrent layers run over the flattened tree as one sequence (the mask only helps attention)."""

    def verify(self, state, tree, capture):
        return self.target.forward(state, tree.tokens, tree.parents, tree.depths, capture=capture, leaky=True,
                                   keep_layer_outputs=self.cfg.keep_layers)


class StateFromFlatIndex(DDTreeDecoder):
    """Commits the recurrent/conv state of flat node len(accepted)-1 instead of the last accepted node."""

    def commit(self, state, fwd, accepted):
        flat = len(accepted) - 1
        return _commit(state, fwd, accepted, flat, flat)


class ConvNotRolledBack(DDTreeDecoder):
    """Keeps the conv window left by the last node of the flattened tree (no rollback to the path)."""

    def commit(self, state, fwd, accepted):
        last_flat = fwd.logits.shape[0] - 1
        return _commit(state, fwd, accepted, accepted[-1], last_flat)


class SequentialPositions(DDTreeDecoder):
    """Gives tree nodes sequential positions (flat index) instead of committed_len + depth."""

    def verify(self, state, tree, capture):
        flat = torch.arange(tree.num_nodes)
        return self.target.forward(state, tree.tokens, tree.parents, flat, capture=capture,
                                   keep_layer_outputs=self.cfg.keep_layers)


class KvWrongSlots(DDTreeDecoder):
    """Compacts the KV of flat slots 0..len(accepted)-1 instead of the accepted path's slots."""

    def commit(self, state, fwd, accepted):
        return _commit(state, fwd, list(range(len(accepted))), accepted[-1], accepted[-1])


class DraftContextRejected(DDTreeDecoder):
    """Feeds the drafter the hidden states of every tree node, rejected ones included."""

    def context_nodes(self, tree: Tree, accepted: list[int]) -> list[int]:
        return list(range(tree.num_nodes))


class MaskTokenDropped(DDTreeDecoder):
    """Drops output tokens that equal the drafter's MASK id (mistaken for padding)."""

    def report_emitted(self, emitted, lps):
        keep = [i for i, t in enumerate(emitted) if t != self.drafter.mask_token_id]
        return [emitted[i] for i in keep], [lps[i] for i in keep]


class TauWithoutBonus(DDTreeDecoder):
    """Reports acceptance as accepted drafted tokens only (bonus not counted)."""

    def report_accept_length(self, accepted):
        return len(accepted) - 1


class LogprobsFirstOnly(DDTreeDecoder):
    """Returns a logprob for the first token of each step only (the rest missing: NaN)."""

    def report_emitted(self, emitted, lps):
        return emitted, lps[:1] + [math.nan] * (len(lps) - 1)


#: fault name -> (decoder class, diff category expected to catch it)
FAULTS: dict[str, tuple[type[DDTreeDecoder], str]] = {
    "sibling-leak": (SiblingLeak, "logits"),
    "state-flat-index": (StateFromFlatIndex, "recurrent"),
    "conv-not-rolled-back": (ConvNotRolledBack, "conv"),
    "sequential-positions": (SequentialPositions, "logits"),
    "kv-wrong-slots": (KvWrongSlots, "kv"),
    "draft-context-rejected": (DraftContextRejected, "draft"),
    "mask-token-dropped": (MaskTokenDropped, "output"),
    "tau-without-bonus": (TauWithoutBonus, "accept_length"),
    "logprobs-first-only": (LogprobsFirstOnly, "logprobs"),
}
