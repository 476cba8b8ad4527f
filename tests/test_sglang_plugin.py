"""The capture hooks (refcheck/sglang/capture/hooks.py) driven with stand-ins for SGLang's scheduler, batch and pools.

No SGLang here: the stand-ins carry exactly the attributes the hooks read (the names are SGLang
0.5.17's, see docs/sglang-capture.md). The hooks are called the way HookRegistry's AROUND wrappers
call them, the worker's ``eagle_sample`` / DFLASH call happening inside ``run_batch``; the records
they write are read back and checked against the stand-in pools, slot by slot.
"""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang.capture import hooks, records
from refcheck.sglang.capture.batch import Batch
from refcheck.sglang.capture.committed import bucket, bucketed
from refcheck.sglang.draft_side import context_side


def read_capture(root):
    """The capture directory once the hooks' writer thread has written every queued record."""
    assert hooks.drain(10.0)
    return records.read_capture(root)

V, N, HKV, D, C, KM1, HV, DK, DV = 32, 4, 2, 3, 6, 3, 2, 4, 5


class Mode:
    def __init__(self, name: str) -> None:
        self.name = name

    def is_extend(self) -> bool:
        return self.name == "extend"

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_idle(self) -> bool:
        return False

    def is_target_verify(self) -> bool:
        return False


def _scheduler(topk: int = 4):
    gen = torch.Generator().manual_seed(0)
    kb, vb = torch.randn(64, HKV, D, generator=gen), torch.randn(64, HKV, D, generator=gen)
    kv_pool = NS(full_attention_layer_id_mapping={2: 0}, get_key_buffer=lambda layer: kb, get_value_buffer=lambda layer: vb)
    conv = [torch.randn(1, 5, C, KM1, generator=gen)]  # [n_lin, slots, C, K-1]
    temporal = torch.randn(1, 5, HV, DV, DK, generator=gen)  # [n_lin, slots, HV, V, K]
    req_to_token = torch.arange(3 * 20, dtype=torch.int32).reshape(3, 20).flip(1)  # slots in reverse order
    rtp = NS(req_to_token=req_to_token, mamba_map={0: 0}, req_index_to_mamba_index_mapping=torch.tensor([0, 4, 2]),
             mamba_pool=NS(mamba_cache=NS(conv=conv, temporal=temporal), conv_window_axis=-1))
    runner = NS(token_to_kv_pool=kv_pool, req_to_token_pool=rtp)
    return NS(tp_rank=0, server_args=NS(speculative_eagle_topk=topk), tp_worker=NS(model_runner=runner)), kb, conv, temporal


def _batch(mode: str, spec: bool, outputs: list[list[int]]):
    reqs = [NS(rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=list(o), fill_ids=[1, 2, 3]) for i, o in enumerate(outputs)]
    return NS(forward_mode=Mode(mode), reqs=reqs, spec_algorithm=NS(is_none=lambda: not spec),
              req_pool_indices=torch.tensor([1, 2][: len(reqs)]), is_extend_in_batch=False)


def _prefill(sched) -> torch.Tensor:
    """A prefill of two requests through run_batch; returns its logits [2, V]."""
    logits0 = torch.randn(2, V)
    hooks._run_batch(lambda self, batch: NS(logits_output=NS(next_token_logits=logits0), next_token_ids=logits0.argmax(-1)),
                      sched, _batch("extend", True, [[], []]))
    return logits0


def _tree() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two requests' trees (tokens [bs*N], first-child and next-sibling links [bs, N]): 0 -> {1, 2}, 1 -> 3."""
    return (torch.tensor([7, 11, 12, 13, 9, 21, 22, 23]), torch.tensor([[1, 3, -1, -1]] * 2),
            torch.tensor([[-1, 2, -1, -1]] * 2))


@pytest.fixture
def capture_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCHECK_CAPTURE_DIR", str(tmp_path))
    monkeypatch.setattr(hooks, "_recorder", None)
    monkeypatch.setattr(hooks, "_rule", None)
    monkeypatch.setattr(hooks, "_clock", None)
    return tmp_path


def test_prefill_and_tree_step_are_recorded_with_committed_state(capture_dir):
    sched, kb, conv, temporal = _scheduler()
    logits0 = _prefill(sched)
    # one verify step of two requests: tree 0 -> {1, 2}, 1 -> 3; request 0 accepts [0, 2], request 1 [0, 1, 3]
    batch = _batch("decode", True, [[7], [9]])
    tokens, nt, ns = _tree()
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


def test_keyed_sampler_step_records_draws_uniforms_and_first_uniforms(capture_dir):
    """REFCHECK_DDTREE's keyed sampler returns eagle_sample's three outputs plus every node's draw and
    uniform: the hook records them for the sampled request only; the prefill record takes the keyed first
    draw's uniform from the worker."""
    sched, *_ = _scheduler()
    sched.draft_worker = NS(last_first_uniforms={"r1": 0.25}, last_draft_s=None)
    _prefill(sched)
    batch = _batch("decode", True, [[7], [9]])
    tokens, nt, ns = _tree()
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
    sched, *_ = _scheduler()
    _prefill(sched)
    batch = _batch("decode", True, [[7], [9]])
    tokens, nt, ns = _tree()
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
    sched, *_ = _scheduler()
    raw = torch.randn(2, V) * 3

    def sample(runner, lo, fb):
        lo.next_token_logits[:] = torch.softmax(lo.next_token_logits / 0.7, dim=-1)
        return torch.tensor([3, 4])

    def worker(self, b):
        lo = NS(next_token_logits=raw.clone())
        ids = hooks._sample(sample, None, lo, NS(sampling_info=NS(is_all_greedy=False)))
        return NS(logits_output=lo, next_token_ids=ids)

    hooks._run_batch(worker, sched, _batch("extend", True, [[], []]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    lp = torch.log_softmax(raw, -1)
    assert [p.logprob for p in cap.prefills[0]] == pytest.approx([float(lp[0, 3]), float(lp[1, 4])], abs=1e-5)


class _FakeDFlash:
    """The parts of SGLang's DFlashWorkerV2 the DFLASH taps read: a draft model runner whose forward returns the
    draft block's hidden states, the target's LM head, and the drafter-KV writer the step feeds its context to."""

    H, F = 4, 8

    def __init__(self, cand: torch.Tensor) -> None:
        self._draft_block_tokens_buf = torch.cat([cand, torch.zeros(3, N, dtype=torch.long)])
        self.block_size = N
        self.head = torch.randn(V, self.H)
        self.hidden = torch.randn(N, self.H)  # one request's draft block
        self.draft_model_runner = NS(forward=lambda fb: NS(logits_output=NS(hidden_states=self.hidden.clone()),
                                                           can_run_graph=False), model=NS(num_context_features=2))
        self.target_worker = NS(model_runner=NS(model=NS(lm_head=NS(weight=self.head)), model_config=NS(vocab_size=V)))
        self.features = torch.randn(N, self.F)
        self.fed: dict = {}

    def _append_target_hidden_to_draft_kv_by_loc(self, **kw) -> None:
        self.fed.update(kw)

    def step(self, result):
        """A decode step as DFLASH runs it: draft, (verify), feed the committed rows to the drafter's KV."""
        self.draft_model_runner.forward(None)
        self._append_target_hidden_to_draft_kv_by_loc(target_hidden=self.features, cache_loc=torch.arange(N),
                                                      positions=torch.arange(5, 5 + N), commit_lens=torch.tensor([2]))
        return result


def test_dflash_chain_step_and_target_only_step(capture_dir):
    sched, *_ = _scheduler(topk=1)
    batch = _batch("decode", True, [[5]])
    cand = torch.tensor([[5, 6, 7, 8]])
    logits = torch.randn(N, V)
    w = _FakeDFlash(cand)

    def worker(self, b):
        res = NS(logits_output=NS(next_token_logits=logits), accept_lens=torch.tensor([2], dtype=torch.int32),
                 next_token_ids=torch.tensor([6, 19, 0, 0]), can_run_cuda_graph=True)  # the verify replayed a graph
        return hooks._dflash_forward(lambda self_, bb: self_.step(res), w, b)

    hooks._run_batch(worker, sched, batch)
    logits1 = torch.randn(1, V)
    hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits1), next_token_ids=logits1.argmax(-1)),
                      sched, _batch("decode", False, [[5, 6, 19]]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    chain, root = cap.steps[0]
    assert chain.tokens == [5, 6, 7, 8] and chain.accepted == [0, 1] and chain.emitted == [6, 19] and chain.layout == "chain"
    assert root.tokens == [19] and root.committed_len == 5 and root.emitted == [int(logits1.argmax())]
    assert root.state["kv_k.2"][2].shape[0] == 1
    assert chain.meta["cuda_graph"] is True and root.meta["cuda_graph"] is False  # a result without the field: eager
    # the drafter's side: its top-k per depth from the draft hidden states through the target's head, the context fed
    want = torch.log_softmax(w.hidden[1:] @ w.head.T, dim=-1)  # [N-1, V]
    assert len(chain.draft_ids) == N - 1 and len(chain.draft_ids[0]) == 8
    assert [r[0] for r in chain.draft_ids] == want.argmax(-1).tolist()
    assert torch.allclose(torch.tensor([r[0] for r in chain.draft_logprobs]), want.max(-1).values, atol=1e-5)
    assert chain.context_positions == [5, 6] and tuple(chain.context_sketch.shape) == (2, 16)
    assert "forward" in vars(w.draft_model_runner) and "_append_target_hidden_to_draft_kv_by_loc" not in vars(w)


@pytest.mark.parametrize("fault", ["context-positions-shifted", "context-skip-last", "context-layers-swapped",
                                   "draft-depth-shift"])
def test_dflash_drafter_faults_act_and_the_capture_keeps_what_sglang_used(capture_dir, monkeypatch, fault):
    from refcheck.sglang.capture import dflash_taps

    monkeypatch.setenv(dflash_taps.ENV_FAULT, fault)
    sched, *_ = _scheduler(topk=1)
    w = _FakeDFlash(torch.tensor([[5, 6, 7, 8]]))
    hidden0, features0 = w.hidden.clone(), w.features.clone()
    res = NS(logits_output=NS(next_token_logits=torch.randn(N, V)), accept_lens=torch.tensor([2], dtype=torch.int32),
             next_token_ids=torch.tensor([6, 19, 0, 0]), can_run_cuda_graph=False)
    drafted = {}

    def step(self_, bb):
        out = self_.draft_model_runner.forward(None)
        drafted["hidden"] = out.logits_output.hidden_states
        return self_.step(res)

    hooks._run_batch(lambda self, b: hooks._dflash_forward(step, w, b), sched, _batch("decode", True, [[5]]))
    (chain,) = read_capture(capture_dir).steps[0]
    fed = w.fed
    if fault == "context-positions-shifted":
        assert fed["positions"].tolist()[:2] == [6, 7] and chain.context_positions == [6, 7]
    elif fault == "context-skip-last":
        assert fed["commit_lens"].tolist() == [1] and chain.context_positions == [5]
    elif fault == "context-layers-swapped":
        h = _FakeDFlash.F // 2
        assert torch.equal(fed["target_hidden"][:, :h], features0[:, h:])
        assert not torch.allclose(chain.context_sketch, context_side(features0[:2], torch.arange(2))["sketch"])
    else:  # depth d drafts from depth d - 1's hidden state; the record holds the drafter's own output
        assert torch.equal(drafted["hidden"][2:], hidden0[1:-1])
        assert [r[0] for r in chain.draft_ids] == (hidden0[1:] @ w.head.T).argmax(-1).tolist()


def test_hook_failures_are_recorded_not_raised(capture_dir):
    sched, *_ = _scheduler()
    sched.tp_worker = None  # the state lookup will fail
    logits1 = torch.randn(1, V)
    res = hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits1), next_token_ids=logits1.argmax(-1)),
                            sched, _batch("decode", False, [[5]]))
    assert res.next_token_ids is not None  # SGLang's result is returned untouched
    cap = read_capture(capture_dir)
    assert any("run_batch:after" in e for e in cap.errors)
    # a speculative batch whose verify was never seen is an error too
    hooks._run_batch(lambda self, b: NS(logits_output=None, next_token_ids=None), _scheduler()[0], _batch("decode", True, [[5]]))
    assert any("no verify step was captured" in e for e in read_capture(capture_dir).errors)


def test_untraced_timing_requests_pass_straight_through(capture_dir):
    """Requests under UNTRACED_RID_PREFIX (a sweep's warm timing repeats) are neither synchronised nor
    recorded: SGLang's result comes back untouched and the capture directory holds nothing for them."""
    from refcheck.sglang.env import UNTRACED_RID_PREFIX

    sched, *_ = _scheduler()
    batch = _batch("decode", True, [[5], [6]])
    for r in batch.reqs:
        r.rid = UNTRACED_RID_PREFIX + r.rid
    sentinel = NS(logits_output=None, next_token_ids=None)
    assert hooks._run_batch(lambda self, b: sentinel, sched, batch) is sentinel
    cap = read_capture(capture_dir)
    assert not cap.steps and not cap.errors and not cap.status  # a traced batch of this kind is an error (above)
    batch.reqs[0].rid = "r0"  # one traced request in the batch: the whole batch is captured
    hooks._run_batch(lambda self, b: sentinel, sched, batch)
    assert any("no verify step was captured" in e for e in read_capture(capture_dir).errors)


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

    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context",
                        types.SimpleNamespace(get_parallel=lambda: Unset()))
    assert tp_of(NS(tp_rank=1, server_args=NS(tp_size=2))) == (1, 2)
    assert tp_of(NS()) == (0, 1)


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
    sched, *_ = _scheduler()
    _prefill(sched)
    batch = _batch("decode", True, [[7], [9]])  # the requests still show only their first token
    batch.seq_lens = torch.tensor([6, 3])  # request 0 committed 3 more tokens the scheduler has not processed yet
    tokens, nt, ns = _tree()
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

    hooks._run_batch(decode, sched, _batch("decode", False, [[5, 6]]))  # the list says root 6 at position 4
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


def test_a_sampled_capture_records_the_steps_its_rule_takes_and_leaves_other_batches_alone(capture_dir, monkeypatch):
    """REFCHECK_CAPTURE_SAMPLE=2:3: one decode batch in two is recorded, all its requests (their step numbers
    kept); a batch not taken runs its hooks straight through (no records, no device work)."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    monkeypatch.setenv("REFCHECK_CAPTURE_SAMPLE", "2:3")
    rule = SampleRule(2, 3)
    sched, *_ = _scheduler()
    _prefill(sched)
    tokens, nt, ns = _tree()
    out = (torch.tensor([12, 0, 30, 0, 21, 23, 0, 31]), torch.tensor([2, 3]), torch.tensor([[0, 2, -1, -1], [4, 5, 7, -1]]))
    calls = []

    def worker(self, b):
        vi = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns, positions=None)
        hooks._eagle_sample(lambda *a: calls.append(hooks._batch is not None) or out, vi, b,
                             NS(next_token_logits=torch.randn(2 * N, V)), None)
        return NS(logits_output=None, next_token_ids=None)

    for k in range(4):
        hooks._run_batch(worker, sched, _batch("decode", True, [[7] * (k + 1), [9] * (k + 1)]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    taken = [k for k in range(4) if rule.takes(k)]
    assert len(taken) == 2 and taken[1] == taken[0] + 2
    want = [(rid, k) for k in taken for rid in ("r0", "r1")]
    assert [(s.rid, s.meta["step_index"]) for s in cap.steps[0]] == want
    assert calls == [k in taken for k in range(4)]
    r1 = [s for s in cap.steps[0] if s.rid == "r1"]
    assert all(s.accepted == [0, 1, 3] for s in r1)  # accept_index's flat rows counted in SGLang's whole batch


def test_a_prefill_whose_next_tokens_are_a_host_list_is_recorded(capture_dir):
    """SGLang hands a prefill's next tokens over as a device tensor, a host tensor or a list, depending on the path:
    each reaches the logits' device for the record."""
    sched, *_ = _scheduler()
    logits = torch.randn(2, V)
    ids = logits.argmax(-1).tolist()
    hooks._run_batch(lambda self, batch: NS(logits_output=NS(next_token_logits=logits), next_token_ids=ids), sched,
                      _batch("extend", True, [[], []]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [p.token for p in cap.prefills[0]] == ids
    assert cap.prefills[0][1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1).max()), abs=1e-6)


def test_a_batch_the_sampling_rule_passes_over_reads_nothing_but_its_rids_and_is_booked_plain(capture_dir, monkeypatch):
    """Under 1 batch in 2, a target-only decode batch that is not taken runs as SGLang has it: its requests'
    token lists and pool rows are never read (the stand-in raises if they are), and its wall time goes to the
    ledger's plain side; a taken batch is recorded and booked with its hooks' share."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    monkeypatch.setattr(hooks, "_rule", SampleRule(2, seed=0))
    sched, *_ = _scheduler()
    _prefill(sched)  # the recorder exists from here on

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"a batch the rule passes over read {name}")

    def step(self, b):
        logits = torch.randn(2, V)
        return NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1))

    for g in range(4):
        batch = _batch("decode", False, [[5], [6]])
        if not SampleRule(2, seed=0).takes(g):
            batch.req_pool_indices = Untouchable()
            batch.reqs = [NS(rid=r.rid) for r in batch.reqs]  # no token lists
        hooks._run_batch(step, sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert sorted({s.meta["step_index"] for ss in cap.steps.values() for s in ss}) == [k for k in range(4)
                                                                                   if SampleRule(2, 0).takes(k)]
    cost = cap.cost
    assert cost["plain_batches"] == 2 and cost["recorded_batches"] == 2, cost
    assert 0 < cost["hooks_ms_per_batch"] <= cost["recorded_ms_per_batch"] and cost["plain_ms_per_batch"] > 0
    parts = cost["parts_ms_per_batch"]
    assert parts["state"] > 0 and parts["ship"] > 0 and parts["snapshot"] > 0 and not parts["taps"], parts
    assert sum(parts.values()) <= cost["hooks_ms_per_batch"] + 1e-3


def test_a_state_graph_serves_every_batch_size_up_to_its_bucket():
    """The state sketch of b requests comes from the graph of the next power of two (refcheck/sglang/capture/
    committed.py: bucket), the first request repeated to fill it: each request's sketches are those of the sketch of
    the b requests alone (off CUDA the graph cache runs the padded computation as it is)."""
    from refcheck.sglang.capture.graphs import GraphCache
    from refcheck.sglang.capture.state import MambaPools, batch_state

    assert [bucket(b) for b in (1, 2, 3, 4, 5, 17, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]
    sched, kb, conv, temporal = _scheduler()
    kv = {2: (kb, kb.flip(0))}
    mamba = MambaPools([0], [0], conv[0], temporal)
    table = sched.tp_worker.model_runner.req_to_token_pool.req_to_token
    to_mamba = torch.tensor([0, 4, 2])

    def sketch(rows, lens):
        slots = table[rows[:, None], lens[:, None] + torch.arange(3)]  # [b, 3]
        return batch_state(kv, slots, mamba, to_mamba[rows])

    cache = GraphCache()
    for rows in ([2, 0, 1], [1], [0, 2], [2, 1, 0, 1, 2]):
        r, lens = torch.tensor(rows), torch.tensor([4, 7, 1, 3, 9][: len(rows)])
        got, want = bucketed(cache, ("k",), sketch, r, lens), sketch(r, lens)
        for name, entry in want["kv"].items():
            assert got["kv"][name][2].shape == entry[2].shape and torch.allclose(got["kv"][name][2], entry[2], atol=1e-6)
        for kind in ("conv", "rec"):
            assert got["mamba"][kind].shape == want["mamba"][kind].shape
            assert torch.allclose(got["mamba"][kind], want["mamba"][kind], atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(every=st.integers(1, 9), seed=st.integers(0, 50), marked=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 9)),
                                                                         max_size=3),
       batches=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True), min_size=1, max_size=25))
def test_the_step_clock_takes_the_decode_batches_and_step_numbers_each_request_rule_takes(every, seed, marked, batches):
    """refcheck/sglang/capture/step_clock.py (a decode batch's requests to record) against SampleRule.takes: request i
    of a batch is taken when its rule (its rid's mark, else the process's) takes the process's g-th decode batch, and
    carries its own step number (its decode batches so far), whichever requests share the batch."""
    from refcheck.sglang.capture.sample_rule import SampleRule, rule_for, sampled_rid
    from refcheck.sglang.capture.step_clock import StepClock

    process = SampleRule(every, seed)
    rids = [sampled_rid(SampleRule(e, s), f"r{i}") for i, (e, s) in enumerate(marked)]
    rids += [f"plain{i}" for i in range(6 - len(rids))]
    reqs = [NS(rid=r) for r in rids]
    clock, steps = StepClock(process), {}
    for g, members in enumerate(batches):
        batch = [rids[m] for m in members]
        take, numbers = clock.take(batch, [reqs[m] for m in members])
        want = [(b, steps.get(r, 0)) for b, r in enumerate(batch) if rule_for(r, process).takes(g)]
        assert list(zip(take, numbers)) == want
        for r in batch:
            steps[r] = steps.get(r, 0) + 1


def test_the_hooks_record_the_same_through_caches_that_replay_like_cuda_graphs(tmp_path, monkeypatch):
    """The capture hooks' three graph caches (state sketch, verify reductions, DFLASH taps) swapped for
    tests/capture_kit.py's ReplayingCache, which keeps a CUDA graph's semantics on the CPU (the first call's
    closure replayed, outputs written in place, other keys' outputs scribbled over): four DFLASH batches, two of
    them replays of the first two's graphs, record what the eager hooks record. The GPU run of the same batches
    through real CUDA graphs: tests/test_gpu.py."""
    from capture_kit import ReplayingCache, assert_same_records, dflash_batches

    caches = {"_STATE_GRAPHS": ReplayingCache(), "_VERIFY_GRAPHS": ReplayingCache(),
              "_TAP_GRAPHS": (ReplayingCache(), ReplayingCache())}
    for name, cache in caches.items():
        monkeypatch.setattr(hooks, name, cache)
    on = dflash_batches(tmp_path / "on", monkeypatch, graphs=True, dev="cpu")
    assert len(caches["_STATE_GRAPHS"]) == 2 and len(caches["_TAP_GRAPHS"][1]) == 2  # batch sizes 3 and 2
    monkeypatch.undo()
    off = dflash_batches(tmp_path / "off", monkeypatch, graphs=False, dev="cpu")
    assert_same_records(on, off)


def test_a_replaying_cache_catches_a_stale_closure_and_outputs_kept_past_another_replay():
    """tests/capture_kit.py's ReplayingCache fails the two mistakes a CUDA graph punishes: a value handed through
    the closure instead of the inputs (the first call's is replayed) and a graph's outputs read after another
    graph of the same cache replayed."""
    from capture_kit import ReplayingCache

    cache = ReplayingCache()
    x = torch.arange(3.0)
    assert cache.run("k", lambda t, s=2.0: t * s, x).tolist() == [0.0, 2.0, 4.0]
    assert cache.run("k", lambda t, s=5.0: t * s, x).tolist() == [0.0, 2.0, 4.0]  # the first closure, not s=5
    kept = cache.run("k", lambda t: t * 2, x)
    cache.run("other", lambda t: t + 1, x)
    assert torch.isnan(kept).all()


def test_the_step_counts_of_requests_sglang_let_go_of_are_swept():
    """StepClock's sweep, every sweep_every decode batches: a request object no batch can hold again (gone) loses
    its step count; one still alive (waiting, retracted) keeps counting; one that takes no weak reference is kept."""
    import gc

    from refcheck.sglang.capture.sample_rule import SampleRule
    from refcheck.sglang.capture.step_clock import StepClock

    class Req:  # as SGLang's: takes weak references
        def __init__(self, rid):
            self.rid = rid

    class Slotted:
        __slots__ = ("rid",)

        def __init__(self, rid):
            self.rid = rid

    clock = StepClock(SampleRule(), sweep_every=4)
    live, gone, slotted = Req("live"), Req("gone"), Slotted("slotted")

    def decode(*reqs):
        take, steps = clock.take([r.rid for r in reqs], list(reqs))
        return {reqs[b].rid: k for b, k in zip(take, steps)}

    first = decode(live, gone, slotted)
    assert first == {"live": 0, "gone": 0, "slotted": 0}  # every step taken (full capture)
    del gone
    gc.collect()
    assert len(clock) == 3 and "gone" in clock  # not swept before its batch
    for _ in range(3):
        decode(slotted)
    assert len(clock) == 2 and "gone" not in clock
    assert decode(live, slotted) == {"live": 1, "slotted": 4}


def test_prefills_are_booked_recorded_and_plain(capture_dir):
    """The ledger's prefill side: a traced prefill (always recorded) books its wall time and the hooks' share; an
    untraced prefill after it books its wall time as plain; decode batches stay on their own side."""
    from refcheck.sglang.capture.shipper import ledger_summary, read_ledgers
    from refcheck.sglang.env import UNTRACED_RID_PREFIX

    sched, *_ = _scheduler()
    _prefill(sched)
    untraced = _batch("extend", True, [[], []])
    for r in untraced.reqs:
        r.rid = UNTRACED_RID_PREFIX + r.rid
    logits = torch.randn(2, V)
    hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1)),
                     sched, untraced)
    ledger = read_ledgers(capture_dir)
    cost = ledger_summary(ledger, ledger["written"])
    assert (ledger["prefills"], ledger["plain_prefills"], ledger["recorded_batches"], ledger["plain_batches"]) == (1, 1, 0, 0)
    assert 0 < cost["prefill_hooks_ms_per_batch"] <= cost["prefill_ms_per_batch"] and cost["plain_prefill_ms_per_batch"] > 0
    assert read_capture(capture_dir).prefills[0] and len(read_capture(capture_dir).prefills[0]) == 2  # one record only
