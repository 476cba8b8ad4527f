"""Deliberately broken variants of the reference decoder, one per known engine bug class.

Contract: each fault is a :class:`~ddtree_reference.decode.DDTreeDecoder` subclass that overrides exactly
one of the decoder's engine steps (verify, walk, bonus, commit, draft context, what is reported)
the way a real engine got it wrong, and changes nothing else; real bug reports exist for the first
nine classes (DESIGN §5), the others are the calibration corpus of issue 16. ``FAULTS`` maps a
discrete fault's name to (class, the diff category that must catch it first: the category of the
report's first divergence at the step where the fault first changes anything). The clean decoder
is the control.

**Long-context faults** (``LONG_CONTEXT_FAULTS``, the same form) grow with the position and show only on
contexts of a few hundred tokens: ``draft-rope-bf16`` (the drafter's rotary frequencies rounded to bf16, as an
engine that casts its rotary buffers with its weights has them) changes how the drafter is set up for a request,
not one engine step. The
calibration corpus runs them on its long prompts; the selftest's short prompts would not show them.

**Graded faults** (``GRADED``) measure the detection threshold: their name is ``KIND:EPS`` with
``EPS`` a float in (0, 1] (``rec-scale:0.01``, ``conv-noise:1e-3``; the canonical spelling is
``f"{kind}:{eps:g}"``), and ``EPSILONS`` is the calibration grid. :func:`fault` resolves any
name (discrete or graded) and raises a :class:`~refcheck.errors.UsageError` listing the names;
:func:`fault_names` lists the discrete faults, the long-context ones and the graded ones on the grid.
"""

from __future__ import annotations

import functools
import math

import torch

from ddtree_reference.decode import DDTreeDecoder
from ddtree_reference.state import TargetState, TreeForward
from ddtree_reference.tree import Tree
from refcheck.errors import UsageError
from refcheck.selftest.sampling_faults import SAMPLING_FAULTS


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


class ParentState(DDTreeDecoder):
    """Commits the conv/recurrent state of the last accepted node's *parent* (one node behind).

    KV is right. With only the root accepted the parent is the last committed token, whose state
    the engine already holds, so the committed state is the one the step started from (an engine that indexes the
    path with ``accept_length - 2`` and skips the write when that is negative).
    """

    def commit(self, state, fwd, accepted):
        if len(accepted) < 2:
            return _with_state(state.commit(fwd, accepted), state.conv, state.recurrent)
        return _commit(state, fwd, accepted, accepted[-2], accepted[-2])


class AttentionExtraNode(DDTreeDecoder):
    """Attention lets node i also see node i-1 of the flat order when that is not its ancestor."""

    def verify(self, state, tree, capture):
        visible = tree.visibility().clone()  # [N, N] on the host
        i = torch.arange(1, tree.num_nodes)
        visible[i, i - 1] = True
        return self.target.forward(state, tree.tokens, tree.parents, tree.depths, capture=capture,
                                   visible=visible.to(self.target.device), keep_layer_outputs=self.cfg.keep_layers)


class DeepPositionsPlusOne(DDTreeDecoder):
    """Gives nodes of depth >= 2 the position committed_len + depth + 1 (depths 0 and 1 are right)."""

    def verify(self, state, tree, capture):
        depths = tree.depths + (tree.depths >= 2).long()
        return self.target.forward(state, tree.tokens, tree.parents, depths, capture=capture,
                                   keep_layer_outputs=self.cfg.keep_layers)


class TopkIdsShifted(DDTreeDecoder):
    """Reports each node's top-k ids rolled by one rank against their log-probs (rank r gets id r+1)."""

    def report_topk(self, ids, logprobs):
        return ids.roll(-1, dims=-1), logprobs


class KvLastUnwritten(DDTreeDecoder):
    """Never writes the last accepted node's KV row: it stays as a freshly allocated page left it (zeros).

    A paged engine whose pool is zero-initialised reads zeros there; one that reuses pages would
    read stale rows instead (the SGLang fault ``kv-move-last`` leaves the verify's own row there).
    """

    def commit(self, state, fwd, accepted):
        new = state.commit(fwd, accepted)
        for layer in fwd.keys:
            for rows in (new.keys, new.values):
                rows[layer] = rows[layer].clone()
                rows[layer][:, -1] = 0
        return new


class WalkStopsEarly(DDTreeDecoder):
    """The greedy walk stops one node early whenever it accepted at least one drafted node.

    Self-consistent: the bonus is the argmax at the new last node (= the dropped node's token), the
    commit and the drafter's context follow the shortened path, so the output stays lossless and
    only the walk rule (and the speed) is wrong.
    """

    def walk(self, tree, argmax):
        accepted = super().walk(tree, argmax)
        return accepted[:-1] if len(accepted) >= 2 else accepted


class ConvFirstSibling(DDTreeDecoder):
    """A node with an earlier sibling takes its conv window through the first sibling.

    Its window is the K-1 rows before it along (..., parent, first sibling) instead of (..., parent):
    the first sibling's conv input sits where the node's own path has none; the recurrence is right.
    """

    def verify(self, state, tree, capture):
        return self.target.forward(state, tree.tokens, tree.parents, tree.depths, capture=capture,
                                   conv_parents=first_sibling_parents(tree.parents),
                                   keep_layer_outputs=self.cfg.keep_layers)


class BonusFromRoot(DDTreeDecoder):
    """Takes the bonus token (and its log-prob) from the root's row instead of the last accepted node's."""

    def bonus_node(self, accepted):
        return accepted[0]


class DraftContextNoRoot(DDTreeDecoder):
    """Feeds the drafter the accepted drafted nodes' hidden states without the root's."""

    def context_nodes(self, tree: Tree, accepted: list[int]) -> list[int]:
        return accepted[1:]


# -- long-context faults ---------------------------------------------------------------------------
class DraftRopeRounded(DDTreeDecoder):
    """The drafter's rotary frequencies rounded to bfloat16 (an engine that casts its rotary buffers with its
    weights): the angle at position p turns by up to p x 2^-8 x inv_freq, so the drafts drift as the context grows
    and show only on long contexts (a few hundred tokens on the built-in pair)."""

    def generate(self, prompt_ids: list[int], request: int = 0):
        rotary = self.drafter.rotary_emb
        exact = rotary.inv_freq
        rotary.inv_freq = exact.to(torch.bfloat16).to(exact.dtype)  # rounded to bf16, applied in its own dtype
        try:
            return super().generate(prompt_ids, request)
        finally:
            rotary.inv_freq = exact


# -- graded faults ---------------------------------------------------------------------------------
class RecScale(DDTreeDecoder):
    """Commits every Gated DeltaNet recurrent state scaled by (1 + eps): relative L2 error exactly eps."""

    eps: float = 0.0

    def commit(self, state, fwd, accepted):
        new = state.commit(fwd, accepted)
        rec = [r if r is None else r * (1.0 + self.eps) for r in new.recurrent]
        return _with_state(new, new.conv, rec)


class ConvNoise(DDTreeDecoder):
    """Commits every conv window multiplied elementwise by (1 ± eps), the signs seeded by (layer, length).

    Relative L2 error exactly eps before rounding to the conv dtype (in bf16, whose spacing is 2^-8,
    eps = 1e-3 survives only partly: what an engine in that dtype could carry). Deterministic.
    """

    eps: float = 0.0

    def commit(self, state, fwd, accepted):
        new = state.commit(fwd, accepted)
        conv = [c if c is None else _sign_noise(c, self.eps, seed=layer * 1_000_003 + new.length)
                for layer, c in enumerate(new.conv)]
        return _with_state(new, conv, new.recurrent)


def _with_state(state: TargetState, conv: list, recurrent: list) -> TargetState:
    """``state`` with its conv and recurrent lists replaced (KV and length kept)."""
    return TargetState(state.length, state.keys, state.values, list(conv), list(recurrent))


def _sign_noise(x: torch.Tensor, eps: float, seed: int) -> torch.Tensor:
    """x * (1 + eps * s) with s = ±1 per element from a CPU generator seeded by ``seed``; x's dtype."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, tuple(x.shape), generator=gen).float().mul_(2).sub_(1).to(x.device)
    return (x.float() * (1.0 + eps * signs)).to(x.dtype)


def first_sibling_parents(parents: torch.Tensor) -> torch.Tensor:
    """[n] conv parents of ConvFirstSibling: a node's first earlier sibling where it has one, else its parent."""
    out = parents.clone()
    first: dict[int, int] = {}
    for t, p in enumerate(parents.tolist()):
        if p in first:
            out[t] = first[p]
        else:
            first[p] = t
    return out


#: fault name -> (decoder class, diff category expected to catch it first)
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
    "parent-state": (ParentState, "conv"),
    "attention-extra-node": (AttentionExtraNode, "logits"),
    "deep-positions-plus-one": (DeepPositionsPlusOne, "logits"),
    "topk-ids-shifted": (TopkIdsShifted, "logits"),
    "kv-last-unwritten": (KvLastUnwritten, "kv"),
    "walk-stops-early": (WalkStopsEarly, "accepted_path"),
    "conv-first-sibling": (ConvFirstSibling, "logits"),
    "bonus-from-root": (BonusFromRoot, "bonus"),
    "draft-context-no-root": (DraftContextNoRoot, "draft"),
}

#: faults that show only on long contexts (the calibration corpus runs them on :data:`refcheck.calibrate.LONG_PROMPTS`):
#: name -> (decoder class, diff category expected to catch it first)
LONG_CONTEXT_FAULTS: dict[str, tuple[type[DDTreeDecoder], str]] = {
    "draft-rope-bf16": (DraftRopeRounded, "draft"),
}

#: graded fault kind -> (base class with an ``eps`` attribute, diff category it perturbs)
GRADED: dict[str, tuple[type[DDTreeDecoder], str]] = {
    "rec-scale": (RecScale, "recurrent"),
    "conv-noise": (ConvNoise, "conv"),
}

#: the calibration grid of graded faults' eps
EPSILONS: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def graded_name(kind: str, eps: float) -> str:
    """Canonical name of a graded fault: ``rec-scale:0.001``."""
    return f"{kind}:{eps:g}"


def fault_names() -> list[str]:
    """Every discrete fault, the long-context ones, then every graded kind on the ``EPSILONS`` grid."""
    return [*FAULTS, *LONG_CONTEXT_FAULTS, *(graded_name(kind, eps) for kind in GRADED for eps in EPSILONS)]


def find_fault(name: str) -> tuple[type[DDTreeDecoder], str] | None:
    """(decoder class, expected category) of a discrete, sampling or graded fault name; None when unknown."""
    if name in FAULTS:
        return FAULTS[name]
    if name in LONG_CONTEXT_FAULTS:
        return LONG_CONTEXT_FAULTS[name]
    if name in SAMPLING_FAULTS:
        return SAMPLING_FAULTS[name]
    kind, sep, value = name.partition(":")
    if not sep or kind not in GRADED:
        return None
    try:
        eps = float(value)
    except ValueError:
        return None
    if not 0.0 < eps <= 1.0:  # also rejects nan
        return None
    return _graded_class(kind, eps), GRADED[kind][1]


def fault(name: str) -> tuple[type[DDTreeDecoder], str]:
    """Like :func:`find_fault`, but an unknown name is a UsageError that lists the names."""
    found = find_fault(name)
    if found is None:
        raise UsageError(f"unknown fault {name!r} (faults: {', '.join(fault_names())}; at temperature > 0: "
                         f"{', '.join(SAMPLING_FAULTS)}; graded faults take any "
                         f"eps in (0, 1]: {', '.join(f'{k}:EPS' for k in GRADED)})")
    return found


@functools.cache
def _graded_class(kind: str, eps: float) -> type[DDTreeDecoder]:
    """One subclass per (kind, eps), so a name always gives the same class."""
    base = GRADED[kind][0]
    return type(f"{base.__name__}_{graded_name(kind, eps)}", (base,), {"eps": eps, "__doc__": base.__doc__})
