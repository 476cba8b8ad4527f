"""The SGLang capture path end to end on the CPU, with a fake SGLang built from the reference.

The fake engine (tests/fake_engine_kit.py) holds exactly what SGLang holds at a verify step, computed with the
reference's own target. Its records go through the real capture code (steps, state, records on
disk, assembly) and the trace is replayed: a correct engine passes; an engine that runs the tree
flattened through the recurrent layers (the leak) is caught.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest
import torch
from fake_engine_kit import _prov, _replay, _sampled, fake_engine_setup, fake_sglang  # tests/fake_engine_kit.py

from ddtree_reference.sampling import Sampling, request_key
from ddtree_reference.tree import Tree, TreeError
from refcheck.diff.judge import judge
from refcheck.pool import ReferencePool
from refcheck.reference_runner import ReferenceRunner
from refcheck.sglang.capture.assemble import assemble_trace
from refcheck.sglang.capture.records import Recorder, read_capture
from refcheck.sglang.capture.segments import segment_files
from refcheck.sglang.capture.state import MambaPools, batch_state, request_state
from refcheck.sglang.capture.steps import StepCapture, summarise_nodes, tree_steps

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixture (the reference run the captures are cut from) is computed once.
pytestmark = pytest.mark.xdist_group("sglang_capture")


@pytest.fixture(scope="module")
def setup():
    return fake_engine_setup()


def test_tree_capture_of_a_correct_engine_passes(setup):
    runner, prompts, trees = setup
    assert any(len(set(p.tolist()[1:])) < len(p) - 1 for p, _, _ in trees)  # the trees branch
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    asm = assemble_trace(prompts, rids, results, cap, _prov(runner, prompts, 15))
    assert not asm.problems and not asm.incomplete
    rep = _replay(asm.trace)
    assert not rep.failures, [f.message for f in rep.failures]
    assert rep.checks["recurrent"] > 0 and rep.checks["kv"] > 0 and rep.checks["conv"] > 0
    assert len(asm.trace.steps) == 4 * len(prompts)


def test_sampled_tree_capture_of_the_keyed_sampler_replays_exactly(setup):
    """REFCHECK_DDTREE's keyed sampler at T = 1 (its real code on the fake engine's flat tensors), through
    the capture records and the assembly: the trace carries every node's draw and uniform and refcheck's
    keys, and the diff replays it exactly (every step judged); a draw moved
    to another uniform is a sampling finding at its step and node."""
    runner, prompts, _ = setup
    s = Sampling(1.0, top_p=0.95, seed=4)
    prompts = prompts[:1]
    sampled = ReferenceRunner(replace(runner.spec, sampling=s))
    steps = sampled.trace(prompts)[0].steps_of(prompts[0].id)  # the trees a sampled run verifies (its own draws)
    trees = [(torch.tensor(x.tree_parents), torch.tensor(x.tree_depths), [torch.tensor(x.tree_tokens)]) for x in steps[:4]]
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree", sampling=s)
    asm = assemble_trace(prompts, rids, results, cap, _prov(runner, prompts, 15), s, "refcheck-philox-position")
    assert not asm.problems and not asm.incomplete
    trace = asm.trace
    assert all(r.temperature == 1.0 and r.rng_request == request_key(r.request_id) and 0 <= r.first_uniform < 1
               for r in trace.requests)
    assert all(len(st.node_draws) == len(st.tree_tokens) == len(st.node_uniforms) for st in trace.steps)
    rep = judge(trace, ReferencePool(), "fake-sglang-sampled", mode="replay")  # (the fake stops after 4 steps: no free run)
    assert not rep.failures, [f.message for f in rep.failures]
    assert rep.checks["sampling"] >= len(trace.steps)
    assert any(st.accept_length > 1 for st in trace.steps), "nothing accepted: the walk is not exercised"
    st = next(x for x in trace.steps if x.accept_length > 1)
    node = st.accepted[1]
    bad_u = list(st.node_uniforms)
    bad_u[node] = (bad_u[node] + 0.5) % 1.0
    bad = replace(trace, steps=[replace(x, node_uniforms=bad_u) if x is st else x for x in trace.steps])
    rep = judge(bad, ReferencePool(), "moved-uniform", mode="replay")
    assert ("sampling", st.step, node) in {(f.category, f.step, f.node) for f in rep.failures if f.request_id == st.request_id}


def test_tree_capture_catches_the_recurrent_leak(setup):
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree", leaky=True)
    rep = _replay(assemble_trace(prompts, rids, results, cap, _prov(runner, prompts, 15)).trace)
    cats = {f.category for f in rep.failures}
    assert cats & {"logits", "recurrent"}, cats


def test_chain_capture_of_a_correct_engine_passes(setup):
    runner, prompts, _ = setup
    n = 16
    chain = (torch.tensor([-1] + list(range(n - 1))), torch.arange(n),
             [torch.tensor([0] + [(7 * i + 3 * b) % 500 + 2 for i in range(1, n)]) for b in range(len(prompts))])
    cap, results, rids = fake_sglang(runner, prompts, [chain] * 3, "chain", steps=3)
    asm = assemble_trace(prompts, rids, results, cap, _prov(runner, prompts, 15))
    rep = _replay(asm.trace)
    assert not rep.failures, [f.message for f in rep.failures]
    assert all(s.tree_parents == [-1] + list(range(n - 1)) for s in asm.trace.steps)


def test_records_round_trip_through_the_capture_directory(tmp_path):
    rec = Recorder(tmp_path)
    logits, nxt = torch.randn(2, 9), torch.tensor([3, 4])
    rec.ship("prefill_batch", {"rids": ["a", "b"], "prompt_lens": [5, 6], "uniforms": {"b": 0.5}},
             {"t": {"nodes": summarise_nodes(logits, nxt).tensors(), "next_ids": nxt}})
    assert rec.shipper.drain(10.0)
    rec.error("eagle_sample:after", "boom")
    rec.records.append([b"spoiled"])  # a whole frame whose record is not one
    back = read_capture(tmp_path)
    a, b = back.prefills[0]
    assert (a.rid, a.prompt_len, a.token, b.token, b.uniform) == ("a", 5, 3, 4, 0.5) and math.isnan(a.uniform)
    assert a.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]), abs=1e-6)
    assert any("boom" in e for e in back.errors) and back.lost == 0
    assert [e for e in back.errors if "records-000000.seg@" in e and "unreadable record" in e], back.errors
    seg, = segment_files(rec.dir, "records")
    with open(seg, "ab") as f:  # the head of a frame being written
        f.write(b"RCF1\x10")
    assert not [e for e in read_capture(tmp_path, running=True).errors if "cut short" in e]
    assert [e for e in read_capture(tmp_path).errors if "records-000000.seg: a frame cut short" in e]
    (rec.dir / "00000000.rec").write_bytes(b"RCAP1\n")  # a record file of the one-file-per-record format
    assert [e for e in read_capture(tmp_path).errors if "1 record file(s) of the one-file-per-record format" in e]


def test_a_process_whose_pid_an_earlier_one_used_records_beside_it_never_over_it(tmp_path):
    """A scheduler restarted with the same pid (a container's) into the same capture directory gets a directory,
    counters and status of its own; the earlier one's records are read as they were, and the reader says two
    processes recorded as one rank."""
    first = Recorder(tmp_path)
    first.error("run_batch", "the first run's error")
    second = Recorder(tmp_path)
    second.error("run_batch", "the second run's error")
    pid = os.getpid()
    assert (first.dir.name, second.dir.name) == (f"rank0-pid{pid}", f"rank0-pid{pid}.1")
    assert second.status_path.name == f"status-rank0-pid{pid}.1.json"
    assert sorted(f.name for f in tmp_path.glob("queue-*")) == [f"queue-rank0-pid{pid}.1.bin", f"queue-rank0-pid{pid}.bin"]
    errors = read_capture(tmp_path).errors
    assert [e for e in errors if "the first run's error" in e] and [e for e in errors if "the second run's error" in e]
    assert [e for e in errors if "2 scheduler processes" in e and "recorded as tensor-parallel rank 0" in e], errors


def test_assembly_cuts_the_last_block_and_flags_inconsistencies(setup):
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=3)
    out = results[prompts[0].id]["output_ids"]
    cut = {prompts[0].id: {"output_ids": out[:-1]}}  # SGLang stopped one token before the block's end
    asm = assemble_trace(prompts[:1], rids, cut, cap, _prov(runner, prompts[:1], 15))
    assert not asm.problems
    assert sum(len(s.emitted) for s in asm.trace.steps) + 1 == len(out) - 1
    assert len(asm.trace.requests[0].output_logprobs) == len(out) - 1
    assert not _replay(asm.trace).failures
    bad = {prompts[0].id: {"output_ids": out[:3] + [out[3] + 1] + out[4:]}}
    assert any("emitted" in p for p in assemble_trace(prompts[:1], rids, bad, cap, _prov(runner, prompts[:1], 15)).problems)
    crashed = assemble_trace(prompts[:1], rids, {}, cap, _prov(runner, prompts[:1], 15))
    assert crashed.incomplete == [prompts[0].id] and crashed.trace.requests[0].output_ids == out


def test_incomplete_capture_is_reported(setup):
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=2)
    trace = assemble_trace(prompts[:1], rids, {}, cap, _prov(runner, prompts[:1], 15)).trace
    trace.provenance["capture"] = {"incomplete": [prompts[0].id], "crash": "RuntimeError: scheduler died", "errors": []}
    rep = _replay(trace)
    assert any(f.category == "engine" and "incomplete" in f.message for f in rep.failures)
    assert rep.exit_code == 1


def test_tree_steps_on_a_worked_example():
    # SGLang's own example tree 0 -> {1, 2}, 1 -> 3; node 2 accepted (a non-first sibling)
    tokens = torch.tensor([10, 11, 12, 13])
    logits = torch.full((4, 20), -5.0)
    logits[0, 12] = logits[2, 7] = logits[1, 13] = logits[3, 1] = 5.0
    predict = torch.tensor([12, 0, 7, 0])
    recs = tree_steps(tokens, torch.tensor([[1, 3, -1, -1]]), torch.tensor([[-1, 2, -1, -1]]),
                      summarise_nodes(logits, predict), torch.tensor([[0, 2, -1, -1]]), torch.tensor([2]), predict, ["a"], [5],
                      positions=torch.tensor([5, 6, 6, 7]))
    r = recs[0]
    assert r.parents == [-1, 0, 0, 1] and r.depths == [0, 1, 1, 2] and r.accepted == [0, 2]
    assert r.emitted == [12, 7] and r.bonus == 7 and r.meta["branching"] and r.meta["positions_match_depths"]
    assert r.argmax == [12, 13, 7, 1]
    assert all(math.isclose(lp, float(torch.log_softmax(logits[0], -1)[12]), rel_tol=1e-6) for lp in r.emitted_logprobs[:1])


def test_duplicate_sibling_tokens_walk_like_sglang():
    # NGRAM pads unused slots with token-0 children of the root; SGLang's walk takes the first match
    tree = Tree(torch.tensor([5, 0, 0, 9]), torch.tensor([-1, 0, 0, 2]), torch.tensor([0, 1, 1, 2]),
                torch.tensor([0, 0, 0, 0]), torch.zeros(4))
    tree.validate(structural_only=True)
    with pytest.raises(TreeError):
        tree.validate()
    assert tree.walk_greedy(torch.tensor([0, 3, 9, 1])) == [0, 1]


def test_batch_state_layouts_and_sketches():
    """Each request's committed rows in refcheck's layouts (its KV rows from its slots, its conv / SSM slot), and
    state sketches equal to the reference layout's (the SSM's sketched in SGLang's order with each head's
    projection rows permuted; KV summed over the accepted rows only);
    the stacked mamba pools gathered for every layer at once, or for the rows a rank records."""
    from refcheck.sketch import state_sketch

    kb = torch.arange(8 * 2 * 3, dtype=torch.float32).reshape(8, 2, 3)
    conv = torch.randn(2, 4, 6, 3)  # [L, slots, C, K-1]
    ssm = torch.randn(2, 4, 2, 5, 3)  # [L, slots, HV, V, K]
    pools = MambaPools([1, 4], [0, 1], conv, ssm)
    batch = batch_state({2: (kb, kb + 1)}, torch.tensor([[6, 2, 0], [1, 5, 7]]), pools, torch.tensor([3, 1]), full=True)
    one = request_state(batch, 1, 2)
    assert torch.equal(one["kv_k.2"][3], kb[[1, 5]].reshape(2, 6))
    for i, layer in enumerate([1, 4]):
        assert torch.equal(one[f"conv.{layer}"][3], conv[i, 1].T)
        assert torch.equal(one[f"rec.{layer}"][3], ssm[i, 1].transpose(-1, -2).reshape(2, 15))
        assert torch.allclose(one[f"rec.{layer}"][2], state_sketch(ssm[i, 1].transpose(-1, -2).reshape(2, 15)), atol=1e-5)
        assert torch.allclose(one[f"conv.{layer}"][2], state_sketch(conv[i, 1].T), atol=1e-5)
    assert torch.allclose(one["kv_v.2"][2], state_sketch((kb + 1)[[1, 5]].reshape(2, 6)), atol=1e-5)
    assert not torch.allclose(request_state(batch, 1, 3)["kv_v.2"][2], one["kv_v.2"][2], atol=1e-3)  # row 7 counts
    second = request_state(batch_state({}, torch.tensor([[0]]), MambaPools([4], [1], conv, ssm), torch.tensor([2]),
                                       full=True), 0, 1)
    assert set(second) == {"conv.4", "rec.4"} and torch.equal(second["conv.4"][3], conv[1, 2].T)
    for axis in (-1, 1):  # SGLang's axis of the window in one slot's [C, K-1] state (1: the same, counted forward)
        again = batch_state({}, torch.tensor([[0]]), MambaPools([1], [0], conv, ssm, axis), torch.tensor([2]), full=True)
        assert torch.equal(request_state(again, 0, 1)["conv.1"][3], conv[0, 2].T)
    window_first = conv.transpose(2, 3).contiguous()  # a pool keeping [K-1, C] per slot: conv_window_axis 0
    again = batch_state({}, torch.tensor([[0]]), MambaPools([1], [0], window_first, ssm, 0), torch.tensor([2]), full=True)
    assert torch.equal(request_state(again, 0, 1)["conv.1"][3], conv[0, 2].T)
    with pytest.raises(ValueError):
        batch_state({}, torch.tensor([[0]]), pools, None)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_combine_to_the_full_state(setup, tp):
    """TP ranks each record their head / channel shards; merged, the trace replays clean, and the combined sketches
    and full tensors equal the single-rank capture's. At 4 ranks the built-in target's 2 KV heads are each held by
    two ranks: a replica adds nothing to the sketch and its rows are taken once."""
    runner, prompts, trees = setup
    one, results, rids = fake_sglang(runner, prompts[:2], trees, "tree", steps=2, full=True)
    two, results2, _ = fake_sglang(runner, prompts[:2], trees, "tree", steps=2, tp=tp, full=True)
    assert results == results2
    asm1 = assemble_trace(prompts[:2], rids, results, one, _prov(runner, prompts[:2], 15))
    asm2 = assemble_trace(prompts[:2], rids, results2, two, _prov(runner, prompts[:2], 15))
    assert not asm2.problems
    for a, b in zip(asm1.trace.steps, asm2.trace.steps):
        for ea, eb in zip(a.state, b.state):
            assert ea.name == eb.name
            assert torch.allclose(ea.sketch, eb.sketch, atol=1e-5, rtol=1e-5), ea.name
            assert torch.equal(ea.full, eb.full), ea.name
    assert not _replay(asm2.trace).failures
    two.steps[1][0].accepted = [0]  # a rank that disagrees is reported
    assert any("disagree" in p for p in assemble_trace(prompts[:2], rids, results2, two, _prov(runner, prompts[:2], 15)).problems)


def test_layer_sketches_bisect_the_leak_to_the_first_linear_attention_layer(setup):
    """With the layer hooks' sketches, a failing node of the leaky engine is traced to layer 0, the
    first Gated DeltaNet layer, and a correct engine's sketches agree at every layer."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:2], trees, "tree", leaky=True, steps=2, layer_sketches=True)
    rep = _replay(assemble_trace(prompts[:2], rids, results, cap, _prov(runner, prompts[:2], 15)).trace)
    bisected = [f for f in rep.failures if f.layer is not None and "bisection" in f.message]
    assert bisected and all(f.layer == 0 and f.layer_type == "linear_attention" for f in bisected)
    cap, results, rids = fake_sglang(runner, prompts[:2], trees, "tree", steps=2, layer_sketches=True)
    trace = assemble_trace(prompts[:2], rids, results, cap, _prov(runner, prompts[:2], 15)).trace
    assert all(s.layer_sketch is not None for s in trace.steps) and not _replay(trace).failures


def test_branching_trees_in_the_chain_layout_are_flagged_from_the_capture_alone(setup):
    """The leak's configuration (server topk <= 1 while the trees branch) is reported without numerics."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=2)
    for s in cap.steps[0]:
        s.meta.update(layout_in_engine="chain", server_topk=1)  # what the eagle_sample hook records at topk 1
    cap.steps[0][1].meta["cuda_graph"] = True  # what run_batch's hook records when the verify replayed a CUDA graph
    asm = assemble_trace(prompts[:1], rids, results, cap, _prov(runner, prompts[:1], 15))
    assert asm.stats["chain_layout_branching_steps"] == 2 and asm.stats["chain_layout_first"] == [prompts[0].id, 0]
    assert asm.stats["cuda_graph_steps"] == 1
    from refcheck.diff.findings import Report
    from refcheck.diff.trace_verdicts import capture_findings

    trace = asm.trace
    trace.provenance["capture"] = {"stats": asm.stats, "errors": []}
    rep = Report("x", "replay")
    capture_findings(rep, trace)
    assert [(f.category, f.step) for f in rep.failures] == [("tree", 0)] and "chain layout" in rep.failures[0].message


def test_step_timings_come_from_the_scheduler_step_and_the_ddtree_drafting():
    """The assembled step's "verify" is SGLang's whole scheduler step; "draft" is what REFCHECK_DDTREE
    spent drafting inside it (NaN for SGLang's own algorithms, which report no such phase)."""
    import math

    from refcheck.sglang.capture.assemble import _step_row

    base = dict(rid="r", committed_len=5, tokens=[7, 8], parents=[-1, 0], depths=[0, 1], topk_ids=[[1], [2]],
                topk_logprobs=[[-0.1], [-0.2]], argmax=[8, 9], accepted=[0, 1], bonus=9, emitted=[8, 9],
                emitted_logprobs=[-0.1, -0.2], layout="tree")
    row = _step_row("p", 0, StepCapture(**base, meta={"batch_step_s": 0.25, "batch_draft_s": 0.1}), keep=2)
    assert row.timings["verify"] == 0.25 and row.timings["draft"] == 0.1
    row = _step_row("p", 0, StepCapture(**base, meta={"batch_step_s": 0.25}), keep=2)
    assert math.isnan(row.timings["draft"]) and row.timings["verify"] == 0.25


def test_one_step_past_the_output_is_expected_under_the_overlap_scheduler(setup):
    """The overlap scheduler launches a request's next step before it processes the last one's finish: one
    captured step past the end of the output is dropped silently there (and counted), a problem elsewhere."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=3)
    out = results[prompts[0].id]["output_ids"]
    last = len(cap.steps[0][-1].emitted)
    cut = {prompts[0].id: {"output_ids": out[:-last]}}  # the output ends where the last captured step began
    prov = _prov(runner, prompts[:1], 15)
    plain = assemble_trace(prompts[:1], rids, cut, cap, prov)
    assert any("past the end of the output" in p for p in plain.problems)
    over = assemble_trace(prompts[:1], rids, cut, cap, prov, overlap=True)
    assert not over.problems and over.stats["steps_past_output_dropped"] == 1
    assert len(over.trace.steps) == len(plain.trace.steps) == 2


def test_a_sampled_capture_is_judged_on_the_steps_it_holds(setup):
    """One batch in two (a seeded phase): the assembly numbers steps as the engine did and places each
    in the output by its committed length; the replay re-prefills across every gap and passes the correct engine,
    while the leaky engine's sampled trace still fails on the steps it holds."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    runner, prompts, trees = setup
    rule = SampleRule(2, seed=3)
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    asm = assemble_trace(prompts, rids, results, _sampled(cap, rule), _prov(runner, prompts, 15))
    assert not asm.problems, asm.problems
    assert not rule.takes(0) and not any(r.output_logprobs for r in asm.trace.requests)  # no prefill recorded
    assert len(asm.trace.steps) == 2 * len(prompts)
    assert len({s.step % 2 for s in asm.trace.steps}) == 1 and asm.trace.steps[0].step == rule.phase
    rep = _replay(asm.trace)
    assert not rep.failures, [f.message for f in rep.failures]
    assert rep.stats["gaps_crossed"] >= len(prompts) and rep.checks["recurrent"] > 0
    leaky, results, rids = fake_sglang(runner, prompts, trees, "tree", leaky=True)
    rep = _replay(assemble_trace(prompts, rids, results, _sampled(leaky, rule), _prov(runner, prompts, 15)).trace)
    assert {f.category for f in rep.failures} & {"logits", "recurrent"}


def test_a_sampled_step_off_its_output_is_an_alignment_failure(setup):
    """A step after a gap whose committed length does not lie where its root is in the output is not followed."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree")
    sampled = _sampled(cap, SampleRule(2, seed=3))
    late = sampled.steps[0][-1]
    late.committed_len += 1  # the engine says it had one more token than its output puts before the root
    trace = assemble_trace(prompts[:1], rids, results, sampled, _prov(runner, prompts[:1], 15)).trace
    assert any(f.category in ("alignment", "output") for f in _replay(trace).failures)


def test_records_lost_to_a_full_capture_queue_are_reported_not_failed(setup):
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=2)
    trace = assemble_trace(prompts[:1], rids, results, cap, _prov(runner, prompts[:1], 15)).trace
    trace.provenance["capture"] = {"incomplete": [], "crash": None, "errors": [], "stats": {"lost_batches": 3}}
    rep = _replay(trace)
    assert not rep.failures and rep.exit_code == 0
    assert any(f.category == "engine" and "3 batch record(s)" in f.message for f in rep.findings)


def test_a_capture_cut_at_its_byte_budget_is_judged_on_the_steps_before_it(setup):
    """A process's records stop at its byte budget: the capture holds every request's first two steps and none after.
    Declared (the batches past the budget counted, the budget named), the steps held are judged and pass, and an
    engine SKIPPED finding says how many batches went unrecorded; undeclared, the missing tail fails the output."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    cap.steps[0] = cap.steps[0][:2 * len(prompts)]  # the fake engine's first two batches: every request's steps 0, 1
    trace = assemble_trace(prompts, rids, results, cap, _prov(runner, prompts, 15)).trace
    assert {s.step for s in trace.steps} == {0, 1} and len({s.request_id for s in trace.steps}) == len(prompts)
    assert "output" in {f.category for f in _replay(trace).failures}
    trace.provenance["capture"] = {"incomplete": [], "crash": None, "errors": [], "max_bytes": 3 << 20,
                                   "stats": {"over_budget_batches": 2}}
    rep = _replay(trace)
    assert not rep.failures and rep.exit_code == 0, [f.message for f in rep.failures]
    assert rep.checks["recurrent"] > 0
    assert any(f.category == "engine" and "byte budget (3 MiB per scheduler process): 2 batch(es)" in f.message
               for f in rep.findings)


def test_a_capture_whose_oldest_records_were_rolled_out_is_judged_on_the_rest(setup):
    """A rolling byte budget deleted the first batch's records: every request's step 0 is gone. Declared, the later
    steps are judged (the replay re-prefills to their roots) and pass, and an engine SKIPPED finding counts the deleted
    records."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    first = {}
    kept = []
    for s in cap.steps[0]:
        k = first.setdefault(s.rid, 0)
        first[s.rid] = k + 1
        kept.append(StepCapture.from_dict({**s.to_dict(), "meta": {**s.meta, "step_index": k}}))
    cap.steps[0] = [s for s in kept if s.meta["step_index"] > 0]
    trace = assemble_trace(prompts, rids, results, cap, _prov(runner, prompts, 15)).trace
    assert {s.step for s in trace.steps} == {1, 2, 3}
    trace.provenance["capture"] = {"incomplete": [], "crash": None, "errors": [], "max_bytes": 1 << 20, "roll": True,
                                   "stats": {"rolled_out_records": 1}}
    rep = _replay(trace)
    assert not rep.failures, [f.message for f in rep.failures]
    assert any(f.category == "engine" and "deleting its 1 oldest batch record(s)" in f.message for f in rep.findings)


def test_a_sampled_capture_may_hold_no_step_of_a_request(setup):
    """1 step in 64 over 4 steps: most requests have no recorded step; their outputs are judged by their first
    token, and the trace passes only when its capture declares the sampling (else the output is missing steps)."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    trace = assemble_trace(prompts, rids, results, _sampled(cap, SampleRule(64, seed=1)), _prov(runner, prompts, 15)).trace
    assert len({s.request_id for s in trace.steps}) < len(prompts)
    undeclared = _replay(trace)
    assert {f.category for f in undeclared.failures} == {"output"}
    trace.provenance["capture"] = {"incomplete": [], "crash": None, "errors": [], "sample": {"every": 64, "seed": 1}}
    rep = _replay(trace)
    assert not rep.failures, [f.message for f in rep.failures]


def test_kv_heads_are_replicated_over_ranks_only_when_ranks_outnumber_them():
    from refcheck.sglang.capture.versions import kv_replicas

    def sched(heads):
        return NS(tp_worker=NS(model_runner=NS(model_config=NS(get_total_num_kv_heads=lambda: heads))))

    assert [kv_replicas(sched(4), tp) for tp in (1, 2, 4, 8)] == [1, 1, 1, 2]
    assert kv_replicas(sched(2), 8) == 4 and kv_replicas(NS(), 8) == 1
