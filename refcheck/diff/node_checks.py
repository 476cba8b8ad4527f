"""The node checks of a replayed step: every node's argmax and top-k log-probs against the reference's,
and the layer bisection of a node that fails.

Contract: :class:`NodeChecks` is the part of a request's replay (:mod:`refcheck.diff.request_replay`) that judges
a step's nodes, given the reference's log-probs ``logp`` [N, V] at the engine's tree. An argmax flip is a
benign tie under the tolerance's tie margin, a flip rounding at the engine's dtype explains (the walk then
follows the engine), or a failure; top-k log-probs over the cheap bound are held to the rounding ensemble
(:class:`~refcheck.diff.rounding_guard.RoundingGuard`), and at an anchor step those within it too. A failing
node of a step that carries layer sketches is bisected to its first differing layer (the finding's details:
``rel_l2`` there, ``per_layer_rel_l2`` at every layer, the ``tolerance`` they were held to). :meth:`fail`,
:meth:`track_max` and :meth:`token_flip` are the request's shared ways of reporting (the emitted-token,
draft and state checks use them too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddtree_reference.state import TargetState
from ddtree_reference.target import Target
from ddtree_reference.tree import Tree
from refcheck.diff.findings import Finding, Verdict
from refcheck.diff.rounding_guard import RoundingGuard
from refcheck.diff.tolerance import CALIBRATIONS, Tolerance
from refcheck.diff.triage import StepSpread
from refcheck.profile import timed
from refcheck.sketch import layer_sketch, rel_l2
from refcheck.trace.io import StepRow

#: under the fp32 reference's own precision nothing is judged (its bounds against transformers, CPU)
FLOOR = CALIBRATIONS[("float32", "cpu")].tolerance


def _topk_at(i: int) -> Callable[[StepSpread], float | None]:
    """The ensemble's log-prob spread at node ``i`` (what a judged node deviation is held to)."""
    return lambda sp: float(sp.topk[i])


def _margin_at(i: int) -> Callable[[StepSpread], float | None]:
    return lambda sp: float(sp.margin[i])


def _abs_dev(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| with NaN/inf in the engine's values counted as infinitely far (never a pass)."""
    dev = (got - ref).abs()
    return torch.where(torch.isfinite(got), dev, torch.full_like(dev, float("inf")))


class NodeChecks(RoundingGuard):
    """A request's node checks (mixed into the replay's request; its attributes are set there)."""

    target: Target
    tol: Tolerance
    ill_conditioned: dict[int, float]  # this step's nodes whose log-probs are consistent with rounding -> spread
    state: TargetState  # the reference state along the engine's committed path

    @property
    def factor(self) -> float:
        """The calibration's factor over the rounding spread (only worded where a rule judged)."""
        return self.rule.factor if self.rule is not None else float("nan")

    def fail(self, category: str, step: int | None, message: str, **kw: Any) -> None:
        self.rep.add(Finding(Verdict.FAIL, category, self.rid, step, message=message, **kw))

    def track_max(self, key: str, value: float) -> None:
        if value == value:  # NaN-safe: a NaN deviation is reported by the check itself
            self.rep.stats[key] = max(self.rep.stats.get(key, 0.0), value)

    def token_flip(self, category: str, step: int, node: int | None, logp: torch.Tensor, engine_tok: int, **kw: Any) -> bool:
        """Engine picked engine_tok where the reference's argmax differs. True if benign."""
        ref_tok = int(logp.argmax())
        margin = float(logp[ref_tok] - logp[engine_tok])
        top = logp.topk(min(5, logp.shape[-1]))
        details = {"engine_token": engine_tok, "reference_token": ref_tok, "margin": margin,
                   "reference_topk": list(zip(top.indices.tolist(), [round(v, 5) for v in top.values.tolist()]))}
        benign = margin < self.tol.tie_margin
        verdict = Verdict.BENIGN_TIE if benign else Verdict.FAIL
        msg = (f"engine token {engine_tok} vs reference {ref_tok} "
               f"({'near-tie' if benign else 'not a near-tie'}: margin {margin:.4g}, threshold {self.tol.tie_margin:g})")
        self.rep.add(Finding(verdict, category, self.rid, step, node=node, message=msg, details=details, **kw))
        return benign

    def check_nodes(self, s: StepRow, tree: Tree, logp: torch.Tensor, layers: list[torch.Tensor] | None) -> torch.Tensor:
        """Argmax and top-k log-probs at every node; returns the argmax to walk with (teacher-forced)."""
        self.rep.check("logits", tree.num_nodes)
        self.ill_conditioned = {}
        ref_arg = logp.argmax(dim=-1).cpu()
        eng_arg = torch.tensor(s.target_argmax, dtype=torch.long)
        if eng_arg.shape != ref_arg.shape:
            self.fail("logits", s.step, f"engine reported {eng_arg.shape[0]} argmaxes for {tree.num_nodes} nodes")
            return ref_arg
        walk, bad_nodes = self._check_argmax(s, tree, logp, ref_arg, eng_arg)
        if s.topk_ids:
            bad_nodes += self._check_topk(s, tree, logp)
        if bad_nodes and s.layer_sketch is not None and layers is not None:
            self.bisect(s, min(bad_nodes), layers)
        return walk

    def _check_argmax(self, s: StepRow, tree: Tree, logp: torch.Tensor, ref_arg: torch.Tensor, eng_arg: torch.Tensor
                      ) -> tuple[torch.Tensor, list[int]]:
        """Each node whose engine argmax differs: a near-tie, a flip rounding explains (the walk follows the
        engine there) or a failure; returns (the walk's argmax, the failing nodes)."""
        walk = ref_arg.clone()
        bad_nodes: list[int] = []
        for i in torch.nonzero(eng_arg != ref_arg).flatten().tolist():
            pos = self.state.length + int(tree.depths[i])
            lp = logp[i].cpu()
            margin = float(lp[ref_arg[i]] - lp[eng_arg[i]])
            spread = self.judged(margin, _margin_at(i)) if margin >= self.tol.tie_margin else None
            if spread is not None:
                self.consistent("logits", s.step, f"argmax flip at margin {margin:.4g}: engine token {int(eng_arg[i])} vs "
                                f"reference {int(ref_arg[i])}; rounding at the engine's dtype moves that margin by up to "
                                f"{spread:.4g} here", {"engine_token": int(eng_arg[i]), "reference_token": int(ref_arg[i]),
                                                       "margin": margin, "margin_spread": spread}, node=i, position=pos)
                walk[i] = eng_arg[i]
            elif self.token_flip("logits", s.step, i, lp, int(eng_arg[i]), position=pos):
                walk[i] = eng_arg[i]
            else:
                bad_nodes.append(i)
        return walk, bad_nodes

    def _check_topk(self, s: StepRow, tree: Tree, logp: torch.Tensor) -> list[int]:
        """The engine's top-k log-probs at every node: over the cheap bound, judged against rounding; at an anchor
        step, within it too. Returns the failing nodes."""
        n, bad_nodes = tree.num_nodes, []
        ids = torch.tensor(s.topk_ids, dtype=torch.long)
        lps = torch.tensor(s.topk_logprobs, dtype=torch.float32)
        dev = _abs_dev(lps, logp.cpu().gather(1, ids)).max(dim=1).values  # [N]
        self.track_max("max_logprob_abs", float(dev.max()))
        over = []
        for i in torch.nonzero(dev > self.tol.logprob_abs).flatten().tolist():
            spread = self.judged(float(dev[i]), _topk_at(i))
            if spread is None:
                over.append(i)
                continue
            self.ill_conditioned[i] = spread
            assert self.spread is not None  # judged() returned a spread: this step's ensemble ran
            median = self.spread().median_topk
            self.consistent("logits", s.step, f"log-probs off by {float(dev[i]):.4g}, within {self.factor:g}x of "
                            f"what rounding at the engine's dtype moves them here ({spread:.4g}; median node "
                            f"{median:.3g})", {"max_abs": float(dev[i]), "spread": spread, "median_spread": median},
                            node=i, position=self.state.length + int(tree.depths[i]))
        if over:
            i = over[0]
            self.fail("logits", s.step, f"top-k log-probs differ by up to {float(dev[over].max()):.4g} at {len(over)} "
                      f"of {n} nodes (first node {i}, tolerance {self.tol.logprob_abs:g})", node=i,
                      position=self.state.length + int(tree.depths[i]),
                      details={"max_abs": float(dev[over].max()), "nodes": over[:16]})
            bad_nodes.append(i)
        beyond = {}  # anchor step: nodes within the bound that rounding cannot move that far
        for i in torch.nonzero(dev <= self.tol.logprob_abs).flatten().tolist():
            spread = self.beyond_rounding(s.step, float(dev[i]), FLOOR.logprob_abs, _topk_at(i))
            if spread is not None:
                beyond[i] = spread
        if beyond:
            i = min(beyond)
            self.fail("logits", s.step, f"top-k log-probs differ by {float(dev[i]):.4g} at node {i}, more than "
                      f"{self.factor:g}x what rounding at the engine's dtype moves them here ({beyond[i]:.4g}; "
                      f"{len(beyond)} of {n} nodes; judged in full at the request's anchor steps)", node=i,
                      position=self.state.length + int(tree.depths[i]),
                      details={"max_abs": float(dev[i]), "spread": beyond[i], "anchor": True,
                               "nodes": sorted(beyond)[:16]})
            bad_nodes.append(i)
        return bad_nodes

    @timed("replay.bisect")
    def bisect(self, s: StepRow, node: int, layers: list[torch.Tensor]) -> None:
        ref = layer_sketch(torch.stack(layers))  # [layers, N, r]
        assert s.layer_sketch is not None  # bisect runs only on steps that carry layer sketches
        eng = s.layer_sketch.float()
        if eng.shape != ref.shape:
            self.fail("logits", s.step, f"layer sketches have shape {tuple(eng.shape)}, reference {tuple(ref.shape)}", node=node)
            return
        per_layer = [rel_l2(eng[layer, node], ref[layer, node]) for layer in range(ref.shape[0])]
        for layer, err in enumerate(per_layer):
            if err > self.tol.tensor_rel_l2:
                kind = "linear_attention" if self.target.is_linear(layer) else "attention"
                self.rep.add(Finding(Verdict.FAIL, "logits", self.rid, s.step, node=node, layer=layer, layer_type=kind,
                                     message=f"layer bisection: first differing layer {layer} ({kind}), rel L2 {err:.3g}",
                                     details={"rel_l2": err, "per_layer_rel_l2": per_layer,
                                              "tolerance": self.tol.tensor_rel_l2}))
                return
