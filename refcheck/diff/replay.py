"""Replay mode: the reference re-verifies every engine step with the engine's own tree at the
engine's own committed prefix.

Contract: :func:`replay` walks each request of an engine trace step by step. For every step it
runs the reference verify on the engine's tree (so verify/commit bugs are isolated even when the
engine's drafts differ from the reference's), then checks, each counted in the report:

* alignment (committed length and root), tree structure;
* the drafter's top-k log-probs (when recorded) against the reference drafter fed the correct
  context (root + accepted nodes);
* every node's argmax and top-k log-probs ("logits"); an argmax flip is a benign tie when the
  reference's margin is under the tolerance, and comparison continues teacher-forced on the
  engine's choice; a real flip gets **layer bisection** when the trace has layer sketches;
* the accepted path, τ (bonus counted), the bonus, the emitted tokens and their log-probs;
* the committed KV rows, conv and recurrent state per layer (sketches or full tensors).

Opt-in triage rules (:class:`refcheck.diff.triage.Triage`) report a failing node as TRIAGED with
their evidence: ``isolated`` (its argmax and every descendant agree) and ``ill_conditioned`` (the
engine dtype's rounding, emulated by a seeded ensemble of the reference, moves the node as far).

The reference then commits the *engine's* accepted path, so one bug does not cascade into every
later step; if the engine's step is unusable, the reference re-prefills the engine's committed
tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from refcheck.diff.findings import Finding, Report, Verdict, worst_verdict
from refcheck.diff.tolerance import Tolerance
from refcheck.diff.triage import RoundingEnsemble, StepSpread, Triage
from refcheck.profile import timed
from refcheck.sketch import cosine, layer_sketch, rel_l2, sketch_rows, state_rows
from refcheck.trace.io import StepRow, Trace
from reference.drafter import Drafter
from reference.state import TargetState
from reference.target import Target
from reference.tree import Tree, TreeError

STATE_CATEGORY = {"kv_k": "kv", "kv_v": "kv", "conv": "conv", "rec": "recurrent"}


def _abs_dev(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| with NaN/inf in the engine's values counted as infinitely far (never a pass)."""
    dev = (got - ref).abs()
    return torch.where(torch.isfinite(got), dev, torch.full_like(dev, float("inf")))


class _Request:
    """Replay of one request: the reference state follows the engine's committed path."""

    def __init__(self, rep: Report, target: Target, drafter: Drafter, tol: Tolerance, rid: str, stop: frozenset[int],
                 check_draft: bool = True, structural_trees: bool = False, triage: Triage = Triage(),
                 ensemble: RoundingEnsemble | None = None):
        self.rep, self.target, self.drafter, self.tol, self.rid, self.stop = rep, target, drafter, tol, rid, stop
        self.check_draft_enabled = check_draft
        self.structural_trees = structural_trees  # engine trees (SGLang NGRAM, ...) need not follow DDTree's rules
        self.triage = triage
        self.ensemble = ensemble  # set when triage.ill_conditioned
        #: this step's nodes triaged as ill-conditioned -> their log-prob spread under rounding noise
        self.ill_conditioned: dict[int, float] = {}
        self.capture = tuple(drafter.target_layer_ids)
        self.state: TargetState | None = None
        self.root: int | None = None

    def fail(self, category: str, step: int | None, message: str, **kw) -> None:
        self.rep.add(Finding(Verdict.FAIL, category, self.rid, step, message=message, **kw))

    # -- state handling ---------------------------------------------------------------------
    @timed("replay.prefill")
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """(Re)build the reference state and drafter context from committed tokens; last logp [V]."""
        dev = self.target.device
        self.state, fwd = self.target.prefill(torch.tensor(tokens, device=dev), capture=self.capture)
        self.drafter.reset()
        self.drafter.extend(fwd.context, torch.arange(len(tokens), device=dev), torch.tensor(tokens, device=dev))
        return torch.log_softmax(fwd.logits[-1], dim=-1)

    def track_max(self, key: str, value: float) -> None:
        if value == value:  # NaN-safe: a NaN deviation is reported by the check itself
            self.rep.stats[key] = max(self.rep.stats.get(key, 0.0), value)

    def step_verdict(self, since: int) -> None:
        """Count the step just replayed as pass / benign tie / triaged / fail by its worst finding."""
        worst = worst_verdict(f.verdict for f in self.rep.findings[since:])
        key = worst.value if worst is not None else "pass"
        steps = self.rep.stats.setdefault("steps", {"pass": 0, "benign_tie": 0, "fail": 0})
        steps[key] = steps.get(key, 0) + 1

    # -- checks -------------------------------------------------------------------------------
    def token_flip(self, category: str, step: int, node: int | None, logp: torch.Tensor, engine_tok: int, **kw) -> bool:
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

    @timed("replay.drafter")
    def check_draft(self, s: StepRow) -> None:
        if not self.check_draft_enabled:
            self.rep.add(Finding(Verdict.UNSUPPORTED, "draft", self.rid, s.step,
                                 message="drafts not comparable: scripted drafter at different numerics"))
            return
        if not s.draft_topk_ids:
            self.rep.add(Finding(Verdict.UNSUPPORTED, "draft", self.rid, s.step, message="engine recorded no draft top-k"))
            return
        self.rep.check("draft")
        ref = self.drafter.propose(s.tree_tokens[0], self.state.length, len(s.draft_topk_ids))  # [L, V]
        ids = torch.tensor(s.draft_topk_ids, dtype=torch.long)
        lps = torch.tensor(s.draft_topk_logprobs, dtype=torch.float32)
        if ids.shape[0] > ref.shape[0]:
            self.fail("draft", s.step, f"engine drafted {ids.shape[0]} depths, the drafter has {ref.shape[0]}")
            return
        dev = _abs_dev(lps, ref[: ids.shape[0]].cpu().gather(1, ids))  # [L, k]
        if float(dev.max()) > self.tol.draft_logprob_abs:
            depth = int(dev.max(dim=1).values.argmax()) + 1
            self.fail("draft", s.step, f"draft log-probs differ from the reference drafter's by {float(dev.max()):.4g} "
                      f"(first at depth {depth}); the drafter's context or input differs",
                      details={"max_abs": float(dev.max()), "depth": depth})

    def check_nodes(self, s: StepRow, tree: Tree, logp: torch.Tensor, layers: list[torch.Tensor] | None,
                    committed: list[int]) -> torch.Tensor:
        """Argmax and top-k log-probs at every node; returns the argmax to walk with (teacher-forced)."""
        n = tree.num_nodes
        self.rep.check("logits", n)
        self.ill_conditioned = {}
        ref_arg = logp.argmax(dim=-1).cpu()
        eng_arg = torch.tensor(s.target_argmax, dtype=torch.long)
        if eng_arg.shape != ref_arg.shape:
            self.fail("logits", s.step, f"engine reported {eng_arg.shape[0]} argmaxes for {n} nodes")
            return ref_arg
        # the rounding ensemble runs once, and only for a step that has a node to judge
        spread = functools.cache(lambda: self.step_spread(s, tree, logp, committed, ref_arg, eng_arg))
        walk = ref_arg.clone()
        bad_nodes: list[int] = []
        for i in torch.nonzero(eng_arg != ref_arg).flatten().tolist():
            pos = self.state.length + int(tree.depths[i])
            lp = logp[i].cpu()
            margin = float(lp[ref_arg[i]] - lp[eng_arg[i]])
            if margin >= self.tol.tie_margin and self.ensemble is not None \
                    and self.triage.covers(margin, float(spread().margin[i])):
                self.triage_ill_conditioned("logits", s, i, pos, spread(), flip=(int(eng_arg[i]), int(ref_arg[i]), margin))
                walk[i] = eng_arg[i]
            elif self.token_flip("logits", s.step, i, lp, int(eng_arg[i]), position=pos):
                walk[i] = eng_arg[i]
            else:
                bad_nodes.append(i)
        if s.topk_ids:
            ids = torch.tensor(s.topk_ids, dtype=torch.long)
            lps = torch.tensor(s.topk_logprobs, dtype=torch.float32)
            dev = _abs_dev(lps, logp.cpu().gather(1, ids)).max(dim=1).values  # [N]
            self.track_max("max_logprob_abs", float(dev.max()))
            over = torch.nonzero(dev > self.tol.logprob_abs).flatten().tolist()
            if over and self.triage.isolated:
                over = self.triage_isolated_nodes(s, tree, over, dev, eng_arg, ref_arg)
            if over and self.ensemble is not None:
                keep = []
                for i in over:
                    if self.triage.covers(float(dev[i]), float(spread().topk[i])):
                        self.triage_ill_conditioned("logits", s, i, self.state.length + int(tree.depths[i]), spread(),
                                                    dev=float(dev[i]))
                    else:
                        keep.append(i)
                over = keep
            if over:
                i = over[0]
                self.fail("logits", s.step, f"top-k log-probs differ by up to {float(dev.max()):.4g} at {len(over)} of {n} nodes "
                          f"(first node {i}, tolerance {self.tol.logprob_abs:g})", node=i,
                          position=self.state.length + int(tree.depths[i]), details={"max_abs": float(dev.max()), "nodes": over[:16]})
                bad_nodes.append(i)
        if bad_nodes and s.layer_sketch is not None and layers is not None:
            self.bisect(s, min(bad_nodes), layers)
        return walk

    @timed("ensemble", counter="ensemble_steps")
    def step_spread(self, s: StepRow, tree: Tree, logp: torch.Tensor, committed: list[int], ref_arg: torch.Tensor,
                    eng_arg: torch.Tensor) -> StepSpread:
        """The rounding ensemble's spread at every node of this step (columns: the engine's top-k ids,
        the reference's argmax, the engine's argmax)."""
        n = tree.num_nodes
        ids = torch.tensor(s.topk_ids, dtype=torch.long) if s.topk_ids else torch.zeros(n, 0, dtype=torch.long)
        cols = torch.cat([ids, ref_arg[:, None], eng_arg.clamp(0, logp.shape[-1] - 1)[:, None]], dim=1)  # [N, k+2]
        samples = self.ensemble.sample(committed, tree.tokens, tree.parents, tree.depths, cols)  # [S, N, k+2]
        return StepSpread.of(samples, logp.cpu().gather(1, cols), ids.shape[1])

    def triage_ill_conditioned(self, category: str, s: StepRow, node: int, position: int, spread: StepSpread,
                               dev: float | None = None, flip: tuple[int, int, float] | None = None) -> None:
        t = self.triage
        self.ill_conditioned[node] = float(spread.topk[node])
        common = (f"rounding noise at the engine's unit roundoff ({self.ensemble.u:.3g}, {t.samples} samples) moves the "
                  f"reference's log-probs here by up to {float(spread.topk[node]):.4g} (median node "
                  f"{spread.median_topk:.3g})")
        if flip is not None:
            eng_tok, ref_tok, margin = flip
            msg = (f"ill-conditioned node: engine token {eng_tok} vs reference {ref_tok} at margin {margin:.4g}; the same "
                   f"noise moves that margin by up to {float(spread.margin[node]):.4g}; {common}")
            details = {"engine_token": eng_tok, "reference_token": ref_tok, "margin": margin}
        else:
            msg = f"ill-conditioned node: log-probs off by {dev:.4g}, within {t.factor:g}x of what {common}"
            details = {"max_abs": dev}
        details.update(spread=float(spread.topk[node]), margin_spread=float(spread.margin[node]),
                       median_spread=spread.median_topk, samples=t.samples, factor=t.factor, rule="ill_conditioned")
        self.rep.add(Finding(Verdict.TRIAGED, category, self.rid, s.step, node=node, position=position, message=msg,
                             details=details))

    def triage_isolated_nodes(self, s: StepRow, tree: Tree, over: list[int], dev: torch.Tensor, eng_arg: torch.Tensor,
                              ref_arg: torch.Tensor) -> list[int]:
        """Opt-in triage: a node whose log-probs deviate beyond tolerance while its argmax agrees and every
        descendant stays within tolerance is reported TRIAGED, not failed. A wrong state, mask or position
        at a node reaches its descendants (they attend to it or inherit its recurrent state), so a
        deviation confined to one node is rounding at that node's output; leaves, having no
        descendants, cannot be judged and stay failures. Returns the nodes that still fail."""
        parents = s.tree_parents
        keep = []
        for i in over:
            desc = [j for j in range(len(parents)) if j != i and i in tree.path(j)]
            clean = bool(desc) and float(dev[desc].max()) <= self.tol.logprob_abs \
                and bool((eng_arg[desc] == ref_arg[desc]).all()) and int(eng_arg[i]) == int(ref_arg[i])
            if not clean:
                keep.append(i)
                continue
            self.rep.add(Finding(Verdict.TRIAGED, "logits", self.rid, s.step, node=i,
                                 position=self.state.length + int(tree.depths[i]),
                                 message=f"isolated deviation: log-probs off by {float(dev[i]):.4g} at this node only; "
                                         f"its {len(desc)} descendants stay within {self.tol.logprob_abs:g} "
                                         f"(max {float(dev[desc].max()):.3g})",
                                 details={"max_abs": float(dev[i]), "descendants": len(desc)}))
        return keep

    @timed("replay.bisect")
    def bisect(self, s: StepRow, node: int, layers: list[torch.Tensor]) -> None:
        ref = layer_sketch(torch.stack(layers))  # [layers, N, r]
        eng = s.layer_sketch.float()
        if eng.shape != ref.shape:
            self.fail("logits", s.step, f"layer sketches have shape {tuple(eng.shape)}, reference {tuple(ref.shape)}", node=node)
            return
        for layer in range(ref.shape[0]):
            err = rel_l2(eng[layer, node], ref[layer, node])
            if err > self.tol.tensor_rel_l2:
                kind = "linear_attention" if self.target.is_linear(layer) else "attention"
                self.rep.add(Finding(Verdict.FAIL, "logits", self.rid, s.step, node=node, layer=layer, layer_type=kind,
                                     message=f"layer bisection: first differing layer {layer} ({kind}), rel L2 {err:.3g}",
                                     details={"rel_l2": err}))
                return

    @timed("replay.state")
    def check_state(self, s: StepRow, new_state: TargetState, new_from: int) -> None:
        if not s.state:
            for cat in ("kv", "conv", "recurrent"):
                self.rep.add(Finding(Verdict.UNSUPPORTED, cat, self.rid, s.step, message="engine recorded no state"))
            return
        ref = state_rows(new_state, new_from)
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
            layer, kind, rows = ref[name]
            cat = STATE_CATEGORY.get(kind, "unmatched")
            self.rep.check(cat)
            e = eng[name]
            got, want = (e.full.float(), rows.float().cpu()) if e.full is not None else (e.sketch.float(), sketch_rows(rows))
            if got.shape != want.shape:
                self.fail(cat, s.step, f"{name}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}", layer=layer)
                continue
            err, cos = rel_l2(got, want), cosine(got, want)
            self.track_max(f"max_rel_l2_{cat}", err)
            if err > self.tol.tensor_rel_l2 or cos < self.tol.tensor_min_cos:
                layer_type = "linear_attention" if self.target.is_linear(layer) else "attention"
                self.fail(cat, s.step, f"{name}: rel L2 {err:.3g}, cosine {cos:.6f} (tolerance {self.tol.tensor_rel_l2:g} / "
                          f"{self.tol.tensor_min_cos:g})", layer=layer, layer_type=layer_type,
                          details={"rel_l2": err, "cosine": cos})

    def check_emitted(self, s: StepRow, tree: Tree, logp: torch.Tensor, last: bool) -> None:
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
        for j, (tok, lp) in enumerate(zip(s.emitted, s.emitted_logprobs)):
            ref = float(logp[s.accepted[j], tok])
            node = s.accepted[j]
            if math.isfinite(lp) and abs(lp - ref) > self.tol.logprob_abs and node in self.ill_conditioned \
                    and self.triage.covers(abs(lp - ref), self.ill_conditioned[node]):
                self.rep.add(Finding(Verdict.TRIAGED, "logprobs", self.rid, s.step, node=node,
                                     message=f"log-prob of emitted token {j} ({tok}) {lp:.5g} vs reference {ref:.5g} at an "
                                             f"ill-conditioned node (spread {self.ill_conditioned[node]:.4g})",
                                     details={"index": j, "engine": lp, "reference": ref, "rule": "ill_conditioned"}))
                continue
            if not math.isfinite(lp) or abs(lp - ref) > self.tol.logprob_abs:
                what = "missing (NaN)" if math.isnan(lp) else f"{lp:.5g} vs reference {ref:.5g}"
                self.fail("logprobs", s.step, f"log-prob of emitted token {j} ({tok}) {what}", node=s.accepted[j],
                          details={"index": j, "engine": lp, "reference": ref})
                return

    # -- the walk ---------------------------------------------------------------------------------
    def run(self, prompt: list[int], output: list[int], output_lps: list[float], steps: list[StepRow]) -> None:
        P = len(prompt)
        if not output and not steps:
            self.rep.add(Finding(Verdict.SKIPPED, "output", self.rid, None, message="request has no output and no steps"))
            return
        logp0 = self.prefill(prompt)
        self.rep.check("output")
        if output and int(logp0.argmax()) != output[0]:
            self.token_flip("output", -1, None, logp0.cpu(), output[0], position=P)
        if output and output_lps:
            self.rep.check("logprobs")
            ref = float(logp0[output[0]])
            if not math.isfinite(output_lps[0]) or abs(output_lps[0] - ref) > self.tol.logprob_abs:
                self.fail("logprobs", -1, f"log-prob of the first token {output_lps[0]:.5g} vs reference {ref:.5g}")
        self.root = output[0] if output else None
        emitted_all = output[:1]
        for k, s in enumerate(steps):
            since = len(self.rep.findings)
            usable = self.replay_step(s, last=k == len(steps) - 1, prompt=prompt, output=output)
            self.step_verdict(since)
            if not usable:
                return  # the engine's step cannot be followed: later steps would only repeat this finding
            emitted_all += s.emitted
        self.rep.check("output")
        if emitted_all != output:
            i = next((j for j, (a, b) in enumerate(zip(emitted_all, output)) if a != b), min(len(emitted_all), len(output)))
            self.fail("output", None, f"request output differs from the steps' emitted tokens at index {i}",
                      position=P + i, details={"index": i})

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
        self.rep.check("tree")
        try:
            n = len(s.tree_tokens)
            tree = Tree(torch.tensor(s.tree_tokens), torch.tensor(s.tree_parents), torch.tensor(s.tree_depths),
                        torch.tensor(s.tree_ranks), torch.zeros(n))
            tree.validate(structural_only=self.structural_trees)
        except (TreeError, RuntimeError, ValueError) as exc:
            self.fail("tree", s.step, f"malformed tree: {exc}")
            return False
        self.check_draft(s)
        want_layers = s.layer_sketch is not None
        fwd = self.target.forward(self.state, tree.tokens, tree.parents, tree.depths, capture=self.capture,
                                  keep_layer_outputs=want_layers)
        logp = torch.log_softmax(fwd.logits, dim=-1)
        walk = self.check_nodes(s, tree, logp, fwd.layer_outputs, prompt + output[: s.committed_len - P])
        ref_acc = tree.walk_greedy(walk)
        self.rep.check("accepted_path")
        valid_path = bool(s.accepted) and s.accepted[0] == 0 and all(0 <= a < n for a in s.accepted) \
            and s.accepted == tree.path(s.accepted[-1])
        if s.accepted != ref_acc:
            self.fail("accepted_path", s.step, f"engine accepted {s.accepted}, the greedy walk gives {ref_acc}",
                      details={"engine": s.accepted, "reference": ref_acc})
        self.rep.check("accept_length")
        if s.accept_length != len(s.accepted):
            self.fail("accept_length", s.step, f"engine reports τ={s.accept_length} for {len(s.accepted)} accepted nodes "
                      f"(τ counts root+accepted = drafted tokens accepted + 1, bonus included)")
        if not valid_path:
            self.fail("accepted_path", s.step, f"engine's accepted nodes {s.accepted} are not a root path of its tree")
            return False
        self.rep.check("bonus")
        if s.bonus != int(walk[s.accepted[-1]]):
            self.token_flip("bonus", s.step, s.accepted[-1], logp[s.accepted[-1]].cpu(), s.bonus)
        self.check_emitted(s, tree, logp, last=last)
        prev = self.state.length
        new_state = self.state.commit(fwd, s.accepted)
        self.check_state(s, new_state, prev)
        acc = torch.tensor(s.accepted, device=self.target.device)
        self.drafter.extend(fwd.context[acc], prev + tree.depths.to(acc.device)[acc], tree.tokens.to(acc.device)[acc])
        self.state = new_state
        self.root = s.bonus
        return True


def capture_findings(rep: Report, trace: Trace) -> None:
    """An engine run that crashed or whose capture failed is a failure of its own ("engine")."""
    cap = trace.provenance.get("capture") or {}
    if not cap:
        return
    rep.check("engine")
    if cap.get("crash") or cap.get("incomplete"):
        rep.add(Finding(Verdict.FAIL, "engine", None, None,
                        message=f"engine run incomplete ({cap.get('crash') or 'no result'}); requests without a result: "
                                f"{cap.get('incomplete') or []}; partial trace: {cap.get('partial_trace', '-')}"))
    for msg in cap.get("errors") or []:
        rep.add(Finding(Verdict.FAIL, "engine", None, None, message=f"capture: {msg}"))
    stats = cap.get("stats") or {}
    if stats.get("chain_layout_branching_steps"):
        rid, step = stats.get("chain_layout_first", [None, None])
        rep.check("tree")
        rep.add(Finding(Verdict.FAIL, "tree", rid, step,
                        message=f"the engine verified {stats['chain_layout_branching_steps']} branching trees with its "
                                "recurrent layers in the chain layout (speculative_eagle_topk <= 1): sibling nodes run "
                                "through each other's state (first at this step)"))


def replay(trace: Trace, target: Target, drafter: Drafter, tol: Tolerance, case: str = "",
           stop_token_ids: frozenset[int] = frozenset(), check_draft: bool = True,
           triage: Triage = Triage(), engine_dtype: str = "float32") -> Report:
    rep = Report(case=case, mode="replay")
    capture_findings(rep, trace)
    structural = trace.provenance.get("engine", {}).get("settings", {}).get("tree_rules") == "structural"
    ensemble = RoundingEnsemble(target, engine_dtype, triage) if triage.ill_conditioned else None
    for req in trace.requests:
        _Request(rep, target, drafter, tol, req.request_id, stop_token_ids, check_draft, structural, triage, ensemble).run(
            list(req.prompt_ids), list(req.output_ids), list(req.output_logprobs), trace.steps_of(req.request_id)
        )
    return rep
