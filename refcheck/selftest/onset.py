"""Where an injected fault first changes anything: the clean and the faulty decode, step by step.

Contract: :func:`fault_onset` compares two :class:`~ddtree_reference.decode.DecodeResult` s of the same
prompt (decoded with ``keep_states=True``: the clean decoder and a fault of
:mod:`refcheck.selftest.faults`, same target, drafter and dtype) and returns the first step at
which anything the engine reports or commits differs, what differs there (named by the diff's
categories, in the diff's order), the first node whose reported logits differ, the first layer
whose output differs at that node (what the diff's layer bisection names; with ``keep_layers``) and
the first layer whose committed state differs. Comparisons are exact: both runs use the same kernels on the same
inputs until the fault acts, so any difference is the fault's. None when the runs are identical.

This is the ground truth a detection claim is checked against: a diff catches a fault well when
its first failing finding is at the onset's step (and node, and layer) in the fault's category.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_reference.decode import DecodeResult, StepRecord


@dataclass(frozen=True, slots=True)
class Onset:
    step: int
    what: tuple[str, ...]  # diff categories whose quantities changed at ``step``, in the diff's order
    node: int | None = None  # first node whose argmax or top-k changed (None: no node's did)
    layer: int | None = None  # first layer whose output at ``node`` changed (layer outputs recorded)
    state_layer: int | None = None  # first layer whose committed KV/conv/recurrent state changed

    def to_json(self) -> dict:
        return {"step": self.step, "what": list(self.what), "node": self.node, "layer": self.layer,
                "state_layer": self.state_layer}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))


def _changed_nodes(a: StepRecord, b: StepRecord) -> list[int]:
    """Nodes whose argmax, top-k ids or top-k log-probs differ (trees of equal size only)."""
    if a.topk_ids.shape != b.topk_ids.shape or a.target_argmax.shape != b.target_argmax.shape:
        return [0]
    diff = (a.target_argmax != b.target_argmax) | (a.topk_ids != b.topk_ids).any(-1) \
        | (a.topk_logprobs != b.topk_logprobs).any(-1)
    return torch.nonzero(diff).flatten().tolist()


def _state_changes(a: StepRecord, b: StepRecord) -> tuple[list[str], int | None]:
    """(categories, first layer) whose committed state differs between two steps' states."""
    if a.state is None or b.state is None:
        return [], None
    cats: dict[str, None] = {}
    layers: list[int] = []
    pairs = (("kv", a.state.keys, b.state.keys), ("kv", a.state.values, b.state.values),
             ("conv", a.state.conv, b.state.conv), ("recurrent", a.state.recurrent, b.state.recurrent))
    for cat, xs, ys in pairs:
        for layer, (x, y) in enumerate(zip(xs, ys)):
            if not _same(x, y):
                cats[cat] = None
                layers.append(layer)
    order = ("kv", "conv", "recurrent")
    return sorted(cats, key=order.index), min(layers, default=None)


def step_changes(a: StepRecord, b: StepRecord) -> Onset | None:
    """What differs between two records of the same step (None: nothing)."""
    what: list[str] = []
    if not _same(a.draft_logprobs, b.draft_logprobs):
        what.append("draft")
    ta, tb = a.tree, b.tree
    same_tree = _same(ta.tokens, tb.tokens) and _same(ta.parents, tb.parents) and _same(ta.depths, tb.depths)
    if not same_tree:
        what.append("tree")
    nodes = _changed_nodes(a, b)
    if nodes:
        what.append("logits")
    if a.accepted != b.accepted:
        what.append("accepted_path")
    if a.accept_length != b.accept_length:
        what.append("accept_length")
    if a.bonus != b.bonus:
        what.append("bonus")
    if a.emitted != b.emitted:
        what.append("output")
    if a.emitted_logprobs != b.emitted_logprobs:  # NaN != NaN counts as a change, which it is
        what.append("logprobs")
    state_cats, state_layer = _state_changes(a, b)
    what += state_cats
    if not what:
        return None
    node = nodes[0] if nodes else None
    return Onset(a.step, tuple(what), node, _first_layer(a, b, node), state_layer)


def _first_layer(a: StepRecord, b: StepRecord, node: int | None) -> int | None:
    """First layer whose output at ``node`` differs (None without layer outputs or a node)."""
    if node is None or a.layer_outputs is None or b.layer_outputs is None or a.layer_outputs.shape != b.layer_outputs.shape:
        return None
    diff = (a.layer_outputs[:, node] != b.layer_outputs[:, node]).any(-1)  # [layers]
    hits = torch.nonzero(diff).flatten().tolist()
    return hits[0] if hits else None


def fault_onset(clean: DecodeResult, faulty: DecodeResult) -> Onset | None:
    """The first step at which ``faulty`` differs from ``clean`` (see the module contract)."""
    for a, b in zip(clean.steps, faulty.steps):
        onset = step_changes(a, b)
        if onset is not None:
            return onset
    if len(clean.steps) != len(faulty.steps) or clean.output_ids != faulty.output_ids:
        return Onset(min(len(clean.steps), len(faulty.steps)), ("output",))
    return None
