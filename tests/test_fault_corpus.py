"""The calibration corpus's reference-level faults (issue 16): each one really changes the engine where
it says, and the diff's first failing finding is exactly there (step, category, node, layer).

The onset (refcheck/selftest/onset.py) is the ground truth: the first step at which the faulty
decoder's reported or committed quantities differ from the clean decoder's. fp32 CPU, the built-in
hybrid pair, the scripted drafter (deep paths through decoy siblings), one prompt, few tokens.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from refcheck.diff.judge import judge
from refcheck.engines import check_engine, fault_decoder
from refcheck.errors import UsageError
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.selftest.faults import (
    EPSILONS,
    FAULTS,
    GRADED,
    LONG_CONTEXT_FAULTS,
    ConvNoise,
    RecScale,
    fault,
    fault_names,
    find_fault,
    first_sibling_parents,
)
from refcheck.selftest.onset import fault_onset

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixture (the clean run and every fault's) is computed once.
pytestmark = pytest.mark.xdist_group("fault_corpus")

#: the corpus's discrete faults (the first nine of FAULTS are tests/test_diff.py's)
CORPUS = ["parent-state", "attention-extra-node", "deep-positions-plus-one", "topk-ids-shifted", "kv-last-unwritten",
          "walk-stops-early", "conv-first-sibling", "bonus-from-root", "draft-context-no-root", "draft-context-rejected"]
STATE = ("kv", "conv", "recurrent")


@pytest.fixture(scope="module")
def corpus():
    pool = ReferencePool()
    runner = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=15, max_new_tokens=12))
    prompts = load_prompts()[:1]
    trace, results = runner.trace(prompts, record_layers=True)
    return pool, runner, prompts, trace, results[prompts[0].id]


def test_clean_run_has_zero_findings(corpus):
    pool, _, _, trace, _ = corpus
    rep = judge(trace, pool, "clean", mode="replay", strict_acceptance=True)
    assert rep.findings == [] and rep.exit_code == 0


@pytest.mark.parametrize("name", CORPUS)
def test_fault_is_caught_where_it_first_acts(corpus, name):
    pool, runner, prompts, _, clean = corpus
    cls, expected = FAULTS[name]
    trace, results = runner.trace(prompts, cls=cls, engine=f"fault:{name}", record_layers=True)
    onset = fault_onset(clean, results[prompts[0].id])
    assert onset is not None, f"{name} changed nothing"
    assert expected in onset.what, (name, onset)  # the fault changes the quantity its category compares
    rep = judge(trace, pool, name, mode="replay", strict_acceptance=True)
    first = next(iter(rep.first_divergence().values()))
    assert (first.step, first.category) == (onset.step, expected), (first.to_json(), onset)
    if expected == "logits":
        assert (first.node, first.layer) == (onset.node, onset.layer), (first.to_json(), onset)
    if expected in STATE:
        assert first.layer == onset.state_layer, (first.to_json(), onset)


def test_onsets_are_where_each_fault_acts(corpus):
    """Spot checks of the onsets themselves against the trees (not only clean-vs-faulty differences)."""
    _, runner, prompts, _, clean = corpus
    steps = clean.steps
    first_deep = next(s for s in steps if len(s.accepted) >= 2)
    for name, want in [("walk-stops-early", first_deep.step), ("draft-context-no-root", 1)]:
        _, results = runner.trace(prompts, cls=FAULTS[name][0], engine=f"fault:{name}")
        assert fault_onset(clean, results[prompts[0].id]).step == want, name
    # the first node that sees a non-ancestor in flat order / has an earlier sibling / sits at depth 2
    tree = steps[0].tree
    par = tree.parents.tolist()
    vis = tree.visibility()
    extra = next(i for i in range(1, tree.num_nodes) if not vis[i, i - 1])
    sibling = next(i for i in range(tree.num_nodes) if par.index(par[i]) < i)
    deep = next(i for i in range(tree.num_nodes) if int(tree.depths[i]) >= 2)
    for name, node in [("attention-extra-node", extra), ("conv-first-sibling", sibling), ("deep-positions-plus-one", deep)]:
        _, results = runner.trace(prompts, cls=FAULTS[name][0], engine=f"fault:{name}")
        onset = fault_onset(clean, results[prompts[0].id])
        assert (onset.step, onset.node) == (0, node), name


def test_first_sibling_parents():
    #        0
    #      / | \
    #     1  2  3      2 and 3 follow 1; 5 follows 4 (both children of 1)
    #    / \
    #   4   5
    parents = torch.tensor([-1, 0, 0, 0, 1, 1])
    assert first_sibling_parents(parents).tolist() == [-1, 0, 1, 1, 1, 4]


def test_conv_parents_hook_is_neutral_with_the_tree_parents(corpus):
    _, runner, _, _, clean = corpus
    target = runner.target
    s = clean.steps[0]
    state = target.prefill(torch.tensor(load_prompts()[0].prompt_ids))[0]
    a = target.forward(state, s.tree.tokens, s.tree.parents, s.tree.depths)
    b = target.forward(state, s.tree.tokens, s.tree.parents, s.tree.depths, conv_parents=s.tree.parents)
    c = target.forward(state, s.tree.tokens, s.tree.parents, s.tree.depths,
                       conv_parents=first_sibling_parents(s.tree.parents))
    assert torch.equal(a.logits, b.logits)
    assert not torch.equal(a.logits, c.logits)
    layer = next(iter(a.recurrent))  # the recurrence itself is untouched: the root's state is the same
    assert torch.equal(a.recurrent[layer][0], c.recurrent[layer][0])


# -- graded faults ------------------------------------------------------------------------------------
def test_graded_names_resolve_to_one_class_per_eps():
    assert find_fault("rec-scale:0.001") == find_fault("rec-scale:1e-3")
    cls, cat = fault("conv-noise:0.03")
    assert issubclass(cls, ConvNoise) and cls.eps == 0.03 and cat == "conv"
    assert fault("rec-scale:0.1")[0].eps == 0.1 and issubclass(fault("rec-scale:0.1")[0], RecScale)
    assert len(fault_names()) == len(FAULTS) + len(LONG_CONTEXT_FAULTS) + len(GRADED) * len(EPSILONS)
    for bad in ("rec-scale", "rec-scale:", "rec-scale:x", "rec-scale:0", "rec-scale:-0.1", "rec-scale:2",
                "rec-scale:nan", "nope:0.1", "nope"):
        assert find_fault(bad) is None, bad
    with pytest.raises(UsageError, match="rec-scale:EPS"):
        fault("nope")


def test_engine_names_accept_graded_faults():
    assert fault_decoder("rec-scale:0.01").eps == 0.01
    assert fault_decoder("bonus-from-root") is FAULTS["bonus-from-root"][0]
    assert check_engine("fault:rec-scale:0.01").name == "fault"
    with pytest.raises(UsageError, match=r"fault:conv-noise:0\.001.*EPS"):
        check_engine("fault:conv-noise:zero")


@pytest.mark.parametrize("kind", ["rec-scale", "conv-noise"])
def test_graded_faults_perturb_by_exactly_eps(corpus, kind):
    _, runner, prompts, _, clean = corpus
    eps = 0.01
    cfg = DecodeConfig(budget=15, max_new_tokens=4, keep_states=True)
    got = fault(f"{kind}:{eps}")[0](runner.target, runner.drafter, cfg).generate(list(prompts[0].prompt_ids))
    want = DDTreeDecoder(runner.target, runner.drafter, cfg).generate(list(prompts[0].prompt_ids))
    g, w = got.steps[0].state, want.steps[0].state
    pairs = [(x, y) for x, y in zip(g.recurrent if kind == "rec-scale" else g.conv,
                                    w.recurrent if kind == "rec-scale" else w.conv) if x is not None]
    assert pairs
    for x, y in pairs:
        assert abs(float((x - y).norm() / y.norm()) - eps) < 1e-5
    assert all(torch.equal(x, y) for x, y in zip(g.keys, w.keys) if x is not None)  # KV untouched


def test_a_large_graded_fault_is_caught_at_its_first_step(corpus):
    pool, runner, prompts, _, _ = corpus
    trace, _ = runner.trace(prompts, cls=fault("rec-scale:0.1")[0], engine="fault:rec-scale:0.1")
    first = next(iter(judge(trace, pool, "rec", mode="replay").first_divergence().values()))
    assert (first.step, first.category, first.layer) == (0, "recurrent", 0)


def test_draft_context_without_the_root_survives_root_only_steps(corpus):
    """A step that accepts only the root feeds the drafter an empty context (an index list of no nodes)."""
    _, runner, prompts, _, _ = corpus
    cfg = DecodeConfig(budget=0, max_new_tokens=4)
    got = FAULTS["draft-context-no-root"][0](runner.target, runner.drafter, cfg).generate(list(prompts[0].prompt_ids))
    want = DDTreeDecoder(runner.target, runner.drafter, cfg).generate(list(prompts[0].prompt_ids))
    assert got.accept_lengths == [1, 1, 1] and got.output_ids == want.output_ids
