"""The capture's DFLASH taps (refcheck/sglang/capture/dflash_taps.py) through the hooks, with a stand-in DFLASH
worker: the chain step, the drafter's top ranks and context, and the opt-in drafter faults acting on what SGLang
uses while the record keeps it."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from capture_kit import N, V, make_batch, make_scheduler, read_capture  # tests/capture_kit.py

from refcheck.sglang.capture import hooks
from refcheck.sglang.draft_side import context_side


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
    sched, *_ = make_scheduler(topk=1)
    batch = make_batch("decode", True, [[5]])
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
                      sched, make_batch("decode", False, [[5, 6, 19]]))
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
    sched, *_ = make_scheduler(topk=1)
    w = _FakeDFlash(torch.tensor([[5, 6, 7, 8]]))
    hidden0, features0 = w.hidden.clone(), w.features.clone()
    res = NS(logits_output=NS(next_token_logits=torch.randn(N, V)), accept_lens=torch.tensor([2], dtype=torch.int32),
             next_token_ids=torch.tensor([6, 19, 0, 0]), can_run_cuda_graph=False)
    drafted = {}

    def step(self_, bb):
        out = self_.draft_model_runner.forward(None)
        drafted["hidden"] = out.logits_output.hidden_states
        return self_.step(res)

    hooks._run_batch(lambda self, b: hooks._dflash_forward(step, w, b), sched, make_batch("decode", True, [[5]]))
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


def test_draft_logits_are_each_requests_depths_through_the_head():
    """The folded product gives, row for row, request b's depths 1..B-1 through the head (depth 0, the block's
    committed token, left out), in the head's dtype."""
    from refcheck.sglang.capture.dflash_taps import draft_logits
    g = torch.Generator().manual_seed(5)
    bs, block, hidden, vocab = 3, 5, 8, 11
    hs, head = torch.randn(bs * block, hidden, generator=g, dtype=torch.float64), torch.randn(vocab, hidden, generator=g)
    got = draft_logits(hs, head, bs, block)
    assert got.shape == (bs, block - 1, vocab) and got.dtype == head.dtype
    for b in range(bs):
        want = hs[b * block + 1:(b + 1) * block].to(head.dtype) @ head.T
        assert torch.allclose(got[b], want, atol=1e-5)
