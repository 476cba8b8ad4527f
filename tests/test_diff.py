"""The diff engine: a clean engine passes, every injected bug class is caught where it first shows,
near-ties are triaged, and bad engine data is a finding, never a crash or a silent pass."""

from __future__ import annotations

import dataclasses
import math

import pytest

from refcheck.diff.findings import Verdict
from refcheck.diff.judge import judge
from refcheck.diff.replay import replay
from refcheck.diff.tolerance import Calibration, NoCalibration, tolerance_for
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.selftest.faults import FAULTS
from refcheck.selftest.run import selftest

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixtures (the selftest over every fault, the clean trace) are computed once.
pytestmark = pytest.mark.xdist_group("diff")


@pytest.fixture(scope="module")
def pool():
    return ReferencePool()


@pytest.fixture(scope="module")
def clean(pool):
    runner = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=15, max_new_tokens=20))
    trace, _ = runner.trace(load_prompts()[:2], record_layers=True)
    return runner, trace


def test_clean_reference_has_no_findings(pool, clean):
    _, trace = clean
    rep = judge(trace, pool, "clean", mode="both", strict_acceptance=True)
    assert rep.findings == []
    assert rep.exit_code == 0
    for cat in ("logits", "accepted_path", "kv", "conv", "recurrent", "draft", "logprobs", "ar_tokens"):
        assert rep.checks[cat] > 0, cat
    assert any(int(r) > 0 for s in trace.steps for r in (s.tree_ranks[i] for i in s.accepted)), "no non-first sibling"


@pytest.fixture(scope="module")
def selftest_rows():
    """One selftest over every fault (as ``refcheck selftest`` runs it: one clean run shared by all)."""
    rows = selftest(sorted(FAULTS), prompts=load_prompts()[:2], max_new_tokens=16)
    return {r.fault: r for r in rows}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_is_detected_with_its_category(fault, selftest_rows):
    row = selftest_rows[fault]
    assert row.detected, row
    assert row.category_found, row.to_json()


def test_selftest_clean_row_is_clean(selftest_rows):
    row = selftest_rows["clean"]
    assert row.ok and row.findings == 0 and not row.detected


def test_sibling_leak_bisects_to_a_linear_attention_layer(selftest_rows):
    row = selftest_rows["sibling-leak"]
    assert row.first["category"] == "logits"
    assert row.first["layer_type"] == "linear_attention"


def _flip(trace, tie_token_rank: int = 1):
    """Copy of the trace with one node's argmax replaced by its reference top-`rank` token."""
    steps = list(trace.steps)
    s = steps[0]
    node = len(s.tree_tokens) - 1  # a leaf that is not on the accepted path is fine
    argmax = list(s.target_argmax)
    argmax[node] = s.topk_ids[node][tie_token_rank]
    steps[0] = dataclasses.replace(s, target_argmax=argmax)
    return dataclasses.replace(trace, steps=steps), node, s.topk_logprobs[node][0] - s.topk_logprobs[node][tie_token_rank]


def test_near_tie_triage(clean):
    runner, trace = clean
    flipped, node, margin = _flip(trace)
    base = tolerance_for("float32", "cpu")
    benign = replay(flipped, runner.target, runner.drafter,
                    Calibration(dataclasses.replace(base, tie_margin=margin + 1.0), None, "test"))
    ties = [f for f in benign.findings if f.verdict == Verdict.BENIGN_TIE]
    assert ties and ties[0].node == node and abs(ties[0].details["margin"] - margin) < 1e-4
    assert not [f for f in benign.failures if f.category == "logits"]
    real = replay(flipped, runner.target, runner.drafter,
                  Calibration(dataclasses.replace(base, tie_margin=margin / 2), None, "test"))
    fails = [f for f in real.failures if f.category == "logits"]
    assert fails and fails[0].node == node and "not a near-tie" in fails[0].message


def test_nan_in_engine_logprobs_is_a_failure(pool, clean):
    _, trace = clean
    s = trace.steps[0]
    bad = [[math.nan] * len(row) for row in s.topk_logprobs]
    t2 = dataclasses.replace(trace, steps=[dataclasses.replace(s, topk_logprobs=bad), *trace.steps[1:]])
    rep = judge(t2, pool, "nan", mode="replay")
    assert any(f.category == "logits" and f.step == 0 for f in rep.failures)


def test_unmatched_state_is_a_failure(pool, clean):
    _, trace = clean
    s = trace.steps[0]
    t2 = dataclasses.replace(trace, steps=[dataclasses.replace(s, state=s.state[1:]), *trace.steps[1:]])
    rep = judge(t2, pool, "unmatched", mode="replay")
    assert any(f.category == "unmatched" for f in rep.failures)


def test_engine_without_state_is_unsupported_not_pass(pool, clean):
    _, trace = clean
    t2 = dataclasses.replace(trace, steps=[dataclasses.replace(s, state=[]) for s in trace.steps])
    rep = judge(t2, pool, "nostate", mode="replay")
    assert rep.counts["unsupported"] >= 3 and not rep.failures


def test_tolerance_rules():
    assert tolerance_for("bfloat16", "cuda:0") == tolerance_for("bfloat16", "cpu")
    with pytest.raises(NoCalibration, match="refcheck calibrate"):
        tolerance_for("int8", "cpu")
    with pytest.raises(NoCalibration):  # no verdict falls back to another dtype's bounds
        tolerance_for("float64", "cuda")


def test_full_state_traces_are_compared_in_full(pool):
    runner = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=15, max_new_tokens=12))
    trace, _ = runner.trace(load_prompts()[:1], full_state=True)
    assert all(e.full is not None for s in trace.steps for e in s.state)
    assert judge(trace, pool, "full", mode="replay").failures == []
    s = trace.steps[0]
    e = next(e for e in s.state if e.kind == "rec")
    bad = dataclasses.replace(e, full=e.full * 1.01)  # a 1 % error: invisible in a sketch? not in full
    t2 = dataclasses.replace(trace, steps=[dataclasses.replace(s, state=[bad if x is e else x for x in s.state]),
                                           *trace.steps[1:]])
    fails = judge(t2, pool, "full-bad", mode="replay").failures
    assert fails and fails[0].category == "recurrent" and fails[0].step == 0


def test_row_sketch_and_state_sketch_traces_judge_alike(pool):
    """A trace holding one sketch per state row (as older captures do) and one holding state sketches pass
    alike, and both fail a 30 % error in one recurrent head at its step."""
    from refcheck.sketch import sketch_rows, state_sketch

    runner = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=15, max_new_tokens=12))
    trace, _ = runner.trace(load_prompts()[:1], full_state=True)

    def form(sketch_of, bad_step: int | None = None):
        steps = []
        for s in trace.steps:
            state = []
            for e in s.state:
                rows = e.full.clone()
                if s.step == bad_step and e.kind == "rec" and e.layer == min(x.layer for x in s.state if x.kind == "rec"):
                    rows[0] *= 1.3
                state.append(dataclasses.replace(e, sketch=sketch_of(rows), full=None))
            steps.append(dataclasses.replace(s, state=state))
        return dataclasses.replace(trace, steps=steps)

    for sketch_of in (sketch_rows, state_sketch):
        clean_rep = judge(form(sketch_of), pool, "form", mode="replay")
        assert clean_rep.failures == [] and clean_rep.checks["recurrent"] > 0
        fails = judge(form(sketch_of, bad_step=1), pool, "form-bad", mode="replay").failures
        assert fails and fails[0].category == "recurrent" and fails[0].step == 1, sketch_of.__name__
    assert trace.steps[1].state[0].sketch.shape[0] == 1  # the reference records state sketches


def test_drafterless_engines_are_not_given_a_reference_ddtree_run():
    """An engine trace without a drafter (SGLang's NONE / NGRAM) runs no DDTree: its free run checks the tokens
    against target-only decoding and reports the engine's τ alone (no reference DDTree run, whose scripted
    stand-in drafter would cost a greedy continuation per sampled prefix at T > 0)."""
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest
    from refcheck.trace.io import Trace, read_trace

    full = read_trace(REPO_GOLDEN / load_manifest(REPO_GOLDEN).cases["sglang-hybrid-none"].file)
    rid = full.requests[0].request_id
    trace = Trace(full.provenance, full.requests[:1], [s for s in full.steps if s.request_id == rid])
    assert trace.prov.drafter == "none"
    pool = ReferencePool()
    rep = judge(trace, pool, "none", mode="free")
    assert rep.failures == [] and rep.stats["mean_tau_engine"] == 1.0 and rep.stats["mean_tau_reference"] is None
    assert not pool._decodes and rep.checks["ar_tokens"] > 0 and "acceptance" not in rep.checks


def test_a_request_with_its_own_token_limit_is_judged_to_it(tmp_path):
    """A prompt with its own ``max_new_tokens`` above the run's: its request row records it (schema 1.5), and the
    replay's output check and the free run's greedy oracle hold the request to it, not to the run's limit; an output
    longer than its own limit still fails."""
    from refcheck.prompts import Prompt
    from refcheck.trace.io import read_trace, write_trace

    pool = ReferencePool()
    runner = pool.runner(EngineSpec(pair="hybrid", budget=15, max_new_tokens=4, dtype="float32", device="cpu"))
    trace, _ = runner.trace([Prompt("own", tuple(load_prompts()[0].prompt_ids), "t", 10), load_prompts()[1]])
    assert trace.prov.max_new_tokens == 4 and [r.max_new_tokens for r in trace.requests] == [10, -1]
    assert [len(r.output_ids) for r in trace.requests] == [10, 4]
    write_trace(trace, tmp_path / "t.arrow")
    back = read_trace(tmp_path / "t.arrow")
    assert [r.max_new_tokens for r in back.requests] == [10, -1]
    rep = judge(back, pool, "own-limits", mode="both")
    assert rep.verdict == "pass", [f.message for f in rep.failures]
    back.requests[0].max_new_tokens = 6
    rep = judge(back, pool, "own-limits", mode="replay")
    assert [(f.category, f.request_id) for f in rep.failures] == [("output", "own")]
    assert "emitted 10 tokens; max_new_tokens is 6" in rep.failures[0].message
