"""What the capture hooks (refcheck/sglang/capture/hooks.py) record, driven with stand-ins for SGLang's scheduler,
batch and pools (tests/capture_kit.py).

No SGLang here: the hooks are called the way HookRegistry's AROUND wrappers call them, the worker's
``eagle_sample`` happening inside ``run_batch``; the records they write are read back and checked against the
stand-in pools, slot by slot: prefills, tree and target-only steps, the sampler's draws and coins, overlap, tensor
parallelism, untraced requests, hook failures.
"""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch
from capture_kit import (  # tests/capture_kit.py
    HV,
    Mode,
    N,
    V,
    make_batch,
    make_scheduler,
    make_tree,
    read_capture,
    run_prefill,
    tree_and_root_batches,
)

from refcheck.sglang.capture import hooks
from refcheck.sglang.capture.batch import Batch


def test_prefill_and_tree_step_are_recorded_with_committed_state(capture_dir):
    sched, kb, conv, temporal = make_scheduler()
    logits0 = run_prefill(sched)
    # one verify step of two requests: tree 0 -> {1, 2}, 1 -> 3; request 0 accepts [0, 2], request 1 [0, 1, 3]
    batch = make_batch("decode", True, [[7], [9]])
    tokens, nt, ns = make_tree()
    logits = torch.randn(2 * N, V)
    verify_input = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns,
                      positions=torch.tensor([3, 4, 4, 5, 3, 4, 4, 5]))
    accept_index = torch.tensor([[0, 2, -1, -1], [4, 5, 7, -1]])
    accept_lens = torch.tensor([2, 3])
    predict = torch.tensor([12, 0, 30, 0, 21, 23, 0, 31])

    def worker(self, b):
        def sample(vi, bb, lo, grammar_mask=None):
            lo.next_token_logits.add_(100.0)  # SGLang adds penalties in place: the capture must not see them
            return predict, accept_lens, accept_index
        hooks._eagle_sample(sample, verify_input, b, NS(next_token_logits=logits.clone()))
        return NS(logits_output=None, next_token_ids=None)

    hooks._run_batch(worker, sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [p.token for p in cap.prefills[0]] == logits0.argmax(-1).tolist()
    s0, s1 = cap.steps[0]
    assert (s0.rid, s0.committed_len, s0.accepted, s0.emitted, s0.parents) == ("r0", 3, [0, 2], [12, 30], [-1, 0, 0, 1])
    assert (s1.accepted, s1.emitted, s1.bonus) == ([0, 1, 3], [21, 23, 31], 31)
    lp = torch.log_softmax(logits, -1)
    assert s0.topk_logprobs[0][0] == pytest.approx(float(lp[0].max()), abs=1e-6)
    assert s0.meta["layout_in_engine"] == "tree" and s0.meta["branching"]
    # request 1 sits in pool row 2: KV rows of positions 3..5 are slots req_to_token[2, 3:6]; mamba slot 2
    slots = torch.arange(60).reshape(3, 20).flip(1)[2, 3:6]
    from refcheck.sketch import state_sketch

    assert torch.allclose(s1.state["kv_k.2"][2], state_sketch(kb[slots].reshape(3, -1)), atol=1e-5)
    assert torch.allclose(s1.state["conv.0"][2], state_sketch(conv[0][0, 2].T), atol=1e-5)
    assert torch.allclose(s1.state["rec.0"][2], state_sketch(temporal[0, 2].transpose(-1, -2).reshape(HV, -1)), atol=1e-5)
    assert cap.status and cap.status[0]["tp_rank"] == 0 and cap.status[0]["server_topk"] == 4
    host = cap.status[0]["host"]  # the host's speed, to read the ledger's costs against
    assert set(host) == {"clock_read_ns", "python_loop_us"} and all(v > 0 for v in host.values())


def test_keyed_sampler_step_records_draws_uniforms_and_first_uniforms(capture_dir):
    """REFCHECK_DDTREE's keyed sampler returns eagle_sample's three outputs plus every node's draw and
    uniform: the hook records them for the sampled request only; the prefill record takes the keyed first
    draw's uniform from the worker."""
    sched, *_ = make_scheduler()
    sched.draft_worker = NS(last_first_uniforms={"r1": 0.25}, last_draft_s=None)
    run_prefill(sched)
    batch = make_batch("decode", True, [[7], [9]])
    tokens, nt, ns = make_tree()
    verify_input = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns, positions=None)
    draws = torch.tensor([-1, -1, -1, -1, 21, 23, 5, 31])  # request 0 greedy, request 1 sampled
    uniforms = torch.tensor([math.nan] * 4 + [0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    out = (torch.tensor([12, 0, 30, 0, 21, 23, 0, 31]), torch.tensor([2, 3]), torch.tensor([[0, 2, -1, -1], [4, 5, 7, -1]]),
           draws, uniforms)

    def worker(self, b):
        hooks._eagle_sample(lambda *a: out, verify_input, b, NS(next_token_logits=torch.randn(2 * N, V)), None)
        return NS(logits_output=None, next_token_ids=None)

    hooks._run_batch(worker, sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [math.isnan(p.uniform) for p in cap.prefills[0]] == [True, False] and cap.prefills[0][1].uniform == 0.25
    s0, s1 = cap.steps[0]
    assert (s0.draws, s0.uniforms) == ([], [])
    assert s1.draws == [21, 23, 5, 31] and s1.uniforms == [0.1, 0.2, 0.3, 0.4] and s1.accepted == [0, 1, 3]


def test_tree_sampler_coins_are_recorded_with_the_step(capture_dir):
    """NGRAM at T > 0: eagle_sample calls SGLang's tree sampler with its coins; the hook copies them before the
    kernel runs, and the step records carry each request's node coins and bonus coin (and the thresholds)."""
    sched, *_ = make_scheduler()
    run_prefill(sched)
    batch = make_batch("decode", True, [[7], [9]])
    tokens, nt, ns = make_tree()
    verify_input = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns, positions=None)
    coins = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], dtype=torch.float32)
    final = torch.tensor([0.25, 0.75], dtype=torch.float32)
    out = (torch.tensor([12, 0, 30, 0, 21, 23, 0, 31]), torch.tensor([2, 3]), torch.tensor([[0, 2, -1, -1], [4, 5, 7, -1]]))

    def kernel(**kw):
        kw["uniform_samples"].fill_(0.0)  # whatever the kernel does to its inputs after the hook has copied them
        return None

    def sample(*a, **k):
        hooks._verify_coins(kernel, uniform_samples=coins.clone(), uniform_samples_for_final_sampling=final,
                             threshold_single=1.0, threshold_acc=1.0)
        return out

    def worker(self, b):
        hooks._eagle_sample(sample, verify_input, b, NS(next_token_logits=torch.randn(2 * N, V)), None)
        return NS(logits_output=None, next_token_ids=None)

    hooks._run_batch(worker, sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    s0, s1 = cap.steps[0]
    assert s0.draws == [] and s0.uniforms == pytest.approx([0.1, 0.2, 0.3, 0.4]) and s0.residual_uniform == 0.25
    assert s1.uniforms == pytest.approx([0.5, 0.6, 0.7, 0.8]) and s1.residual_uniform == 0.75
    assert s0.uniforms[1] == float(torch.tensor(0.2, dtype=torch.float32))  # float32 coins, exact
    assert s0.meta["accept_thresholds"] == [1.0, 1.0]


def test_prefill_logprobs_come_from_the_logits_before_the_sampler_overwrites_them(capture_dir):
    """At T > 0 SGLang's sampler turns next_token_logits into softmax(logits / T) in place; the prefill record's
    log-prob is the raw logits' (kept by the ModelRunner.sample hook), not the probabilities'."""
    sched, *_ = make_scheduler()
    raw = torch.randn(2, V) * 3

    def sample(runner, lo, fb):
        lo.next_token_logits[:] = torch.softmax(lo.next_token_logits / 0.7, dim=-1)
        return torch.tensor([3, 4])

    def worker(self, b):
        lo = NS(next_token_logits=raw.clone())
        ids = hooks._sample(sample, None, lo, NS(sampling_info=NS(is_all_greedy=False)))
        return NS(logits_output=lo, next_token_ids=ids)

    hooks._run_batch(worker, sched, make_batch("extend", True, [[], []]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    lp = torch.log_softmax(raw, -1)
    assert [p.logprob for p in cap.prefills[0]] == pytest.approx([float(lp[0, 3]), float(lp[1, 4])], abs=1e-5)


def test_hook_failures_are_recorded_not_raised(capture_dir):
    sched, *_ = make_scheduler()
    sched.tp_worker = None  # the state lookup will fail
    logits1 = torch.randn(1, V)
    res = hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits1), next_token_ids=logits1.argmax(-1)),
                            sched, make_batch("decode", False, [[5]]))
    assert res.next_token_ids is not None  # SGLang's result is returned untouched
    cap = read_capture(capture_dir)
    assert any("run_batch:after" in e for e in cap.errors)
    # a speculative batch whose verify was never seen is an error too
    hooks._run_batch(lambda self, b: NS(logits_output=None, next_token_ids=None), make_scheduler()[0], make_batch("decode", True, [[5]]))
    assert any("no verify step was captured" in e for e in read_capture(capture_dir).errors)


def test_untraced_timing_requests_pass_straight_through(capture_dir):
    """Requests under UNTRACED_RID_PREFIX (a sweep's warm timing repeats) are neither synchronised nor
    recorded: SGLang's result comes back untouched and the capture directory holds nothing for them."""
    from refcheck.sglang.env import UNTRACED_RID_PREFIX

    sched, *_ = make_scheduler()
    batch = make_batch("decode", True, [[5], [6]])
    for r in batch.reqs:
        r.rid = UNTRACED_RID_PREFIX + r.rid
    sentinel = NS(logits_output=None, next_token_ids=None)
    assert hooks._run_batch(lambda self, b: sentinel, sched, batch) is sentinel
    cap = read_capture(capture_dir)
    assert not cap.steps and not cap.errors and not cap.status  # a traced batch of this kind is an error (above)
    batch.reqs[1].rid = "r1"  # one traced request in the batch, after an untraced one: the whole batch is captured
    hooks._run_batch(lambda self, b: sentinel, sched, batch)
    assert sum("no verify step was captured" in e for e in read_capture(capture_dir).errors) == 1
    batch.reqs[0].rid = "r0"  # and first
    hooks._run_batch(lambda self, b: sentinel, sched, batch)
    assert sum("no verify step was captured" in e for e in read_capture(capture_dir).errors) == 2


def test_tensor_parallel_rank_is_found_where_each_release_keeps_it():
    """0.5.17 keeps the rank on scheduler.ps (a ParallelState); reading only scheduler.tp_rank made every
    rank of a TP=2 engine record itself as rank 0 on the H200, and its state shards could not combine."""
    from refcheck.sglang.capture.versions import tp_of

    assert tp_of(NS(tp_rank=1, tp_size=2)) == (1, 2)  # older releases
    assert tp_of(NS(ps=NS(tp_rank=1, tp_size=2), server_args=NS(tp_size=2))) == (1, 2)  # 0.5.17
    assert tp_of(NS(server_args=NS(tp_size=4))) == (0, 4)
    assert tp_of(NS()) == (0, 1)


def test_a_runtime_context_without_process_groups_is_passed_over(monkeypatch):
    """SGLang's runtime context asserts on reading its TP size in a process that set up no process groups (the GPU
    tests' stand-in scheduler); the rank and size then come from the other holders, never an error in run_batch."""
    import sys
    import types

    from refcheck.sglang.capture.versions import tp_of

    class Unset:
        @property
        def tp_size(self):
            raise AssertionError("tensor model parallel group is not initialized")

        tp_rank = tp_size

    from refcheck.sglang.capture import versions

    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context",
                        types.SimpleNamespace(get_parallel=lambda: Unset()))
    versions.runtime_context.cache_clear()
    try:
        assert versions.runtime_context() is sys.modules["sglang.srt.runtime_context"]
        assert tp_of(NS(tp_rank=1, server_args=NS(tp_size=2))) == (1, 2)
        assert tp_of(NS()) == (0, 1)
    finally:
        versions.runtime_context.cache_clear()


def test_the_runtime_context_is_looked_up_once_per_process(monkeypatch):
    """A release without SGLang's runtime context (0.5.17) fails its import; the hooks ask for the TP rank and the
    server's top-k at every recorded batch, so the lookup is made once per process, not once per batch."""
    from refcheck.sglang.capture import versions

    tried = []

    def import_module(name):
        tried.append(name)
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(versions.importlib, "import_module", import_module)
    versions.runtime_context.cache_clear()
    try:
        for _ in range(3):
            assert versions.tp_of(NS(tp_rank=1, server_args=NS(tp_size=2, speculative_eagle_topk=None))) == (1, 2)
            assert versions.server_topk(NS(server_args=NS(speculative_eagle_topk=None))) is None
        assert tried == ["sglang.srt.runtime_context"]
    finally:
        versions.runtime_context.cache_clear()


def test_two_schedulers_claiming_one_rank_are_a_capture_error(capture_dir):
    """Records of two processes under one tensor-parallel rank cannot be combined: read_capture says so."""
    from refcheck.sglang.capture.records import Recorder

    for pid in (111, 222):
        rec = Recorder(capture_dir, 0)
        rec.dir.rename(capture_dir / f"rank0-pid{pid}")
    errors = read_capture(capture_dir).errors
    assert len(errors) == 1 and "pids 111, 222" in errors[0] and "rank 0" in errors[0]


def test_under_overlap_committed_lengths_and_roots_come_from_the_device(capture_dir):
    """The overlap scheduler runs step k+1 before it appends step k's tokens to the requests: their lists lag,
    the forward batch does not. Tree verify takes the batch's seq lens; a target-only decode takes its
    input ids (the roots) and seq lens from the sampler's forward batch; each record says how far the lists lagged."""
    sched, *_ = make_scheduler()
    run_prefill(sched)
    batch = make_batch("decode", True, [[7], [9]])  # the requests still show only their first token
    batch.seq_lens = torch.tensor([6, 3])  # request 0 committed 3 more tokens the scheduler has not processed yet
    tokens, nt, ns = make_tree()
    verify_input = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns, positions=None)

    def worker(self, b):
        hooks._eagle_sample(lambda *a, **k: (torch.zeros(8, dtype=torch.long), torch.tensor([1, 1]),
                                              torch.tensor([[0, -1, -1, -1], [4, -1, -1, -1]])),
                             verify_input, b, NS(next_token_logits=torch.randn(2 * N, V)))
        return NS(logits_output=None, next_token_ids=None)

    hooks._run_batch(worker, sched, batch)
    logits1 = torch.randn(1, V)
    fb = NS(forward_mode=Mode("decode"), input_ids=torch.tensor([42]), seq_lens=torch.tensor([11]),
            sampling_info=NS(is_all_greedy=True))

    def decode(self, b):
        hooks._sample(lambda runner, lo, f: None, None, NS(next_token_logits=logits1), fb)
        return NS(logits_output=NS(next_token_logits=logits1), next_token_ids=logits1.argmax(-1))

    hooks._run_batch(decode, sched, make_batch("decode", False, [[5, 6]]))  # the list says root 6 at position 4
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    s0, s1, root = cap.steps[0]
    assert (s0.committed_len, s1.committed_len) == (6, 3)
    assert s0.meta["committed_from"] == "forward_batch" and s0.meta["committed_lag"] == 3
    assert (root.tokens, root.committed_len, root.meta["committed_lag"]) == ([42], 10, 6)


def test_an_injected_sampler_fault_changes_the_kernel_inputs_not_the_record(capture_dir, monkeypatch):
    """REFCHECK_SAMPLER_FAULT (refcheck's selftest only): the kernel gets the altered coins / probabilities, the
    capture keeps what SGLang made; an unknown name is refused by the runner before any engine starts."""
    from ddtree_reference.sampling import Sampling
    from refcheck.errors import UsageError
    from refcheck.sglang.capture import sampler_faults
    from refcheck.sglang.requests import check_sampling

    coins = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    probs = torch.tensor([[[0.5, 0.3, 0.2]] * 4])
    seen = {}

    def kernel(**kw):
        seen.update(kw)

    hooks._batch = Batch("decode", True, ["r0"], [3], [7], [3], [3], [0], 4)
    try:
        for name in sampler_faults.FAULTS:
            monkeypatch.setenv(sampler_faults.ENV_FAULT, name)
            hooks._verify_coins(kernel, uniform_samples=coins, uniform_samples_for_final_sampling=torch.tensor([0.5]),
                                 target_probs=probs)
            assert torch.equal(hooks._batch.coins[0], coins)  # recorded as SGLang made them
            if name == "coin-shared":
                assert torch.equal(seen["uniform_samples"], torch.full((1, 4), 0.1))
            else:
                want = torch.tensor([0.25, 0.09, 0.04]) / 0.38
                assert torch.allclose(seen["target_probs"][0, 0], want)
            assert torch.equal(coins, torch.tensor([[0.1, 0.2, 0.3, 0.4]]))  # the caller's tensors untouched
    finally:
        hooks._batch = None
    # a positional call is altered the same way (the kernel's parameter order)
    monkeypatch.setenv(sampler_faults.ENV_FAULT, "coin-shared")
    hooks._batch = Batch("decode", True, ["r0"], [3], [7], [3], [3], [0], 4)
    try:
        hooks._verify_coins(kernel, *([None] * 7), coins, torch.tensor([0.5]), probs)
        assert torch.equal(seen["uniform_samples"], torch.full((1, 4), 0.1)) and seen["target_probs"] is probs
    finally:
        hooks._batch = None
    t1 = Sampling(temperature=1.0)
    check_sampling("NGRAM", t1)
    with pytest.raises(UsageError, match="NGRAM at --temperature > 0 only"):
        check_sampling("NONE", t1)
    monkeypatch.setenv(sampler_faults.ENV_FAULT, "no-such")
    with pytest.raises(UsageError, match="not one of"):
        check_sampling("NGRAM", t1)


def test_a_prefill_whose_next_tokens_are_a_host_list_is_recorded(capture_dir):
    """SGLang hands a prefill's next tokens over as a device tensor, a host tensor or a list, depending on the path:
    each reaches the logits' device for the record."""
    sched, *_ = make_scheduler()
    logits = torch.randn(2, V)
    ids = logits.argmax(-1).tolist()
    hooks._run_batch(lambda self, batch: NS(logits_output=NS(next_token_logits=logits), next_token_ids=ids), sched,
                      make_batch("extend", True, [[], []]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [p.token for p in cap.prefills[0]] == ids
    assert cap.prefills[0][1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1).max()), abs=1e-6)


def test_a_prefill_a_tree_verify_and_a_target_only_step_are_recorded_in_order(tmp_path, monkeypatch):
    """tests/capture_kit.py: tree_and_root_batches (run on the GPU by the no-sync test) records the prefill's first
    tokens, the verify step's accepted paths and emitted tokens, and the target-only step's argmax, each request's
    steps numbered in order."""
    cap, logits0, logits, root_logits = tree_and_root_batches(tmp_path, monkeypatch)
    assert not cap.errors, cap.errors
    assert [p.token for p in cap.prefills[0]] == logits0.argmax(-1).tolist()
    r0 = [s for s in cap.steps[0] if s.rid == "r0"]
    r1 = [s for s in cap.steps[0] if s.rid == "r1"]
    assert [s.meta["step_index"] for s in r0] == [s.meta["step_index"] for s in r1] == [0, 1]
    assert (r0[0].accepted, r0[0].emitted, r1[0].accepted, r1[0].emitted) == ([0, 2], [12, 30], [0, 1, 3], [21, 23, 31])
    assert [r0[1].emitted, r1[1].emitted] == [[t] for t in root_logits.argmax(-1).tolist()]  # the target-only step
    assert r0[0].topk_logprobs[0][0] == pytest.approx(float(torch.log_softmax(logits, -1)[0].max()), abs=1e-6)


def test_the_plugin_needs_nothing_in_sglangs_environment_but_torch_and_numpy():
    """A server's environment gets refcheck with ``pip install --no-deps``: loading the plugin and its capture hooks
    (and reading nothing else) imports none of refcheck's other dependencies."""
    import subprocess
    import sys

    code = ("import sys, refcheck.sglang.plugin, refcheck.sglang.capture.hooks; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert {"torch", "numpy", "refcheck"} <= loaded
    assert not loaded & {"pyarrow", "click", "rich", "hypothesis", "transformers", "safetensors", "pytest"}, loaded
