"""The rounding judgement of one replayed request: the ensemble of a step, run at most once, and what
its spreads decide.

Contract: :class:`RoundingGuard` is the part of a request's replay (:mod:`refcheck.diff.request_replay`) that
holds deviations against the rounding ensemble (:mod:`refcheck.diff.triage`). It holds the calibration's rule and
the ensemble, the step's spreads, the step's rounding-consistent deviations until the step settles, and the
request's first failing step; it reads the report's findings and writes its stats and findings, and holds nothing
else of the request. Per step: :meth:`RoundingGuard.open_step` marks the step's first finding;
:meth:`RoundingGuard.step_ensemble` sets up the step's ensemble (node log-probs at the engine's top-k ids and both
argmaxes, the draft, the committed state), run on first use; :meth:`RoundingGuard.judged` is a deviation over its
bound held to the rule's factor x its spread; :meth:`RoundingGuard.beyond_rounding` is one *under* its bound at an
anchor step; :meth:`RoundingGuard.consistent` records a deviation rounding explains, which
:meth:`RoundingGuard.settle` reports as triaged only if nothing fails at its step or earlier, and
:meth:`RoundingGuard.withdraw` turns into a failure once the request fails later (:func:`withdraw_trace`: once a
check over the whole trace fails). Every judged deviation's ratio to its spread is kept in the report's
``rounding_ratios`` (the calibration's raw data). :data:`FLOOR` is the fp32 reference's own precision: the
anchor judgement holds nothing under it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ddtree_reference.state import TargetState
from ddtree_reference.tree import Tree
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.diff.tolerance import CALIBRATIONS
from refcheck.diff.triage import RoundingEnsemble, Rule, StepInputs, StepSamples, StepSpread
from refcheck.profile import timed
from refcheck.sketch import as_recorded, rel_l2, state_rows
from refcheck.trace.io import StepRow

MAX_RATIOS = 4000  # judged deviations kept per report for `refcheck calibrate`
#: under the fp32 reference's own precision nothing is judged (its bounds against transformers, CPU)
FLOOR = CALIBRATIONS[("float32", "cpu")].tolerance


def _not_triaged(f: Finding, where: str, whole: str = "the request") -> None:
    """A rounding-consistent finding in a request (``whole``: or a trace) that fails (at ``where``): a
    failure, with the reason."""
    f.verdict = Verdict.FAIL
    f.message += f"; not triaged: {whole} fails at {where}, so rounding cannot be presumed"
    f.details["not_triaged"] = where


def withdraw_trace(rep: Report, where: str) -> int:
    """A check over the whole trace failed (``where`` names it): no deviation in the trace stays triaged as
    rounding, as :meth:`RoundingGuard.withdraw` does for a failing request. Returns how many were withdrawn."""
    found = [f for f in rep.findings if f.verdict == Verdict.TRIAGED and f.details.get("rule") == "rounding"]
    for f in found:
        _not_triaged(f, where, "the trace")
    moved = len({(f.request_id, f.step) for f in found if f.step is not None and f.step >= 0})
    if moved:  # steps whose worst finding is now a failure (a request with a failure has no triaged step)
        steps = rep.stats.setdefault("steps", {"pass": 0, "benign_tie": 0, "fail": 0})
        steps["triaged"] = steps.get("triaged", 0) - moved
        steps["fail"] = steps.get("fail", 0) + moved
    return len(found)


class RoundingGuard:
    """A request's rounding judgement: the rule and ensemble it judges with, this step's spreads, and the
    deviations rounding explains until their step settles."""

    def __init__(self, rep: Report, rid: str, rule: Rule | None, ensemble: RoundingEnsemble | None) -> None:
        self.rep, self.rid = rep, rid
        self.rule = rule  # the calibration's rule (None: the bounds are final, nothing is judged)
        self.ensemble = ensemble  # set when the calibration has a rule
        #: this step's deviations consistent with rounding, settled at the step's end
        self.pending: list[Finding] = []
        self.spread: Callable[[], StepSpread] | None = None  # this step's ensemble, run at most once
        self.spread_all: Callable[[], StepSpread] | None = None  # ... with the rule's escalation runs (on first need)
        self.failed_at: int | None = None  # the first step of this request with a failure
        self.last_spread: float | None = None  # the spread the last judged deviation was held against
        self.escalated = False  # ... and whether that spread is the escalated ensemble's
        self.since = 0  # index of this step's first finding in the report

    @property
    def factor(self) -> float:
        """The calibration's factor over the rounding spread (only worded where a rule judged)."""
        return self.rule.factor if self.rule is not None else float("nan")

    def open_step(self) -> int:
        """A step begins: its findings start at the report's next one (the index returned)."""
        self.since = len(self.rep.findings)
        return self.since

    def step_spread(self) -> StepSpread:
        """This step's ensemble spread (only once a judgement has run it)."""
        assert self.spread is not None, "no rounding ensemble at this step"
        return self.spread()

    def consistent(self, category: str, step: int, message: str, details: dict[str, Any], **kw: Any) -> None:
        """A deviation over its bound that rounding at the engine's dtype explains: triaged or failed at
        the step's end (:meth:`settle`). Only reached through a judgement, so the calibration has a rule."""
        assert self.rule is not None
        details.update(rule="rounding", samples=self.rule.samples + (self.rule.escalate if self.escalated else 0),
                       factor=self.rule.factor)
        self.pending.append(Finding(Verdict.TRIAGED, category, self.rid, step, message=message, details=details, **kw))

    def judged(self, deviation: float, spread: Callable[[StepSpread], float | None]) -> float | None:
        """The quantity's rounding spread when the calibration judges over-bound deviations and this one
        is within it; else None (the deviation fails)."""
        self.last_spread, self.escalated = None, False
        if self.rule is None or self.spread is None or self.failing():
            return None  # (after a failure the deviation could not be triaged anyway: no ensemble is run)
        value = spread(self.spread())
        self.last_spread = value
        if value is None:
            return None
        if self.spread_all is not None and self.rule.worth_escalating(deviation, value):
            # beyond the first runs' spread: judged again over the escalated ensemble (the tail of an
            # ill-conditioned node), never the other way round
            self.rep.stats["escalated_judgements"] = self.rep.stats.get("escalated_judgements", 0) + 1
            value = max(value, spread(self.spread_all()) or 0.0)
            self.last_spread, self.escalated = value, True
        ratios = self.rep.stats.setdefault("rounding_ratios", [])
        if len(ratios) < MAX_RATIOS:  # deviation / spread of every judged quantity: the calibration's raw data
            ratios.append(round(deviation / value, 4) if value > 0 else float("inf"))
        return value if self.rule.covers(deviation, value) else None

    def beyond_rounding(self, step: int, deviation: float, floor: float,
                        spread: Callable[[StepSpread], float | None]) -> float | None:
        """At an anchor step (the rule's first ``anchor_steps`` steps of the request), a deviation *within* its
        cheap bound that is still more than ``factor`` x its rounding spread (and above ``floor``, the fp32
        reference's own precision): its spread, else None. Nothing is judged once the request has failed."""
        if self.rule is None or self.spread is None or step >= self.rule.anchor_steps or deviation <= floor \
                or self.failing():
            return None
        value = self.judged(deviation, spread)
        return self.last_spread if value is None and self.last_spread is not None else None

    def failing(self) -> bool:
        """Has this request failed, earlier or at this step so far?"""
        return self.failed_at is not None or any(f.verdict == Verdict.FAIL for f in self.rep.findings[self.since:])

    def settle(self, step: int) -> None:
        """Report the step's rounding-consistent deviations (the step opened at :meth:`open_step`): triaged only if
        nothing else failed at this step or earlier in the request."""
        failed_here = any(f.verdict == Verdict.FAIL for f in self.rep.findings[self.since:])
        if self.pending and (failed_here or self.failed_at is not None):
            where = f"step {self.failed_at}" if self.failed_at is not None else "this step"
            for f in self.pending:
                _not_triaged(f, where)
        self.rep.findings.extend(self.pending)
        self.pending = []
        if self.failed_at is None and any(f.verdict == Verdict.FAIL for f in self.rep.findings[self.since:]):
            self.failed_at = step

    def withdraw(self, start: int) -> None:
        """Once the request has failed, no deviation *before* that step stays triaged either: rounding is
        presumed only for a request that is otherwise right. A fault that first moves ill-conditioned nodes
        within rounding and shows outright only a step later is then reported at those nodes too (as failures
        "not triaged", which :meth:`Report.first_divergence` ranks after the outright ones)."""
        if self.failed_at is None:
            return
        where = f"step {self.failed_at}"
        found = [f for f in self.rep.findings[start:] if f.verdict == Verdict.TRIAGED and f.details.get("rule") == "rounding"]
        for f in found:
            _not_triaged(f, where)
        moved = len({f.step for f in found})  # steps whose worst finding is now a failure
        if moved:
            steps = self.rep.stats.setdefault("steps", {"pass": 0, "benign_tie": 0, "fail": 0})
            steps["triaged"] = steps.get("triaged", 0) - moved
            steps["fail"] = steps.get("fail", 0) + moved

    def step_ensemble(self, s: StepRow, tree: Tree, logp: torch.Tensor, committed: list[int],
                      draft_ref: torch.Tensor | None, ref_state: dict[str, torch.Tensor]) -> None:
        """Set up this step's rounding ensemble (run on first use): node log-probs at the engine's
        top-k ids and both argmaxes, the draft at the engine's draft ids, the committed state (``ref_state``:
        the reference's committed entries in the form the engine recorded them, by name)."""
        self.spread = self.spread_all = None
        if self.ensemble is None:
            return
        n, V = tree.num_nodes, logp.shape[-1]
        ids = torch.tensor(s.topk_ids, dtype=torch.long) if s.topk_ids else torch.zeros(n, 0, dtype=torch.long)
        ref_arg = logp.argmax(dim=-1).cpu()
        eng_arg = torch.tensor(s.target_argmax, dtype=torch.long)
        eng_arg = eng_arg.clamp(0, V - 1) if eng_arg.shape == ref_arg.shape else ref_arg
        cols = torch.cat([ids, ref_arg[:, None], eng_arg[:, None]], dim=1)  # [N, k+2]
        draft_ids = torch.tensor(s.draft_topk_ids, dtype=torch.long) if draft_ref is not None else None
        entries = {e.name: e for e in s.state}

        def state_error(state: TargetState, length: int) -> dict[str, float]:
            got = state_rows(state, length)
            return {name: rel_l2(as_recorded(got[name][2], entries[name].sketch, entries[name].full), ref)
                    for name, ref in ref_state.items() if name in got}

        inputs = StepInputs(committed, tree.tokens, tree.parents, tree.depths, list(s.accepted), cols, draft_ids,
                            state_error if ref_state else None)
        node_ref = logp.cpu().gather(1, cols)  # [N, k+2]

        ensemble, rule = self.ensemble, self.ensemble.rule

        @functools.cache
        def first() -> StepSamples:
            self.rep.stats["ensemble_steps"] = self.rep.stats.get("ensemble_steps", 0) + 1
            return ensemble.sample(inputs)

        @timed("ensemble", counter="ensemble_steps")
        def run() -> StepSpread:
            return StepSpread.of_step(first(), node_ref, ids.shape[1], draft_ref)

        @timed("ensemble", counter="escalated_steps")
        def run_all() -> StepSpread:
            self.rep.stats["escalated_steps"] = self.rep.stats.get("escalated_steps", 0) + 1
            more = ensemble.sample(inputs, samples=rule.escalate, seed=rule.seed + 1)  # the next noise stream
            return StepSpread.of_step(first() + more, node_ref, ids.shape[1], draft_ref)

        self.spread = functools.cache(run)
        self.spread_all = functools.cache(run_all) if rule.escalate > 0 else None
