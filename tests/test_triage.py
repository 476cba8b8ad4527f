"""The triage rules (refcheck/diff/triage.py): the rounding ensemble perturbs what it says it does, its
spread arithmetic, and the ill-conditioned-node rule on a real SGLang trace: the budget-64 findings are
triaged with their evidence, while the same deviation moved to a well-conditioned node still fails."""

from __future__ import annotations

import copy

import pytest
import torch

from refcheck.diff.findings import Verdict
from refcheck.diff.session import DiffSession, reference_spec_for
from refcheck.diff.triage import UNIT_ROUNDOFF, RoundingEnsemble, StepSpread, Triage, rounding_noise
from refcheck.golden import REPO_GOLDEN, TRIAGE_RULES, triage_of
from refcheck.errors import GoldenError
from refcheck.trace.io import read_trace

B64 = REPO_GOLDEN / "sglang-hybrid-ddtree-b64.arrow"


@pytest.fixture(scope="module")
def b64():
    return read_trace(B64)


@pytest.fixture(scope="module")
def target(b64):
    return DiffSession().runner(reference_spec_for(b64)).target


def test_noise_multiplies_every_linear_output_by_one_unit_roundoff_at_most(target):
    x = torch.randn(5, target.model.config.hidden_size)
    lin = next(m for m in target.model.modules() if isinstance(m, torch.nn.Linear))
    clean = lin(x)
    gen = torch.Generator().manual_seed(3)
    with rounding_noise(target, 2.0 ** -8, gen):
        noisy = lin(x)
    rel = ((noisy - clean) / clean).abs().detach()
    assert float(rel.max()) <= 2.0 ** -8 * 1.0001 and float(rel.max()) > 2.0 ** -9  # uses its budget, no more
    assert torch.equal(lin(x), clean)  # hooks removed on exit


def test_spread_columns_are_topk_then_the_two_argmaxes():
    ref = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])  # 1 node: k=2 top-k columns, ref argmax col, engine argmax col
    samples = torch.stack([ref + torch.tensor([[0.1, -0.3, 0.0, 0.5]]), ref + torch.tensor([[-0.2, 0.0, 0.4, 0.0]])])
    sp = StepSpread.of(samples, ref, k=2)
    assert sp.topk.tolist() == pytest.approx([0.3])
    # margin ref 2.5; samples 2.0 and 2.9 -> largest change 0.5
    assert sp.margin.tolist() == pytest.approx([0.5]) and sp.median_topk == pytest.approx(0.3)


def test_the_ensemble_is_seeded_and_scales_with_the_dtype(b64, target):
    req, s = b64.requests[0], [x for x in b64.steps if x.request_id == b64.requests[0].request_id][0]
    committed = list(req.prompt_ids) + list(req.output_ids)[: s.committed_len - len(req.prompt_ids)]
    toks, par, dep = (torch.tensor(v) for v in (s.tree_tokens, s.tree_parents, s.tree_depths))
    cols = torch.tensor(s.topk_ids)
    one = RoundingEnsemble(target, "bfloat16", Triage(ill_conditioned=True, samples=2)).sample(committed, toks, par, dep, cols)
    two = RoundingEnsemble(target, "bfloat16", Triage(ill_conditioned=True, samples=2)).sample(committed, toks, par, dep, cols)
    fp32 = RoundingEnsemble(target, "float32", Triage(ill_conditioned=True, samples=2)).sample(committed, toks, par, dep, cols)
    assert torch.equal(one, two) and one.shape == (2, len(s.tree_tokens), cols.shape[1])
    assert float((one[0] - one[1]).abs().max()) > 1e-3  # bf16-sized noise moves log-probs
    assert float((fp32[0] - fp32[1]).abs().max()) < 1e-4  # fp32-sized noise does not
    assert UNIT_ROUNDOFF["bfloat16"] == 2.0 ** -8
    with pytest.raises(ValueError, match="unit roundoff"):
        RoundingEnsemble(target, "int8", Triage())


def _diff(trace, triage):
    return DiffSession().diff(trace, "t", mode="replay", triage=triage)


def test_the_budget_64_findings_are_ill_conditioned_nodes_with_their_evidence(b64):
    plain = _diff(b64, Triage())
    assert {(f.request_id, f.step, f.node) for f in plain.failures} >= {("code-1", 13, 32), ("code-1", 4, 16)}
    ruled = _diff(b64, Triage(ill_conditioned=True))
    assert not ruled.failures
    tri = [f for f in ruled.findings if f.verdict == Verdict.TRIAGED]
    failing = {(f.request_id, f.step, n) for f in plain.failures for n in f.details.get("nodes", [f.node])}
    assert {(f.request_id, f.step, f.node) for f in tri} == failing  # every failing node, no other
    n32 = [f for f in tri if (f.request_id, f.step, f.node) == ("code-1", 13, 32) and "max_abs" in f.details][0]
    d = n32.details
    assert d["rule"] == "ill_conditioned" and d["max_abs"] <= d["factor"] * d["spread"]
    assert d["spread"] > 20 * d["median_spread"]  # a node noise moves far more than its peers
    assert ruled.stats["steps"]["fail"] == 0 and ruled.stats["steps"]["triaged"] == plain.stats["steps"]["fail"]


def test_the_same_deviation_at_a_well_conditioned_node_still_fails(b64):
    """Move node 32's deviation (6.4 nats) to node 1 of the same step, which noise barely moves."""
    bad = copy.deepcopy(b64)
    s = [x for x in bad.steps if x.request_id == "code-1" and x.step == 13][0]
    s.topk_logprobs[1] = [v - 6.0 for v in s.topk_logprobs[1]]
    rep = _diff(bad, Triage(ill_conditioned=True, isolated=True))
    assert ("code-1", 13, 1) in {(f.request_id, f.step, f.node) for f in rep.failures}


def test_golden_triage_rules_are_named_and_checked():
    assert triage_of({"triage_rules": ["ill-conditioned"]}) == Triage(ill_conditioned=True)
    assert triage_of({}) == Triage() and set(TRIAGE_RULES) == {"isolated", "ill-conditioned"}
    assert Triage(isolated=True).union(Triage(ill_conditioned=True)) == Triage(isolated=True, ill_conditioned=True)
    with pytest.raises(GoldenError, match="unknown triage rule"):
        triage_of({"triage_rules": ["everything"]})


def test_manual_triage_moves_only_the_steps_it_changed():
    """A golden's reviewed findings move their steps from fail to triaged; steps a rule already triaged
    are not moved again (the step counts of a golden with both never go negative)."""
    from refcheck.diff.findings import Finding, Report
    from refcheck.golden import apply_triage

    rep = Report(case="c", mode="replay")
    rep.add(Finding(Verdict.TRIAGED, "logits", "r", 1, node=3, message="by the rule"))
    rep.add(Finding(Verdict.FAIL, "logits", "r", 2, node=5, message="reviewed"))
    rep.add(Finding(Verdict.FAIL, "logits", "r", 4, node=1, message="not reviewed"))
    rep.stats["steps"] = {"pass": 10, "benign_tie": 0, "triaged": 1, "fail": 2}
    apply_triage(rep, [{"request_id": "r", "step": 2, "node": 5, "category": "logits"}])
    assert rep.stats["steps"] == {"pass": 10, "benign_tie": 0, "triaged": 2, "fail": 1}
    assert [f.step for f in rep.failures] == [4]
