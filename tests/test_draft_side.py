"""The drafter's side of a replayed step: the tree rebuilt from the engine's own drafts, the context it fed
its drafter, and the acceptance account (τ beside the reference's under the same rule, with causes)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_reference.tree import build_chain, build_ddtree
from refcheck.diff.acceptance import Account, StepAccount, cause_of, merge_json
from refcheck.diff.drafted_tree import TIE_MARGIN, compare, rebuild
from refcheck.diff.judge import judge
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec

pytestmark = pytest.mark.xdist_group("draft_side")


def _topk(lp: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    top = lp.topk(k, dim=-1)
    return top.indices.tolist(), top.values.tolist()


def _paths(tree) -> set[tuple[int, ...]]:
    from refcheck.diff.drafted_tree import paths

    return set(paths(tree.tokens.tolist(), tree.parents.tolist()))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 12), depth=st.integers(1, 4), budget=st.integers(1, 12),
       k=st.integers(1, 12))
def test_a_ddtree_rebuilt_from_its_top_k_is_the_tree_of_the_whole_draft_or_undecided(seed, vocab, depth, budget, k):
    gen = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(depth, vocab, generator=gen) * 2, dim=-1)
    full = build_ddtree(3 % vocab, lp, budget)
    ids, lps = _topk(lp, min(k, vocab))
    got = rebuild("ddtree", 3 % vocab, ids, lps, vocab, budget)
    if min(k, vocab) >= min(budget, vocab):
        assert got is not None  # enough ranks recorded: always decided
    if got is not None:
        assert _paths(got) == _paths(full)
        assert compare(full.tokens.tolist(), full.parents.tolist(), got, ids, lps) is None


def test_the_chain_is_the_top_one_per_depth_and_a_near_tie_is_excused():
    lp = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 3.0 - 1e-6]]), dim=-1)
    ids, lps = _topk(lp, 3)
    chain = rebuild("chain", 0, ids, lps, 3, None)
    assert chain.tokens.tolist() == build_chain(0, lp).tokens.tolist() == [0, 1, 0]
    # the engine took token 2 at depth 2: a tie within float rounding of the scores
    tie = compare([0, 1, 2], [-1, 0, 1], chain, ids, lps)
    assert tie is not None and tie.near_tie and tie.margin <= TIE_MARGIN
    # ... token 0 at depth 1 instead of token 1 is not
    off = compare([0, 0, 0], [-1, 0, 1], chain, ids, lps)
    assert off is not None and not off.near_tie and off.margin > 1.0
    # a token outside the recorded top-k: infinitely far
    assert compare([0, 1, 7], [-1, 0, 1], chain, ids, lps).margin == math.inf


def test_causes_and_the_account_line():
    assert cause_of({"logits"}, True, False, True) == "verify"
    assert cause_of({"draft"}, True, False, True) == "draft"
    assert cause_of({"tree"}, True, False, True) == "tree"
    assert cause_of(set(), True, True, True) == "rounding"
    assert cause_of(set(), True, False, False) == "unrecorded"
    assert cause_of(set(), False, False, True) == "unexplained"
    a = Account("chain", [StepAccount("r", 0, 3, 4, "rounding"), StepAccount("r", 1, 2, 2, None),
                          StepAccount("q", 0, 1, 3, "draft"), StepAccount("q", 1, 5, 5, None)])
    j = a.to_json()
    assert j["tau_engine"] == 2.75 and j["tau_reference"] == 3.5
    assert j["by_cause"] == {"draft": -0.5, "rounding": -0.25}
    assert math.isclose(sum(j["by_cause"].values()), j["delta"])
    assert a.line().startswith("τ engine 2.750 vs reference 3.500 (chain")
    half = Account("chain", a.steps[:2]).to_json(), Account("chain", a.steps[2:]).to_json()
    merged = merge_json(*half)
    assert merged["by_cause"] == j["by_cause"] and merged["tau_engine"] == j["tau_engine"]


@pytest.fixture(scope="module")
def pool():
    return ReferencePool()


@pytest.fixture(scope="module")
def clean(pool):
    """The reference (DFlash drafter) as an engine, budget 6, with each step's drafter feed recorded."""
    runner = pool.runner(EngineSpec(pair="hybrid", drafter="dflash", budget=6, max_new_tokens=16))
    trace, _ = runner.trace(load_prompts()[:2])
    for s in trace.steps:
        s.draft_context_positions = [s.committed_len + s.tree_depths[a] for a in s.accepted]
    return trace


def _categories(rep, verdict="fail"):
    return {f.category for f in rep.findings if f.verdict.value == verdict}


def test_a_clean_engine_passes_the_drafter_side_and_its_tau_is_the_references(pool, clean):
    rep = judge(clean, pool, "clean", mode="replay")
    assert rep.findings == []
    assert rep.checks["tree"] >= 2 * len(clean.steps) and rep.checks["draft"] > 0
    acc = rep.stats["acceptance_account"]
    assert acc["rule"] == "ddtree" and acc["steps"] == len(clean.steps) and acc["delta"] == 0 and acc["by_cause"] == {}


def test_a_drafter_fed_shifted_positions_fails_in_draft(pool, clean):
    bad = copy.deepcopy(clean)
    for s in bad.steps:
        s.draft_context_positions = [p + 1 for p in s.draft_context_positions]
    rep = judge(bad, pool, "shifted", mode="replay")
    assert _categories(rep) == {"draft"}
    assert min(f.step for f in rep.failures) == 0


def test_a_tree_that_is_not_its_drafts_tree_fails_in_tree_with_tau_accounted(pool, clean):
    """An engine whose tree builder pops fewer nodes than its budget: its trees are not what its own drafts
    give (tree), and the account names the tree for every step it lost acceptance."""
    runner = pool.runner(EngineSpec(pair="hybrid", drafter="dflash", budget=2, max_new_tokens=16))
    small, _ = runner.trace(load_prompts()[:2])
    small.provenance = {**small.provenance, "budget": 6}
    rep = judge(small, pool, "small-trees", mode="replay")
    assert "tree" in _categories(rep)
    first = min((f for f in rep.failures), key=lambda f: (f.request_id, f.step))
    assert first.category == "tree" and first.step == 0
    acc = rep.stats["acceptance_account"]
    assert acc["tau_engine"] < acc["tau_reference"]
    assert set(acc["by_cause"]) == {"tree"}


def test_unrecorded_drafts_are_counted_not_judged(pool, clean):
    bare = copy.deepcopy(clean)
    for s in bare.steps:
        s.draft_topk_ids, s.draft_topk_logprobs = [], []
    rep = judge(bare, pool, "bare", mode="replay")
    assert _categories(rep) == set()
    acc = rep.stats["acceptance_account"]
    assert acc["steps"] == 0 and acc["unrecorded_steps"] == len(bare.steps)


def test_output_past_max_new_tokens_or_a_stop_token_fails_whatever_the_steps_say(pool, clean):
    """The output bounds are judged on the engine's output itself (here its steps agree with it)."""
    long = copy.deepcopy(clean)
    req = long.requests[0]
    last = long.steps_of(req.request_id)[-1]
    extra = [5, 6]
    req.output_ids = list(req.output_ids) + extra
    req.output_logprobs = []
    last.emitted = list(last.emitted) + extra
    last.emitted_logprobs = list(last.emitted_logprobs) + [float("nan")] * 2
    rep = judge(long, pool, "long", mode="replay")
    msgs = [f.message for f in rep.failures if f.category == "output"]
    assert any("max_new_tokens is 16" in m for m in msgs), msgs
    stopped = copy.deepcopy(clean)
    stop = stopped.requests[1].output_ids[3]
    stopped.provenance = {**stopped.provenance, "engine": {**stopped.provenance["engine"], "settings": {
        **stopped.provenance["engine"]["settings"], "stop_token_ids": [stop]}}}
    rep = judge(stopped, pool, "stopped", mode="replay")
    assert any("after stop token" in f.message for f in rep.failures if f.category == "output")


def test_a_nan_in_a_state_sketch_or_the_drafter_feed_fails(pool, clean):
    bad = copy.deepcopy(clean)
    entry = next(e for e in bad.steps[0].state if e.kind == "rec")
    entry.sketch = entry.sketch.clone()
    entry.sketch[0, 0] = float("nan")
    rep = judge(bad, pool, "nan-state", mode="replay")
    assert any(f.category == "recurrent" and "non-finite" in f.message for f in rep.failures)
    fed = copy.deepcopy(clean)
    s = fed.steps[0]
    s.draft_context_sketch = torch.full((len(s.accepted), 16), float("nan"))
    rep = judge(fed, pool, "nan-feed", mode="replay")
    assert any(f.category == "draft" and "non-finite" in f.message for f in rep.failures)


def test_the_drafts_top_ranks_stay_on_the_scores_device():
    """Every output of ``draft_top`` on the scores' device (here the meta device): a CUDA graph packs them into one
    buffer, which a host tensor among them would break."""
    import torch

    from refcheck.sglang.draft_side import draft_top

    out = draft_top(torch.empty(2, 3, 50, device="meta"), 4)
    assert {k: v.device.type for k, v in out.items()} == dict.fromkeys(("ids", "logprobs", "reach", "k"), "meta")
