"""The calibrated verdict (refcheck/diff/tolerance.py, triage.py, replay.py): the rounding ensemble
perturbs what it says it does, its spread arithmetic, and the verdict on real traces: the budget-64
SGLang findings are judged consistent with bf16 rounding by default, with their evidence, while the
same deviation at a well-conditioned node fails; a consistent node is never triaged at a step or in a
request that fails elsewhere; per-golden rules are refused; a dtype with no calibration is an error
naming the command that measures one."""

from __future__ import annotations

import copy

import pytest
import torch

from refcheck.diff.findings import Verdict
from refcheck.diff.judge import judge
from refcheck.diff.tolerance import CALIBRATIONS, NoCalibration, calibration_for
from refcheck.diff.triage import UNIT_ROUNDOFF, RoundingEnsemble, Rule, StepInputs, StepSpread, rounding_noise
from refcheck.errors import GoldenError
from refcheck.goldens import REPO_GOLDEN
from refcheck.goldens.judge import check_trace
from refcheck.pool import ReferencePool, reference_spec_for
from refcheck.trace.io import Trace, read_trace

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixtures (the budget-64 golden's replay and its reference pool) are computed once.
pytestmark = pytest.mark.xdist_group("triage")

B64 = REPO_GOLDEN / "sglang-hybrid-ddtree-b64.arrow"
#: code-1 holds the budget-64 findings these tests move around; arith-2 holds a triaged node of its own
#: (step 2 node 48), the "other request" whose verdicts must not change. Replay is per request, so the
#: other four requests of the golden change nothing here (and cost 8x the replay time).
KEEP = ("arith-2", "code-1")


@pytest.fixture(scope="module")
def b64():
    full = read_trace(B64)
    return Trace(full.provenance, [r for r in full.requests if r.request_id in KEEP],
                 [x for x in full.steps if x.request_id in KEEP])


@pytest.fixture(scope="module")
def pool():
    return ReferencePool()


@pytest.fixture(scope="module")
def target(b64, pool):
    return pool.runner(reference_spec_for(b64)).target


def test_noise_rounds_every_linear_input_and_output_and_the_residual_stream(target):
    """One rounding of size u on a GEMM's input and one on its output (an identity GEMM shows both: at
    most (1+u)^2 - 1, more than u alone), and the target's residual stream hook set only while active."""
    u = 2.0 ** -8
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(64))
    x = torch.rand(50, 64) + 0.5
    gen = torch.Generator().manual_seed(3)
    with rounding_noise([lin], u, gen, residual=[target]):
        noisy = lin(x).detach()
        assert target.residual_rounding is not None
        h = torch.ones(3, 8)
        r = (target.residual_rounding(h) - h).abs()
        assert float(r.max()) <= u * 1.0001 and float(r.max()) > 0
    rel = ((noisy - x) / x).abs()
    assert float(rel.max()) <= (1 + u) ** 2 - 1 + 1e-6 and float(rel.max()) > u  # input and output rounded
    assert target.residual_rounding is None and torch.equal(lin(x), x)  # everything removed on exit


def test_spread_columns_are_topk_then_the_two_argmaxes():
    ref = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])  # 1 node: k=2 top-k columns, ref argmax col, engine argmax col
    samples = torch.stack([ref + torch.tensor([[0.1, -0.3, 0.0, 0.5]]), ref + torch.tensor([[-0.2, 0.0, 0.4, 0.0]])])
    sp = StepSpread.of(samples, ref, k=2)
    assert sp.topk.tolist() == pytest.approx([0.3])
    # margin ref 2.5; samples 2.0 and 2.9 -> largest change 0.5
    assert sp.margin.tolist() == pytest.approx([0.5]) and sp.median_topk == pytest.approx(0.3)


def test_the_rule_never_covers_nan_or_inf():
    r = Rule(factor=2.0)
    assert r.covers(1.0, 0.5) and not r.covers(1.01, 0.5)
    assert not r.covers(float("nan"), 1.0) and not r.covers(float("inf"), float("inf"))


def test_the_ensemble_is_seeded_and_scales_with_the_dtype(b64, target):
    req, s = b64.requests[0], [x for x in b64.steps if x.request_id == b64.requests[0].request_id][0]
    committed = list(req.prompt_ids) + list(req.output_ids)[: s.committed_len - len(req.prompt_ids)]
    toks, par, dep = (torch.tensor(v) for v in (s.tree_tokens, s.tree_parents, s.tree_depths))
    x = StepInputs(committed, toks, par, dep, list(s.accepted), torch.tensor(s.topk_ids), None, None)

    def sample(dtype):
        return RoundingEnsemble(target, None, dtype, Rule(samples=2), ()).sample(x).node

    one, two, fp32 = sample("bfloat16"), sample("bfloat16"), sample("float32")
    assert torch.equal(one, two) and one.shape == (2, len(s.tree_tokens), len(s.topk_ids[0]))
    assert float((one[0] - one[1]).abs().max()) > 1e-3  # bf16-sized noise moves log-probs
    assert float((fp32[0] - fp32[1]).abs().max()) < 1e-4  # fp32-sized noise does not
    assert UNIT_ROUNDOFF["bfloat16"] == 2.0 ** -8
    with pytest.raises(ValueError, match="unit roundoff"):
        RoundingEnsemble(target, None, "int8", Rule(), ())


def test_every_calibration_is_explicit_and_an_uncovered_dtype_names_the_command():
    assert calibration_for("float32", "cpu").rule is None  # the reference's own precision: bounds are final
    assert calibration_for("bfloat16", "cuda:1") is CALIBRATIONS[("bfloat16", "*")]
    assert calibration_for("bfloat16", "cuda").rule is not None
    with pytest.raises(NoCalibration, match="refcheck calibrate --dtype int8 --device cpu"):
        calibration_for("int8", "cpu")


def _diff(pool, trace):
    return judge(trace, pool, "t", mode="replay")


def _where(findings):
    return {(f.request_id, f.step, f.node) for f in findings}


@pytest.fixture(scope="module")
def clean(b64, pool):
    return _diff(pool, b64)


def test_the_budget_64_findings_are_judged_rounding_by_default_with_their_evidence(clean):
    rep = clean
    assert not rep.failures
    tri = [f for f in rep.findings if f.verdict == Verdict.TRIAGED]
    assert {("code-1", 13, 32), ("code-1", 4, 16)} <= _where(tri)
    n32 = [f for f in tri if (f.request_id, f.step, f.node) == ("code-1", 13, 32) and "max_abs" in f.details][0]
    d = n32.details
    assert d["rule"] == "rounding" and d["max_abs"] <= d["factor"] * d["spread"] and d["max_abs"] > 1.5
    assert d["spread"] > 20 * d["median_spread"]  # a node noise moves far more than its peers
    assert rep.stats["steps"]["fail"] == 0 and rep.stats["steps"]["triaged"] >= 2
    assert rep.stats["ensemble_steps"] < sum(rep.stats["steps"].values())  # only steps over a bound pay for it
    # every judged deviation within the calibrated factor of its spread (2.38 at most under this noise)
    assert rep.stats["rounding_ratios"] and max(rep.stats["rounding_ratios"]) <= calibration_for("bfloat16", "cpu").rule.factor


def _step(trace, rid, step):
    return [x for x in trace.steps if x.request_id == rid and x.step == step][0]


def test_the_same_deviation_at_a_well_conditioned_node_still_fails(b64, pool):
    """Move node 32's deviation (6.4 nats) to node 1 of the same step, which noise barely moves."""
    bad = copy.deepcopy(b64)
    s = _step(bad, "code-1", 13)
    s.topk_logprobs[1] = [v - 6.0 for v in s.topk_logprobs[1]]
    rep = _diff(pool, bad)
    assert ("code-1", 13, 1) in _where(rep.failures)


def test_a_rounding_consistent_node_is_not_triaged_at_a_step_that_fails_elsewhere(b64, pool):
    """Node 32 is judged consistent with rounding before the step's committed state is checked; the
    state then fails outright, so node 32 is reported failed too, with the reason."""
    bad = copy.deepcopy(b64)
    s = _step(bad, "code-1", 13)
    rec = next(e for e in s.state if e.kind == "rec")
    rec.sketch = rec.sketch * 3.0
    rep = _diff(pool, bad)
    n32 = [f for f in rep.findings if (f.request_id, f.step, f.node) == ("code-1", 13, 32)]
    assert n32 and all(f.verdict == Verdict.FAIL and f.details["not_triaged"] == "this step" for f in n32)
    assert "not triaged" in n32[0].message
    assert ("code-1", 13, rec.layer, "recurrent") in {(f.request_id, f.step, f.layer, f.category) for f in rep.failures}


def test_nothing_is_triaged_in_a_request_after_it_failed(b64, pool, clean):
    """After code-1 fails at step 2, its later over-bound deviations are failures (no ensemble is run for
    them); the first finding stays where the request first fails; other requests keep their verdicts."""
    bad = copy.deepcopy(b64)
    s = _step(bad, "code-1", 2)
    s.topk_logprobs[1] = [v - 6.0 for v in s.topk_logprobs[1]]  # code-1 fails at step 2
    rep = _diff(pool, bad)
    assert not [f for f in rep.findings if f.request_id == "code-1" and f.step > 2 and f.verdict == Verdict.TRIAGED]
    assert ("code-1", 13, 32) in _where(rep.failures)  # judged rounding when the request was clean, failed now
    others = [f for f in rep.findings if f.request_id != "code-1" and f.verdict == Verdict.TRIAGED]
    assert others == [f for f in others if f.request_id != "code-1"] and others
    assert len(others) == len([f for f in clean.findings if f.request_id != "code-1" and f.verdict == Verdict.TRIAGED])
    first = rep.first_divergence()["code-1"]
    assert (first.step, first.node) == (2, 1)
    assert rep.stats["ensemble_steps"] < clean.stats["ensemble_steps"]  # nothing judged after the failure


def test_a_request_that_fails_later_keeps_no_triaged_node(b64, pool, clean):
    """code-1's nodes judged rounding at steps 4 and 13 are no longer triaged once code-1 fails outright at
    step 15: rounding is presumed only in a request that is otherwise right. They are failures with the
    reason, ranked after the outright failure (the first divergence stays at step 15); the step counts
    move them from triaged to fail; the other request's triaged node is untouched."""
    bad = copy.deepcopy(b64)
    s = _step(bad, "code-1", 15)
    s.topk_logprobs[1] = [v - 6.0 for v in s.topk_logprobs[1]]
    rep = _diff(pool, bad)
    mine = [f for f in rep.findings if f.request_id == "code-1"]
    assert not [f for f in mine if f.verdict == Verdict.TRIAGED]
    earlier = [f for f in mine if (f.step, f.node) in ((4, 16), (13, 32))]
    assert earlier and all(f.verdict == Verdict.FAIL and f.details["not_triaged"] == "step 15" for f in earlier)
    assert all("rounding cannot be presumed" in f.message and f.details["rule"] == "rounding" for f in earlier)
    first = rep.first_divergence()["code-1"]
    assert (first.step, first.node) == (15, 1) and "not_triaged" not in first.details
    was = {k: v for k, v in clean.stats["steps"].items()}
    moved = len({f.step for f in earlier})
    assert rep.stats["steps"]["triaged"] <= was["triaged"] - moved and rep.stats["steps"]["fail"] >= moved + 1
    assert sum(rep.stats["steps"].values()) == sum(was.values())
    assert ("arith-2", 2, 48) in _where(f for f in rep.findings if f.verdict == Verdict.TRIAGED)


def _anchored(steps: int):
    from dataclasses import replace

    cal = calibration_for("bfloat16", "cuda")
    return replace(cal, rule=replace(cal.rule, anchor_steps=steps))


def test_an_anchor_step_judges_what_the_cheap_bound_lets_through(b64, pool):
    """At the request's anchor step every node and state entry is held to rounding: a 0.5-nat shift of a
    well-conditioned node and a 5% scaling of a recurrent state pass the cheap bounds (1.5 nats, rel L2
    0.25) and fail at the anchor step, at that node and layer; without anchors both pass."""
    bad = copy.deepcopy(b64)
    s = _step(bad, "code-1", 0)
    s.topk_logprobs[1] = [v - 0.5 for v in s.topk_logprobs[1]]
    rec = next(e for e in s.state if e.kind == "rec")
    rec.sketch = rec.sketch * 1.05
    plain = judge(bad, pool, "t", mode="replay", calibration=_anchored(0))
    assert not [f for f in plain.failures if f.request_id == "code-1" and f.step == 0]
    rep = judge(bad, pool, "t", mode="replay", calibration=_anchored(1))
    got = [f for f in rep.failures if f.request_id == "code-1" and f.step == 0]
    assert ("logits", 1) in {(f.category, f.node) for f in got} and all(f.details.get("anchor") for f in got)
    node = next(f for f in got if f.category == "logits")
    assert node.details["max_abs"] == pytest.approx(0.5, abs=0.05) and node.details["max_abs"] > 3 * node.details["spread"]
    # the state check runs after the nodes, and a step whose nodes failed judges nothing more: alone, the
    # state entry fails by itself
    only = copy.deepcopy(b64)
    r2 = next(e for e in _step(only, "code-1", 0).state if e.kind == "rec")
    r2.sketch = r2.sketch * 1.05
    rep = judge(only, pool, "t", mode="replay", calibration=_anchored(1))
    first = rep.first_divergence()["code-1"]
    assert (first.step, first.category, first.layer) == (0, "recurrent", rec.layer) and first.details["anchor"]
    clean = judge(b64, pool, "t", mode="replay", calibration=_anchored(1))
    assert not clean.failures  # the clean golden passes with its anchors judged


def test_per_golden_triage_rules_are_refused(b64, pool):
    with pytest.raises(GoldenError, match="remove 'triage_rules'"):
        check_trace("x", b64, {"expect": "pass", "allow_unsupported": ["draft"], "triage_rules": ["ill-conditioned"]},
                    pool)


def test_manual_triage_moves_only_the_steps_it_changed():
    """A golden's reviewed findings move their steps from fail to triaged; steps the verdict already
    triaged are not moved again (the step counts of a golden with both never go negative)."""
    from refcheck.diff.findings import Finding, Report
    from refcheck.goldens.policy import apply_triage

    rep = Report(case="c", mode="replay")
    rep.add(Finding(Verdict.TRIAGED, "logits", "r", 1, node=3, message="by the rule"))
    rep.add(Finding(Verdict.FAIL, "logits", "r", 2, node=5, message="reviewed"))
    rep.add(Finding(Verdict.FAIL, "logits", "r", 4, node=1, message="not reviewed"))
    rep.stats["steps"] = {"pass": 10, "benign_tie": 0, "triaged": 1, "fail": 2}
    apply_triage(rep, [{"request_id": "r", "step": 2, "node": 5, "category": "logits"}])
    assert rep.stats["steps"] == {"pass": 10, "benign_tie": 0, "triaged": 2, "fail": 1}
    assert [f.step for f in rep.failures] == [4]


def test_an_escalated_ensemble_adds_runs_of_the_next_stream_and_only_widens(b64, target):
    """``escalate``: where the first runs' spread does not cover a deviation, more runs of the next noise stream
    join them; the spread over all of them is never smaller than the first runs' alone."""
    req, s = b64.requests[0], [x for x in b64.steps if x.request_id == b64.requests[0].request_id][0]
    committed = list(req.prompt_ids) + list(req.output_ids)[: s.committed_len - len(req.prompt_ids)]
    toks, par, dep = (torch.tensor(v) for v in (s.tree_tokens, s.tree_parents, s.tree_depths))
    x = StepInputs(committed, toks, par, dep, list(s.accepted), torch.tensor(s.topk_ids), None, None)
    ens = RoundingEnsemble(target, None, "bfloat16", Rule(samples=2, escalate=3), ())
    first, more = ens.sample(x), ens.sample(x, samples=3, seed=1)
    assert more.node.shape[0] == 3 and not torch.equal(first.node[:2], more.node[:2])  # another stream
    both = first + more
    assert both.node.shape[0] == 5 and torch.equal(both.node[:2], first.node)
    assert torch.equal(ens.sample(x, samples=2, seed=0).node, first.node)  # the rule's own stream, reproduced


def test_judged_escalates_only_what_the_first_runs_do_not_cover():
    from refcheck.diff.findings import Report
    from refcheck.diff.rounding_guard import RoundingGuard

    g = RoundingGuard(Report("c", "replay"), "r", Rule(samples=8, factor=3.0, escalate=32), None)
    calls = {"all": 0}

    def spread_all() -> StepSpread:
        calls["all"] += 1
        return StepSpread(torch.tensor([2.0]), torch.tensor([2.0]), 2.0)

    g.spread, g.spread_all = (lambda: StepSpread(torch.tensor([1.0]), torch.tensor([1.0]), 1.0)), spread_all
    at = lambda sp: float(sp.topk[0])  # noqa: E731
    assert g.judged(2.5, at) == 1.0 and not g.escalated and calls["all"] == 0  # covered by the first runs
    assert g.judged(5.0, at) == 2.0 and g.escalated and calls["all"] == 1  # 5 > 3 x 1, but <= 3 x 2
    assert g.judged(7.0, at) is None and g.last_spread == 2.0  # beyond both: fails
    assert g.judged(13.0, at) is None and g.last_spread == 1.0  # beyond 4 x 3 x the first spread: not escalated
    assert g.rep.stats["escalated_judgements"] == 2
    g.spread_all = None  # a rule without escalation judges on the first runs only
    assert g.judged(5.0, at) is None


def test_a_rounding_consistent_deviation_is_triaged_only_in_a_request_that_does_not_fail():
    """The guard holds a step's rounding-consistent deviations until the step settles: triaged where nothing fails
    at that step or earlier; a failure later in the request withdraws them (failures, "not triaged")."""
    from refcheck.diff.findings import Finding, Report
    from refcheck.diff.rounding_guard import RoundingGuard

    rep = Report("c", "replay")
    g = RoundingGuard(rep, "r", Rule(samples=8, factor=3.0), None)
    start = g.open_step()
    g.consistent("logits", 0, "within rounding", {})
    assert not rep.findings  # held until the step settles
    g.settle(0)
    assert [f.verdict for f in rep.findings] == [Verdict.TRIAGED] and rep.findings[0].details["rule"] == "rounding"
    rep.stats["steps"] = {"pass": 0, "benign_tie": 0, "triaged": 1, "fail": 0}
    g.open_step()
    rep.add(Finding(Verdict.FAIL, "kv", "r", 1, message="off"))
    g.consistent("logits", 1, "within rounding", {})
    g.settle(1)
    assert g.failed_at == 1 and rep.findings[-1].verdict == Verdict.FAIL and "not triaged" in rep.findings[-1].message
    g.withdraw(start)
    assert all(f.verdict == Verdict.FAIL for f in rep.findings) and rep.findings[0].details["not_triaged"] == "step 1"
    assert rep.stats["steps"] == {"pass": 0, "benign_tie": 0, "triaged": 0, "fail": 1}


def test_the_bf16_and_fp16_rules_escalate():
    assert CALIBRATIONS[("bfloat16", "*")].rule.escalate == 32 and CALIBRATIONS[("float16", "*")].rule.escalate == 32


def _chain_step(committed: list[int], n: int = 3) -> StepInputs:
    toks = torch.tensor([(7 * i + 3) % 500 for i in range(n)])
    par, dep = torch.arange(-1, n - 1), torch.arange(n)
    return StepInputs(committed, toks, par, dep, [0, 1], torch.tensor([[1, 2, 3]] * n), None, None)


def test_a_kept_noisy_prefix_is_exactly_what_a_fresh_prefill_computes(target, monkeypatch):
    """The ensemble keeps each run's noisy state after whole prefill chunks and extends it at the next
    step: the runs of a later step equal those of a fresh ensemble (and of one that keeps nothing),
    bit for bit, and only the new chunks are run."""
    g = torch.Generator().manual_seed(5)
    committed = torch.randint(0, 500, (200,), generator=g).tolist()
    early, late = _chain_step(committed[:70]), _chain_step(committed[:197])
    warm = RoundingEnsemble(target, None, "bfloat16", Rule(samples=3), ())
    warm.sample(early)  # keeps chunk 0 of each run
    chunks: list[int] = []
    real = RoundingEnsemble._chunk

    def counted(self, state, piece, capture):
        chunks.append(int(piece.shape[0]))
        return real(self, state, piece, capture)

    monkeypatch.setattr(RoundingEnsemble, "_chunk", counted)
    got = warm.sample(late)
    assert chunks == [64, 64] * 3  # chunks 1 and 2 per run (chunk 0 was kept; the partial one goes with the tree)
    fresh = RoundingEnsemble(target, None, "bfloat16", Rule(samples=3), ()).sample(late)
    nothing = RoundingEnsemble(target, None, "bfloat16", Rule(samples=3), ())
    nothing.max_bytes = 0
    assert torch.equal(got.node, fresh.node) and torch.equal(got.node, nothing.sample(late).node)
    assert not torch.equal(got.node[0], got.node[1])  # runs differ from each other
    other = RoundingEnsemble(target, None, "bfloat16", Rule(samples=3), ()).sample(late, seed=1)
    assert not torch.equal(other.node, got.node)  # and streams from each other


def test_a_kept_prefix_is_never_reused_for_other_tokens(target):
    """A prefix is reused only where the new committed tokens start with it: the same length with one
    token changed inside the kept chunk is computed afresh, and gives what a fresh ensemble gives."""
    g = torch.Generator().manual_seed(6)
    committed = torch.randint(0, 500, (140,), generator=g).tolist()
    changed = list(committed)
    changed[10] = (changed[10] + 1) % 500
    ens = RoundingEnsemble(target, None, "bfloat16", Rule(samples=2), ())
    ens.sample(_chain_step(committed))
    got = ens.sample(_chain_step(changed)).node
    assert torch.equal(got, RoundingEnsemble(target, None, "bfloat16", Rule(samples=2), ()).sample(_chain_step(changed)).node)
