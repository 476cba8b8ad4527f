"""The node checks of a replayed step: every node's argmax and top-k log-probs against the reference's,
and the layer bisection of a node that fails.

Contract: :class:`NodeChecks` is the part of a request's replay (:mod:`refcheck.diff.request_replay`) that judges
a step's nodes, given the reference's log-probs ``logp`` [N, V] at the engine's tree and the committed length
before the step; it reports through the request's :class:`~refcheck.diff.request_findings.RequestFindings` and
judges through its :class:`~refcheck.diff.rounding_guard.RoundingGuard`, and holds nothing of a step between
calls. An argmax flip is a benign tie under the tolerance's tie margin, a flip rounding at the engine's dtype
explains (the walk then follows the engine), or a failure; top-k log-probs over the cheap bound are held to the
rounding ensemble, and at an anchor step those within it too. A failing node of a step that carries layer sketches
is bisected to its first differing layer (the finding's details: ``rel_l2`` there, ``per_layer_rel_l2`` at every
layer, the ``tolerance`` they were held to). :meth:`NodeChecks.check` returns the walk's argmax and the nodes whose
log-probs rounding explains (:class:`CheckedNodes`), which the emitted-token check reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ddtree_reference.target import Target
from ddtree_reference.tree import Tree
from refcheck.diff.request_findings import RequestFindings
from refcheck.diff.rounding_guard import FLOOR, RoundingGuard
from refcheck.diff.tolerance import Tolerance
from refcheck.diff.triage import StepSpread
from refcheck.profile import timed
from refcheck.sketch import layer_sketch, rel_l2
from refcheck.trace.io import StepRow


def topk_at(i: int) -> Callable[[StepSpread], float | None]:
    """The ensemble's log-prob spread at node ``i`` (what a judged node deviation is held to)."""
    return lambda sp: float(sp.topk[i])


def _margin_at(i: int) -> Callable[[StepSpread], float | None]:
    return lambda sp: float(sp.margin[i])


def abs_dev(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| with NaN/inf in the engine's values counted as infinitely far (never a pass)."""
    dev = (got - ref).abs()
    return torch.where(torch.isfinite(got), dev, torch.full_like(dev, float("inf")))


class CheckedNodes(NamedTuple):
    """What a step's node checks leave for the rest of the step."""

    walk: torch.Tensor  # [N] the argmax to walk with (teacher-forced: the engine's where its flip is excused)
    ill_conditioned: dict[int, float]  # nodes whose log-probs are consistent with rounding -> their spread


class NodeChecks:
    """A request's node checks: each step's argmax, top-k log-probs and layer bisection."""

    def __init__(self, findings: RequestFindings, guard: RoundingGuard, tol: Tolerance, target: Target) -> None:
        self.findings, self.guard, self.tol, self.target = findings, guard, tol, target

    def check(self, s: StepRow, tree: Tree, logp: torch.Tensor, layers: list[torch.Tensor] | None, prev: int
              ) -> CheckedNodes:
        """Argmax and top-k log-probs at every node (``prev``: the committed length before the step, where the
        tree's root sits); bisects the first failing node when the step carries layer sketches."""
        self.findings.check("logits", tree.num_nodes)
        ref_arg = logp.argmax(dim=-1).cpu()
        eng_arg = torch.tensor(s.target_argmax, dtype=torch.long)
        if eng_arg.shape != ref_arg.shape:
            self.findings.fail("logits", s.step, f"engine reported {eng_arg.shape[0]} argmaxes for {tree.num_nodes} nodes")
            return CheckedNodes(ref_arg, {})
        walk, bad_nodes = self._check_argmax(s, tree, logp, ref_arg, eng_arg, prev)
        ill: dict[int, float] = {}
        if s.topk_ids:
            bad_nodes += self._check_topk(s, tree, logp, prev, ill)
        if bad_nodes and s.layer_sketch is not None and layers is not None:
            self.bisect(s, min(bad_nodes), layers)
        return CheckedNodes(walk, ill)

    def _check_argmax(self, s: StepRow, tree: Tree, logp: torch.Tensor, ref_arg: torch.Tensor, eng_arg: torch.Tensor,
                      prev: int) -> tuple[torch.Tensor, list[int]]:
        """Each node whose engine argmax differs: a near-tie, a flip rounding explains (the walk follows the
        engine there) or a failure; returns (the walk's argmax, the failing nodes)."""
        walk = ref_arg.clone()
        bad_nodes: list[int] = []
        for i in torch.nonzero(eng_arg != ref_arg).flatten().tolist():
            pos = prev + int(tree.depths[i])
            lp = logp[i].cpu()
            margin = float(lp[ref_arg[i]] - lp[eng_arg[i]])
            spread = self.guard.judged(margin, _margin_at(i)) if margin >= self.tol.tie_margin else None
            if spread is not None:
                self.guard.consistent("logits", s.step, f"argmax flip at margin {margin:.4g}: engine token "
                                      f"{int(eng_arg[i])} vs reference {int(ref_arg[i])}; rounding at the engine's dtype "
                                      f"moves that margin by up to {spread:.4g} here",
                                      {"engine_token": int(eng_arg[i]), "reference_token": int(ref_arg[i]),
                                       "margin": margin, "margin_spread": spread}, node=i, position=pos)
                walk[i] = eng_arg[i]
            elif self.findings.token_flip("logits", s.step, i, lp, int(eng_arg[i]), position=pos):
                walk[i] = eng_arg[i]
            else:
                bad_nodes.append(i)
        return walk, bad_nodes

    def _check_topk(self, s: StepRow, tree: Tree, logp: torch.Tensor, prev: int, ill: dict[int, float]) -> list[int]:
        """The engine's top-k log-probs at every node: over the cheap bound, judged against rounding (``ill`` gains
        the nodes rounding explains); at an anchor step, within it too. Returns the failing nodes."""
        ids = torch.tensor(s.topk_ids, dtype=torch.long)  # [N, k]
        lps = torch.tensor(s.topk_logprobs, dtype=torch.float32)  # [N, k]
        dev = abs_dev(lps, logp.cpu().gather(1, ids)).max(dim=1).values  # [N]
        self.findings.track_max("max_logprob_abs", float(dev.max()))
        over = self._over_bound(s, tree, dev, prev, ill)
        anchor = self._beyond_rounding(s, tree, dev, prev)  # after the over-bound failure: it stops the judging
        return [i for i in (over, anchor) if i is not None]

    def _over_bound(self, s: StepRow, tree: Tree, dev: torch.Tensor, prev: int, ill: dict[int, float]) -> int | None:
        """Nodes whose deviation ``dev`` [N] is over the cheap bound: consistent with rounding (into ``ill``), else
        one failure for all of them; returns its node."""
        over: list[int] = []
        for i in torch.nonzero(dev > self.tol.logprob_abs).flatten().tolist():
            spread = self.guard.judged(float(dev[i]), topk_at(i))
            if spread is None:
                over.append(i)
                continue
            ill[i] = spread
            median = self.guard.step_spread().median_topk  # judged() returned a spread: this step's ensemble ran
            self.guard.consistent("logits", s.step, f"log-probs off by {float(dev[i]):.4g}, within {self.guard.factor:g}x "
                                  f"of what rounding at the engine's dtype moves them here ({spread:.4g}; median node "
                                  f"{median:.3g})", {"max_abs": float(dev[i]), "spread": spread, "median_spread": median},
                                  node=i, position=prev + int(tree.depths[i]))
        if not over:
            return None
        i = over[0]
        self.findings.fail("logits", s.step, f"top-k log-probs differ by up to {float(dev[over].max()):.4g} at "
                           f"{len(over)} of {tree.num_nodes} nodes (first node {i}, tolerance {self.tol.logprob_abs:g})",
                           node=i, position=prev + int(tree.depths[i]),
                           details={"max_abs": float(dev[over].max()), "nodes": over[:16]})
        return i

    def _beyond_rounding(self, s: StepRow, tree: Tree, dev: torch.Tensor, prev: int) -> int | None:
        """At an anchor step, nodes whose deviation ``dev`` [N] is within the bound but beyond what rounding moves
        them: one failure for all of them; returns its node."""
        beyond: dict[int, float] = {}  # node -> its spread
        for i in torch.nonzero(dev <= self.tol.logprob_abs).flatten().tolist():
            spread = self.guard.beyond_rounding(s.step, float(dev[i]), FLOOR.logprob_abs, topk_at(i))
            if spread is not None:
                beyond[i] = spread
        if not beyond:
            return None
        i = min(beyond)
        self.findings.fail("logits", s.step, f"top-k log-probs differ by {float(dev[i]):.4g} at node {i}, more than "
                           f"{self.guard.factor:g}x what rounding at the engine's dtype moves them here ({beyond[i]:.4g}; "
                           f"{len(beyond)} of {tree.num_nodes} nodes; judged in full at the request's anchor steps)",
                           node=i, position=prev + int(tree.depths[i]),
                           details={"max_abs": float(dev[i]), "spread": beyond[i], "anchor": True,
                                    "nodes": sorted(beyond)[:16]})
        return i

    @timed("replay.bisect")
    def bisect(self, s: StepRow, node: int, layers: list[torch.Tensor]) -> None:
        """The first layer at which ``node``'s output differs from the reference's (``layers``: the reference's
        layer outputs at every node, each [N, H]), against the step's layer sketches."""
        ref = layer_sketch(torch.stack(layers))  # [layers, N, r]
        assert s.layer_sketch is not None  # bisect runs only on steps that carry layer sketches
        eng = s.layer_sketch.float()
        if eng.shape != ref.shape:
            self.findings.fail("logits", s.step, f"layer sketches have shape {tuple(eng.shape)}, reference "
                               f"{tuple(ref.shape)}", node=node)
            return
        per_layer = [rel_l2(eng[layer, node], ref[layer, node]) for layer in range(ref.shape[0])]
        for layer, err in enumerate(per_layer):
            if err > self.tol.tensor_rel_l2:
                kind = "linear_attention" if self.target.is_linear(layer) else "attention"
                self.findings.fail("logits", s.step, f"layer bisection: first differing layer {layer} ({kind}), rel L2 "
                                   f"{err:.3g}", node=node, layer=layer, layer_type=kind,
                                   details={"rel_l2": err, "per_layer_rel_l2": per_layer,
                                            "tolerance": self.tol.tensor_rel_l2})
                return
