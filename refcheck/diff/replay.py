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

A **sampled** request (temperature > 0, schema 1.2) keeps every check above except the greedy walk
and bonus: its path, bonus and first token are judged by exact replay of the engine's draws or
uniforms (:mod:`refcheck.diff.sampling`), and every emitted token and walk step feeds the
distributional test (:mod:`refcheck.diff.distribution`), judged once over the whole trace
(category "distribution"; INCONCLUSIVE, exit 5, when a request hid its randomness and the sample
cannot reach the stated power). Every draw with a known uniform feeds the temperature check
(:mod:`refcheck.diff.temperature`, category "temperature", judged once over the whole trace): when the
draws that differ from the reference's lean to one side of the temperature, the trace fails and no
deviation in it stays triaged as rounding.

**The calibrated verdict** (:mod:`refcheck.diff.tolerance`): a quantity within its cheap bound
passes. For an engine dtype coarser than the reference, a draft, node, emitted log-prob or state
entry over its bound is judged by the rounding ensemble (:mod:`refcheck.diff.triage`, run once per
such step): within the calibrated factor of how far a correct engine's rounding moves it, it is
*consistent with rounding*. Consistent deviations are reported TRIAGED, with their evidence, only
at a step where nothing fails outright and in a request that fails at no step, earlier or later;
otherwise they are failures ("not triaged: ..."), ranked after the outright ones. A fault that moves one ill-conditioned node also moves the
state it commits or the nodes around it, so it cannot hide behind rounding at one node. At the rule's
anchor steps (the first of each request) every node and state entry is held to its spread, under the
bound too. The request's rounding judgement lives in :mod:`refcheck.diff.rounding_guard`, its node checks
(argmax, top-k log-probs, layer bisection) in :mod:`refcheck.diff.node_checks`.

The reference then commits the *engine's* accepted path, so one bug does not cascade into every
later step; if the engine's step is unusable, the reference re-prefills the engine's committed
tokens.
"""

from __future__ import annotations

from ddtree_reference.drafter import Drafter
from ddtree_reference.target import Target
from refcheck.diff.acceptance import Account, DraftRule
from refcheck.diff.distribution import Evidence
from refcheck.diff.findings import Report
from refcheck.diff.request_replay import RequestReplay
from refcheck.diff.sampling import (
    SampledRequest,
)
from refcheck.diff.temperature import Leans, emitted_after
from refcheck.diff.tolerance import Calibration
from refcheck.diff.trace_verdicts import capture_findings, judge_distribution, judge_temperature
from refcheck.diff.triage import RoundingEnsemble
from refcheck.trace.io import Trace, gaps_declared


def replay(trace: Trace, target: Target, drafter: Drafter, cal: Calibration, case: str = "",
           stop_token_ids: frozenset[int] = frozenset(), check_draft: bool = True, engine_dtype: str = "float32",
           evidence: Evidence | None = None, leans: Leans | None = None) -> Report:
    """Replay every request of ``trace``, judged by ``cal`` (the calibration of the engine's numerics).
    ``evidence`` / ``leans``: where the sampled requests' distributional evidence and the keyed draws' leans
    (the temperature check) are collected (fresh ones by default)."""
    rep = Report(case=case, mode="replay")
    capture_findings(rep, trace)
    structural = trace.prov.tree_rules == "structural"
    ensemble = None
    if cal.rule is not None:
        ensemble = RoundingEnsemble(target, drafter, engine_dtype, cal.rule, tuple(drafter.target_layer_ids))
    evidence = evidence if evidence is not None else Evidence()
    rule = DraftRule(trace.prov.draft_rule, trace.prov.budget, target.vocab_size, check_draft)
    account = Account(rule.name)
    missing = trace.prov.capture.stats.get("draft_not_captured") if trace.prov.capture is not None else None
    leans = leans if leans is not None else Leans()
    hidden, any_sampled = [], False
    for req in trace.requests:
        sampled = SampledRequest.from_row(req)
        any_sampled |= sampled is not None
        r = RequestReplay(rep, target, drafter, cal, req.request_id, stop_token_ids, check_draft, structural, ensemble,
                     sampled, evidence, rule, leans)
        if missing:
            r.draft_missing = f": {missing}"
        r.max_new_tokens = req.token_limit(trace.prov.max_new_tokens)
        r.some_steps = gaps_declared(trace.provenance)
        r.run(list(req.prompt_ids), list(req.output_ids), list(req.output_logprobs), trace.steps_of(req.request_id),
              req.first_uniform)
        account.steps += r.account.steps
        account.unrecorded += r.account.unrecorded
        if r.hidden:
            hidden.append(req.request_id)
    if any_sampled:
        judge_distribution(rep, evidence, hidden)
        judge_temperature(rep, leans, emitted_after(trace))
    if rule.name != "other":
        rep.stats["acceptance_account"] = account.to_json()
    return rep
