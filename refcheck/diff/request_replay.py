"""One request's replay: the reference follows the engine's committed path step by step (:class:`RequestReplay`).

Contract: :class:`RequestReplay` is what :func:`refcheck.diff.replay.replay` runs per request (the checks, the
calibrated verdict and the acceptance account are described there). It holds the reference state along the
engine's committed path and the step's drafter-side state, and owns three parts, built once per request and
holding no reference back to it: :attr:`RequestReplay.findings` (:mod:`refcheck.diff.request_findings`: the
request's failures, token flips and running maxima), :attr:`RequestReplay.guard` (:mod:`refcheck.diff.rounding_guard`:
the rounding ensemble, the step's spreads and what they decide) and :attr:`RequestReplay.nodes`
(:mod:`refcheck.diff.node_checks`: argmax, top-k log-probs and layer bisection of a step's nodes). The draft,
state, emitted-token, output and sampled checks are the request's own; its drafter checks are in
:mod:`refcheck.diff.draft_checks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ddtree_reference.drafter import Drafter
from ddtree_reference.sampling import tempered_probs
from ddtree_reference.state import TargetState
from ddtree_reference.target import Target
from ddtree_reference.tree import Tree, TreeError
from refcheck.diff.acceptance import Account, DraftRule, StepAccount, cause_of
from refcheck.diff.distribution import Evidence
from refcheck.diff.draft_checks import check_context, check_drafted_tree, reference_tau, shadow_tau
from refcheck.diff.findings import Finding, Report, Verdict, worst_verdict
from refcheck.diff.node_checks import NodeChecks, abs_dev, topk_at
from refcheck.diff.request_findings import RequestFindings
from refcheck.diff.rounding_guard import FLOOR, RoundingGuard
from refcheck.diff.sampling import (
    CHILDREN_FIRST,
    SampledRequest,
    cdf_tolerance,
    replay_first_token,
    replay_sampled_step,
)
from refcheck.diff.temperature import Leans, node_leans
from refcheck.diff.tolerance import Calibration
from refcheck.diff.triage import RoundingEnsemble, StepSpread
from refcheck.profile import timed
from refcheck.sketch import as_recorded, cosine, rel_l2, state_rows
from refcheck.trace.io import StepRow

STATE_CATEGORY = {"kv_k": "kv", "kv_v": "kv", "conv": "conv", "rec": "recurrent"}


def _draft_at(d: int) -> Callable[[StepSpread], float | None]:
    return lambda sp: None if sp.draft is None else float(sp.draft[d])


def _state_at(name: str) -> Callable[[StepSpread], float | None]:
    return lambda sp: (sp.state or {}).get(name)


class RequestReplay:
    """Replay of one request: the reference state follows the engine's committed path."""

    def __init__(self, rep: Report, target: Target, drafter: Drafter, cal: Calibration, rid: str, stop: frozenset[int],
                 check_draft: bool = True, structural_trees: bool = False, ensemble: RoundingEnsemble | None = None,
                 sampled: SampledRequest | None = None, evidence: Evidence | None = None, rule: DraftRule | None = None,
                 leans: Leans | None = None) -> None:
        self.rep, self.target, self.drafter, self.tol, self.rid, self.stop = rep, target, drafter, cal.tolerance, rid, stop
        #: the engine's drafting rule and its acceptance account (None: no rule to hold its trees and τ to)
        self.draft_rule = rule if rule is not None else DraftRule("other", None, 0)
        self.ref_draft: torch.Tensor | None = None  # this step's reference draft [L, V], when computed
        self.pending_tau: tuple[int, bool, bool] | None = None  # this step's (τ reference, trees differ, walk tie)
        #: where this step's tree parts from the reference's: (reference draft's margin, depth), and the step's largest
        #: draft log-prob deviation (what must explain that margin for the parting to be a near-tie)
        self.tree_margin: tuple[float, int] | None = None
        self.draft_dev = 0.0
        self.account = Account(self.draft_rule.name)
        self.max_new_tokens: int | None = None  # the run's cap on each request's output (None: unknown)
        self.draft_missing = ""  # why the engine's capture could not record its drafter (": reason"), if it said
        self.shadow: int | None = None  # τ of this step's shadow tree under the reference's verify
        self.check_draft_enabled = check_draft
        self.structural_trees = structural_trees  # engine trees (SGLang NGRAM, ...) need not follow DDTree's rules
        self.capture = tuple(drafter.target_layer_ids)
        self._state: TargetState | None = None  # set by the first prefill, before any check reads it
        self.root: int | None = None
        self.findings = RequestFindings(rep, rid, cal.tolerance.tie_margin)
        self.guard = RoundingGuard(rep, rid, cal.rule, ensemble)
        self.nodes = NodeChecks(self.findings, self.guard, cal.tolerance, target)
        self.sampled = sampled  # the request's sampling (None: greedy)
        self.evidence = evidence if evidence is not None else Evidence()
        self.leans = leans if leans is not None else Leans()  # the keyed draws' leans (the temperature check)
        self.hidden = False  # some draw of this request could not be replayed exactly
        #: the trace's capture declares it holds some steps only (a sampled capture): the steps may end, or be
        #: missing altogether, before the output does
        self.some_steps = False

    @property
    def state(self) -> TargetState:
        """The reference state along the engine's committed path (prefilled before any step is replayed)."""
        assert self._state is not None, "replayed before the prefill"
        return self._state

    @state.setter
    def state(self, value: TargetState) -> None:
        self._state = value

    @property
    def sampling(self) -> SampledRequest:
        assert self.sampled is not None, "a sampled check on a greedy request"
        return self.sampled

    def fail(self, category: str, step: int | None, message: str, **kw: Any) -> None:
        """A failure of this request (:meth:`RequestFindings.fail`)."""
        self.findings.fail(category, step, message, **kw)

    # -- state handling ---------------------------------------------------------------------
    @timed("replay.prefill")
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """(Re)build the reference state and drafter context from committed tokens; last logp [V]."""
        dev = self.target.device
        self.state, fwd = self.target.prefill(torch.tensor(tokens, device=dev), capture=self.capture)
        self.drafter.reset()
        self.drafter.extend(fwd.context, torch.arange(len(tokens), device=dev), torch.tensor(tokens, device=dev))
        return torch.log_softmax(fwd.logits[-1], dim=-1)

    def step_verdict(self, since: int) -> None:
        """Count the step just replayed as pass / benign tie / triaged / fail by its worst finding."""
        worst = worst_verdict(f.verdict for f in self.rep.findings[since:])
        key = worst.value if worst is not None else "pass"
        steps = self.rep.stats.setdefault("steps", {"pass": 0, "benign_tie": 0, "fail": 0})
        steps[key] = steps.get(key, 0) + 1

    def check_draft(self, s: StepRow, ref: torch.Tensor | None) -> None:
        """The engine's draft top-k log-probs against the reference drafter's (``ref`` [L, k] at the
        engine's ids, computed by the caller; None when not comparable)."""
        if not self.check_draft_enabled:
            self.rep.add(Finding(Verdict.UNSUPPORTED, "draft", self.rid, s.step,
                                 message="drafts not comparable: scripted drafter at different numerics"))
            return
        if not s.draft_topk_ids:
            self.rep.add(Finding(Verdict.UNSUPPORTED, "draft", self.rid, s.step,
                                 message=f"engine recorded no draft top-k{self.draft_missing}"))
            return
        self.rep.check("draft")
        if ref is None:
            self.fail("draft", s.step, f"engine drafted {len(s.draft_topk_ids)} depths, more than the drafter's block")
            return
        dev = abs_dev(torch.tensor(s.draft_topk_logprobs, dtype=torch.float32), ref).amax(dim=1)  # [L]
        self.findings.track_max("max_draft_logprob_abs", float(dev.max()))
        self.draft_dev = float(dev.max())
        over = torch.nonzero(dev > self.tol.draft_logprob_abs).flatten().tolist()
        if not over:
            return
        depth = over[0] + 1
        spread = [self.guard.judged(float(dev[d]), _draft_at(d)) for d in over]
        details = {"max_abs": float(dev.max()), "depth": depth}
        held = [v for v in spread if v is not None]
        if len(held) == len(spread):
            self.guard.consistent("draft", s.step, f"draft log-probs off by up to {float(dev.max()):.4g} (first over "
                                  f"{self.tol.draft_logprob_abs:g} at depth {depth}), within {self.guard.factor:g}x of "
                                  f"what rounding at the engine's dtype moves them (up to {max(held):.4g})",
                                  {**details, "spread": max(held)})
            return
        bad = [d for d, v in zip(over, spread) if v is None]
        self.fail("draft", s.step, f"draft log-probs differ from the reference drafter's by {float(dev.max()):.4g} "
                  f"(first at depth {depth}); the drafter's context or input differs",
                  details={**details, "failing_depths": [d + 1 for d in bad]})

    @timed("replay.drafter")
    def draft_reference(self, s: StepRow) -> torch.Tensor | None:
        """The reference drafter's log-probs at the engine's draft ids ([L, k] float32), or None."""
        if not (self.check_draft_enabled and s.draft_topk_ids):
            return None
        ref = self.drafter.propose(s.tree_tokens[0], self.state.length, len(s.draft_topk_ids))  # [L, V]
        self.ref_draft = ref.float().cpu()
        ids = torch.tensor(s.draft_topk_ids, dtype=torch.long)
        if ids.shape[0] > ref.shape[0]:
            return None
        return ref[: ids.shape[0]].float().cpu().gather(1, ids)

    @staticmethod
    def compared_state(s: StepRow, ref_state: dict[str, tuple[int, str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The reference's committed entries that the engine recorded too, in the engine's form (rows or a
        sketch; :func:`refcheck.sketch.as_recorded`), by name: computed once a step, for the state checks and the
        rounding ensemble."""
        eng = {e.name: e for e in s.state}
        return {name: as_recorded(rows, eng[name].sketch, eng[name].full)
                for name, (_, _, rows) in ref_state.items() if name in eng}

    @timed("replay.state")
    def check_state(self, s: StepRow, ref_state: dict[str, tuple[int, str, torch.Tensor]],
                    compared: dict[str, torch.Tensor]) -> None:
        """The engine's committed state entries against the reference's (``ref_state``: by name, its layer, kind
        and rows; ``compared``: :meth:`compared_state`)."""
        if not s.state:
            for cat in ("kv", "conv", "recurrent"):
                self.rep.add(Finding(Verdict.UNSUPPORTED, cat, self.rid, s.step, message="engine recorded no state"))
            return
        ref = ref_state
        eng = {e.name: e for e in s.state}
        local = getattr(self.target, "local_layers", None)
        if local is not None:  # a layer-sharded reference: each rank checks the layers it holds
            mine = set(local())
            eng = {k: e for k, e in eng.items() if e.layer in mine}
            ref = {k: v for k, v in ref.items() if v[0] in mine}
        for name in sorted(set(ref) | set(eng)):
            if name not in ref or name not in eng:
                self.rep.check("unmatched")
                side = "reference" if name not in ref else "engine"
                self.fail("unmatched", s.step, f"state {name!r} missing in the {side} (no rule compares it)")
                continue
            layer, kind, _ = ref[name]
            cat = STATE_CATEGORY.get(kind, "unmatched")
            self.rep.check(cat)
            e = eng[name]
            got, want = (e.sketch if e.full is None else e.full).float(), compared[name]  # float: bf16 storage
            if got.shape != want.shape:
                self.fail(cat, s.step, f"{name}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}", layer=layer)
                continue
            if not bool(torch.isfinite(got).all()):  # NaN compares as no deviation at all: never let it pass
                self.fail(cat, s.step, f"{name}: the engine's state holds non-finite values (NaN or Inf)", layer=layer)
                continue
            err, cos = rel_l2(got, want), cosine(got, want)
            self.findings.track_max(f"max_rel_l2_{cat}", err)
            if err > self.tol.tensor_rel_l2 or cos < self.tol.tensor_min_cos:
                layer_type = "linear_attention" if self.target.is_linear(layer) else "attention"
                spread = self.guard.judged(err, _state_at(name))
                if spread is not None:
                    self.guard.consistent(cat, s.step, f"{name}: rel L2 {err:.3g}, cosine {cos:.6f}, within "
                                          f"{self.guard.factor:g}x of what rounding at the engine's dtype moves it "
                                          f"({spread:.3g})", {"rel_l2": err, "cosine": cos, "spread": spread},
                                          layer=layer, layer_type=layer_type)
                    continue
                self.fail(cat, s.step, f"{name}: rel L2 {err:.3g}, cosine {cos:.6f} (tolerance {self.tol.tensor_rel_l2:g} / "
                          f"{self.tol.tensor_min_cos:g})", layer=layer, layer_type=layer_type,
                          details={"rel_l2": err, "cosine": cos, "spread": self.guard.last_spread})
                continue
            spread = self.guard.beyond_rounding(s.step, err, FLOOR.tensor_rel_l2, _state_at(name))
            if spread is not None:
                self.fail(cat, s.step, f"{name}: rel L2 {err:.3g}, more than {self.guard.factor:g}x what rounding at the "
                          f"engine's dtype moves it ({spread:.3g}; judged in full at the request's anchor steps)",
                          layer=layer, layer_type="linear_attention" if self.target.is_linear(layer) else "attention",
                          details={"rel_l2": err, "cosine": cos, "spread": spread, "anchor": True})

    def check_emitted(self, s: StepRow, tree: Tree, logp: torch.Tensor, last: bool, ill: dict[int, float]) -> None:
        """The step's emitted tokens are its accepted path and bonus (cut at a stop token), with the reference's
        log-probs (``ill``: the step's nodes whose log-probs rounding explains -> their spread)."""
        expected = [int(tree.tokens[i]) for i in s.accepted[1:]] + [s.bonus]
        for j, tok in enumerate(expected):
            if tok in self.stop:
                expected = expected[: j + 1]
                break
        self.rep.check("output")
        ok = s.emitted == expected or (last and s.emitted == expected[: len(s.emitted)] and s.emitted)
        if not ok:
            self.fail("output", s.step, f"emitted {s.emitted} but the accepted path and bonus give {expected}",
                      details={"emitted": s.emitted, "expected": expected})
            return
        self.rep.check("logprobs", len(s.emitted))
        if len(s.emitted_logprobs) != len(s.emitted):
            self.fail("logprobs", s.step, f"{len(s.emitted_logprobs)} log-probs for {len(s.emitted)} emitted tokens")
            return
        rule = self.guard.rule
        for j, (tok, lp) in enumerate(zip(s.emitted, s.emitted_logprobs)):
            ref = float(logp[s.accepted[j], tok])
            node = s.accepted[j]
            if math.isfinite(lp) and abs(lp - ref) > self.tol.logprob_abs and node in ill \
                    and rule is not None and rule.covers(abs(lp - ref), ill[node]):
                self.guard.consistent("logprobs", s.step, f"log-prob of emitted token {j} ({tok}) {lp:.5g} vs reference "
                                      f"{ref:.5g} at a node whose log-probs rounding moves by up to {ill[node]:.4g}",
                                      {"index": j, "engine": lp, "reference": ref, "spread": ill[node]}, node=node)
                continue
            if not math.isfinite(lp) or abs(lp - ref) > self.tol.logprob_abs:
                what = "missing (NaN)" if math.isnan(lp) else f"{lp:.5g} vs reference {ref:.5g}"
                self.fail("logprobs", s.step, f"log-prob of emitted token {j} ({tok}) {what}", node=s.accepted[j],
                          details={"index": j, "engine": lp, "reference": ref})
                return

    # -- the walk ---------------------------------------------------------------------------------
    def probs(self, logp: torch.Tensor) -> torch.Tensor:
        """The sampling distribution at each row of ``logp`` ``[N, V]``: ``[N, V]`` float64 on the host."""
        s = self.sampling.sampling
        return tempered_probs(logp.cpu(), s.temperature, s.top_k, s.top_p)

    def cdf_tol(self, calibrated: bool = False) -> float:
        """How far a draw may sit outside its CDF interval as a benign tie: the dtype's cheap log-prob bound, or,
        where the calibration's rounding rule judges the step (``calibrated``), the fp32 floor."""
        bound = FLOOR.logprob_abs if calibrated and self.guard.rule is not None else self.tol.logprob_abs
        return cdf_tolerance(bound, self.sampling.sampling.temperature)

    def check_sampled_step(self, s: StepRow, tree: Tree, logp: torch.Tensor) -> None:
        """Exact replay of the step's draws, and its evidence for the distributional test. In the engine's dtype
        a draw beyond the fp32 floor is held to the node's rounding spread (sampling.py's module docstring)."""
        probs = self.probs(logp)  # [N, V]
        self.rep.check("sampling")
        judge = None if self.guard.rule is None else \
            (lambda node, dev: self.guard.judged(dev, topk_at(node)))
        res = replay_sampled_step(self.rid, s, tree, probs, self.sampling, self.cdf_tol(calibrated=True), judge,
                                  logp.cpu())
        for f in res.findings:
            self.rep.add(f)
        for node, (what, dev, spread) in sorted(res.rounding.items()):
            self.guard.consistent("sampling", s.step, f"{what} at node {node}: the logits would move by {dev:.4g}, "
                                  f"within {self.guard.factor:g}x of what rounding at the engine's dtype moves them "
                                  f"({spread:.4g})", {"deviation": dev, "spread": spread}, node=node)
        self.hidden |= not res.exact
        n = tree.num_nodes
        path = [a for a in s.accepted if 0 <= a < n]
        self.record_leans(s, tree, path, logp, probs)
        for node, tok in zip(path, s.emitted):
            if node in res.rounding and probs[node, tok] <= 0:  # a token rounding moved into the support
                self.rep.stats["distribution_rounding_excluded"] = self.rep.stats.get("distribution_rounding_excluded", 0) + 1
                continue
            self.evidence.add_token(self.rid, probs[node], tok)
        for j, node in enumerate(path):
            kids = tree.children(node)
            if kids:
                a = float(probs[node, list(kids)].sum())
                self.evidence.add_walk(self.rid, int(tree.depths[node]) + 1, j + 1 < len(path), a)

    def check_bounds(self, output: list[int]) -> None:
        """The engine's output itself, whatever its steps say: at most ``max_new_tokens`` tokens, none past the
        first stop token."""
        self.rep.check("output")
        if self.max_new_tokens is not None and len(output) > self.max_new_tokens:
            self.fail("output", None, f"the request emitted {len(output)} tokens; max_new_tokens is {self.max_new_tokens}",
                      details={"emitted": len(output), "max_new_tokens": self.max_new_tokens})
        stop = next((i for i, t in enumerate(output) if t in self.stop), None)
        if stop is not None and stop < len(output) - 1:
            self.fail("output", None, f"the request emitted {len(output) - stop - 1} tokens after stop token "
                      f"{output[stop]} (index {stop})", details={"stop_index": stop, "emitted": len(output)})

    def record_leans(self, s: StepRow, tree: Tree, path: list[int], logp: torch.Tensor, probs: torch.Tensor) -> None:
        """The temperature check's evidence of a step: the lean of every node draw whose uniform is known (the
        engine's draw where it exposed one, else the token its walk took there: the next path node's or the
        bonus). Children-first engines draw in another order and are not judged here."""
        if self.sampling.rng == CHILDREN_FIRST:
            return
        n, V = probs.shape
        tokens = {i: int(d) for i, d in enumerate(s.node_draws[:n]) if d >= 0}
        for j, node in enumerate(path):
            tokens.setdefault(node, int(tree.tokens[path[j + 1]]) if j + 1 < len(path) else s.bonus)
        nodes = [i for i in sorted(tokens) if i < len(s.node_uniforms) and s.node_uniforms[i] == s.node_uniforms[i]
                 and 0 <= tokens[i] < V]
        if nodes:
            idx = torch.tensor(nodes, dtype=torch.long)
            self.leans.add(self.rid, s.step, node_leans(logp.cpu()[idx], probs[idx], [s.node_uniforms[i] for i in nodes],
                                                        [tokens[i] for i in nodes]))

    def run(self, prompt: list[int], output: list[int], output_lps: list[float], steps: list[StepRow],
            first_uniform: float = float("nan")) -> None:
        P = len(prompt)
        if not output and not steps:
            self.rep.add(Finding(Verdict.SKIPPED, "output", self.rid, None, message="request has no output and no steps"))
            return
        self.check_bounds(output)
        logp0 = self.prefill(prompt)
        self.rep.check("output")
        if output and self.sampled is not None:
            probs0 = self.probs(logp0[None])  # [1, V]
            self.rep.check("sampling")
            found, exact = replay_first_token(self.rid, output[0], probs0, first_uniform, self.sampled, P, self.cdf_tol())
            for f in found:
                self.rep.add(f)
            self.hidden |= not exact
            self.evidence.add_token(self.rid, probs0[0], output[0])
            if exact and 0 <= output[0] < probs0.shape[1]:
                self.leans.add(self.rid, -1, node_leans(logp0.cpu()[None], probs0, [first_uniform], [output[0]]))
        elif output and int(logp0.argmax()) != output[0]:
            self.findings.token_flip("output", -1, None, logp0.cpu(), output[0], position=P)
        if output and output_lps:
            self.rep.check("logprobs")
            ref = float(logp0[output[0]])
            if not math.isfinite(output_lps[0]) or abs(output_lps[0] - ref) > self.tol.logprob_abs:
                self.fail("logprobs", -1, f"log-prob of the first token {output_lps[0]:.5g} vs reference {ref:.5g}")
        self.root = output[0] if output else None
        emitted_all, emitted_lps = output[:1], output_lps[:1]
        start, last_step, gapped = len(self.rep.findings), -1, self.some_steps
        try:
            for k, s in enumerate(steps):
                if s.step != last_step + 1 and self.cross_gap(s, prompt, output):
                    emitted_all, gapped = output[: s.committed_len - P + 1], True
                last_step = s.step
                since = self.guard.open_step()
                self.pending_tau = self.shadow = self.tree_margin = None
                self.draft_dev = 0.0
                usable = self.replay_step(s, last=k == len(steps) - 1, prompt=prompt, output=output)
                self.guard.settle(s.step)
                self.account_step(s, since)
                self.step_verdict(since)
                if not usable:
                    return  # the engine's step cannot be followed: later steps would only repeat this finding
                emitted_all += s.emitted
                emitted_lps += s.emitted_logprobs
        finally:
            self.guard.withdraw(start)
        self.check_output(output, output_lps, emitted_all, emitted_lps, P, gapped)

    def cross_gap(self, s: StepRow, prompt: list[int], output: list[int]) -> bool:
        """A step after steps the capture did not record (a sampled capture, or records it lost): the reference
        re-prefills the engine's committed tokens up to the step's root; False when the step's committed length
        does not lie inside the output (the alignment check then fails it)."""
        done = s.committed_len - len(prompt)
        if not 0 <= done < len(output) or s.committed_len == self.state.length:
            return False
        self.prefill(prompt + output[:done])
        self.root = output[done]
        self.rep.stats["gaps_crossed"] = self.rep.stats.get("gaps_crossed", 0) + 1
        return True

    def check_output(self, output: list[int], output_lps: list[float], emitted_all: list[int], emitted_lps: list[float],
                     prompt_len: int, gapped: bool) -> None:
        """The request's output is the steps' emitted tokens (after a gap: they are where their steps put them, and
        the recorded steps may end before the output does)."""
        self.rep.check("output")
        want = output[: len(emitted_all)] if gapped else output
        if emitted_all != want:
            i = next((j for j, (a, b) in enumerate(zip(emitted_all, output)) if a != b), min(len(emitted_all), len(output)))
            self.fail("output", None, f"request output differs from the steps' emitted tokens at index {i}",
                      position=prompt_len + i, details={"index": i})
        elif output_lps and not gapped:
            self.check_output_logprobs(output_lps, emitted_lps, prompt_len)

    def check_output_logprobs(self, output_lps: list[float], emitted_lps: list[float], prompt_len: int) -> None:
        """The request's output log-probs are the engine's own per-step reports of the same tokens (the first
        token's is judged against the reference above): one per output token, and each the value its step
        reported (NaN, "not reported", only where the step has none either; +inf never)."""
        if len(output_lps) != len(emitted_lps):
            self.fail("output", None, f"the request records {len(output_lps)} output log-probs for "
                      f"{len(emitted_lps)} output tokens", details={"logprobs": len(output_lps)})
            return
        for i, (a, b) in enumerate(zip(output_lps[1:], emitted_lps[1:]), start=1):
            same = (math.isnan(a) and math.isnan(b)) or a == b or (
                math.isfinite(a) and math.isfinite(b) and abs(a - b) <= self.tol.logprob_abs)
            if not same or a == math.inf:
                self.fail("output", None, f"the request's output log-prob at index {i} is {a:.5g} where its step "
                          f"reported {b:.5g}", position=prompt_len + i, details={"index": i})
                return

    def near_tie_parting(self) -> bool:
        """Whether the engine's tree parts from the reference's where the step's draft deviation explains it: the
        reference's draft prefers its path by at most twice the largest draft deviation per depth of the path (each
        side's score moves by at most that much per depth). The margin is recorded in the report's stats."""
        if self.tree_margin is None:
            return False
        margin, depth = self.tree_margin
        bound = 2 * depth * max(self.draft_dev, FLOOR.draft_logprob_abs)
        ratios = self.rep.stats.setdefault("tree_parting_margins", [])
        ratios.append(round(margin / bound, 4) if bound > 0 and math.isfinite(margin) else None)
        return math.isfinite(margin) and margin <= bound

    def account_step(self, s: StepRow, since: int) -> None:
        """The step's τ beside the reference's (same rule, same prefix), with the cause of any difference; an
        unexplained difference fails ``acceptance`` (:mod:`refcheck.diff.acceptance`)."""
        if self.shadow is not None:
            sh = self.rep.stats.setdefault("shadow", {"steps": 0, "tau_engine": 0, "tau_shadow_tree": 0})
            sh["steps"] += 1
            sh["tau_engine"] += s.accept_length
            sh["tau_shadow_tree"] += self.shadow
        if self.pending_tau is None:
            if self.sampled is None and self.draft_rule.name in ("ddtree", "chain") and not s.draft_topk_ids:
                self.account.unrecorded += 1
            return
        tau_ref, trees_differ, tie = self.pending_tau
        tau = len(s.accepted)
        cause = None
        if tau != tau_ref:
            found = self.rep.findings[since:]
            failed = {f.category for f in found if f.verdict == Verdict.FAIL}
            excused = (trees_differ and bool(s.draft_topk_ids) and "draft" not in failed and self.near_tie_parting()) \
                or (not trees_differ and tie) or any(f.verdict in (Verdict.BENIGN_TIE, Verdict.TRIAGED) and
                                                     f.category in ("tree", "logits") for f in found)
            cause = cause_of(failed, trees_differ, excused, bool(s.draft_topk_ids))
            self.rep.check("acceptance")
            if cause == "unexplained":
                self.fail("acceptance", s.step, f"τ {tau} where the reference's {self.draft_rule.name} step at this "
                          f"prefix gives {tau_ref}, and no check of the step explains it",
                          details={"tau_engine": tau, "tau_reference": tau_ref, "trees_differ": trees_differ})
        self.account.add(StepAccount(self.rid, s.step, tau, tau_ref, cause))

    def check_layer_sketch(self, s: StepRow) -> bool:
        """Whether the step carries layer sketches to bisect with; non-finite ones (NaN compares as no deviation)
        fail the step's logits, naming the first layer and node that holds one."""
        sk = s.layer_sketch
        if sk is None:
            return False
        bad = torch.nonzero(~torch.isfinite(sk.float()).flatten(2).all(dim=-1))  # [k, 2]: (layer, node) pairs
        if bad.numel():
            layer, node = (int(v) for v in bad[0])
            self.rep.check("logits")
            self.fail("logits", s.step, f"the engine's layer sketch holds non-finite values (NaN or Inf) at layer "
                      f"{layer}, node {node}", node=node, layer=layer)
            return False
        return True

    def engine_tree(self, s: StepRow) -> Tree | None:
        """The tree the engine verified at step ``s``, checked against the tree rules (structural ones only for
        engines whose trees need not follow DDTree's); None, with a failure, when it is malformed."""
        self.rep.check("tree")
        try:
            n = len(s.tree_tokens)
            tree = Tree(torch.tensor(s.tree_tokens), torch.tensor(s.tree_parents), torch.tensor(s.tree_depths),
                        torch.tensor(s.tree_ranks), torch.zeros(n))
            tree.validate(structural_only=self.structural_trees)
        except (TreeError, RuntimeError, ValueError) as exc:
            self.fail("tree", s.step, f"malformed tree: {exc}")
            return None
        return tree

    @timed("replay.verify", counter="steps_replayed")
    def replay_step(self, s: StepRow, last: bool, prompt: list[int], output: list[int]) -> bool:
        """Re-verify one engine step and follow its commit; False when the step cannot be followed."""
        P, root = len(prompt), self.root
        self.rep.check("alignment")
        if s.committed_len != self.state.length or s.tree_tokens[:1] != [root]:
            self.fail("alignment", s.step, f"engine step at committed length {s.committed_len} with root "
                      f"{s.tree_tokens[:1]}, reference at {self.state.length} with root {root}")
            done = s.committed_len - P
            if not 0 <= done < len(output):
                return False
            self.prefill(prompt + output[:done])
        tree = self.engine_tree(s)
        if tree is None:
            return False
        n = tree.num_nodes
        want_layers = self.check_layer_sketch(s)
        fwd = self.target.forward(self.state, tree.tokens, tree.parents, tree.depths, capture=self.capture,
                                  keep_layer_outputs=want_layers)
        logp = torch.log_softmax(fwd.logits, dim=-1)
        self.ref_draft = None
        draft_ref = self.draft_reference(s)
        prev = self.state.length
        valid_path = bool(s.accepted) and s.accepted[0] == 0 and all(0 <= a < n for a in s.accepted) \
            and s.accepted == tree.path(s.accepted[-1])
        new_state = self.state.commit(fwd, s.accepted) if valid_path else None
        ref_state = state_rows(new_state, prev) if new_state is not None else {}
        compared = self.compared_state(s, ref_state)
        self.guard.step_ensemble(s, tree, logp, prompt + output[: s.committed_len - P], draft_ref, compared)
        self.check_draft(s, draft_ref)
        check_drafted_tree(self, s)
        check_context(self, s, tree, fwd.context, prev)
        walk, ill = self.nodes.check(s, tree, logp, fwd.layer_outputs, prev)
        if self.sampled is not None:
            self.check_sampled_step(s, tree, logp)
        ref_acc = tree.walk_greedy(walk) if self.sampled is None else list(s.accepted)
        self.rep.check("accepted_path")
        if s.accepted != ref_acc:
            self.fail("accepted_path", s.step, f"engine accepted {s.accepted}, the greedy walk gives {ref_acc}",
                      details={"engine": s.accepted, "reference": ref_acc})
        self.pending_tau = reference_tau(self, s, tree, logp) if valid_path else None
        self.shadow = shadow_tau(self, s)
        self.rep.check("accept_length")
        if s.accept_length != len(s.accepted):
            self.fail("accept_length", s.step, f"engine reports τ={s.accept_length} for {len(s.accepted)} accepted nodes "
                      f"(τ counts root+accepted = drafted tokens accepted + 1, bonus included)")
        if new_state is None:
            self.fail("accepted_path", s.step, f"engine's accepted nodes {s.accepted} are not a root path of its tree")
            return False
        self.rep.check("bonus")
        if self.sampled is None and s.bonus != int(walk[s.accepted[-1]]):
            self.findings.token_flip("bonus", s.step, s.accepted[-1], logp[s.accepted[-1]].cpu(), s.bonus)
        self.check_emitted(s, tree, logp, last, ill)
        self.check_state(s, ref_state, compared)
        acc = torch.tensor(s.accepted, device=self.target.device)
        self.drafter.extend(fwd.context[acc], prev + tree.depths.to(acc.device)[acc], tree.tokens.to(acc.device)[acc])
        self.state = new_state
        self.root = s.bonus
        return True

