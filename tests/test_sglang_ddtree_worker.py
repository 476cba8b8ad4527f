"""REFCHECK_DDTREE's worker (refcheck/sglang/ddtree/worker.py) driven on the CPU against stand-ins for
the SGLang modules it imports, backed by the reference.

The stand-ins reproduce what the worker relies on in SGLang 0.5.17: NGRAM's preparation (drafts +
ancestor masks -> links and positions, parent = largest-index ancestor), a target worker whose
verify returns every node's logits and captured hidden states (here: the reference's exact tree
forward per request), ``eagle_sample``'s greedy walk and accept outputs, and the mamba/KV commit
(here: the reference state's commit). A small scheduler loop runs prefill then decode steps for
several requests in one batch. The worker's own logic (drafting per request, hidden-state rows of
the accepted nodes, positions, per-request drafter contexts, the result layout) must then give
exactly the reference decoder's tokens and per-step acceptance.
"""

from __future__ import annotations

import enum
import importlib
import sys
from types import ModuleType
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from ddtree_reference.sampling import Sampling, request_key
from ddtree_reference.tree import Tree
from refcheck.models import builtin_pair
from refcheck.prompts import load_prompts
from refcheck.selftest.faults import SequentialPositions, StateFromFlatIndex, _commit
from refcheck.selftest.onset import fault_onset
from refcheck.sglang.ddtree.algorithm import faulty_worker


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    FULL = 1


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


class NgramVerifyInput:
    def __init__(self, draft_token=None, custom_mask=None, positions=None, retrieve_index=None,
                 retrieve_next_token=None, retrieve_next_sibling=None, draft_token_num=None, new_seq_lens=None,
                 accept_tokens=None, accept_lens=None, parents=None):
        self.__dict__.update(locals())
        del self.__dict__["self"]


class BaseSpecWorker:
    def __init__(self) -> None:
        pass

    @property
    def target_worker(self):
        return self._target_worker


def _links(parents: list[int]) -> tuple[list[int], list[int]]:
    from refcheck.sglang.layout import links_from_parents

    return links_from_parents(parents)


class NGRAMWorker(BaseSpecWorker):
    """The parts of SGLang's NGRAM worker the DDTree worker inherits."""

    def alloc_memory_pool(self, **kwargs) -> None:
        self.req_to_token_pool, self.token_to_kv_pool_allocator = None, None

    def _prepare_for_speculative_decoding(self, batch) -> None:
        if not batch.forward_mode.is_decode():
            return
        bs, n = len(batch.reqs), self.draft_token_num
        drafts, mask = self._prepare_draft_tokens(batch)
        # SGLang's decode CUDA graph replays a verify only with exactly bs x (its captured width) tokens, the
        # width being speculative_num_draft_tokens (decode_cuda_graph_runner.py:268, :587): no tree is padded
        width = self.server_args.speculative_num_draft_tokens
        assert drafts.shape == (bs * width,) and mask.shape == (bs * width * width,)
        mask = mask.reshape(bs, n, n)
        parents = [[max((k for k in np.nonzero(mask[b, i])[0].tolist() if k != i), default=-1) for i in range(n)]
                   for b in range(bs)]
        links = [_links(p) for p in parents]
        depth = [[0] * n for _ in range(bs)]
        for b in range(bs):
            for i in range(1, n):
                depth[b][i] = depth[b][parents[b][i]] + 1
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = torch.from_numpy(drafts)
        batch.spec_info = NgramVerifyInput(
            draft_token=torch.from_numpy(drafts), custom_mask=torch.from_numpy(mask.reshape(-1)),
            positions=torch.tensor([int(batch.seq_lens[b]) + d for b in range(bs) for d in depth[b]]),
            retrieve_next_token=torch.tensor([lk[0] for lk in links]), retrieve_next_sibling=torch.tensor([lk[1] for lk in links]),
            draft_token_num=n, parents=parents)


def eagle_sample(verify_input, batch, logits_output, grammar_mask=None):
    n, bs = verify_input.draft_token_num, len(batch.reqs)
    argmax = logits_output.next_token_logits.argmax(-1)  # [bs*N]
    predict = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    lens = []
    for b in range(bs):
        toks = verify_input.draft_token[b * n:(b + 1) * n]
        parents = torch.tensor(verify_input.parents[b])
        depths = verify_input.positions[b * n:(b + 1) * n] - verify_input.positions[b * n]
        tree = Tree(toks, parents, depths, torch.zeros(n, dtype=torch.long), torch.zeros(n))
        acc = tree.walk_greedy(argmax[b * n:(b + 1) * n])
        for j in acc:
            predict[b * n + j] = int(argmax[b * n + j])
        accept_index[b, : len(acc)] = torch.tensor([b * n + j for j in acc], dtype=torch.int32)
        lens.append(len(acc))
    return predict, torch.tensor(lens, dtype=torch.int32), accept_index


class Engine:
    """The target side: per-request reference states, SGLang-shaped outputs."""

    def __init__(self, target, capture) -> None:
        self.target, self.capture = target, tuple(capture)
        self.states: dict[str, object] = {}
        self.fwds: dict[str, object] = {}
        self.mamba: dict[str, int] = {}  # request -> the node whose state the mamba commit chose
        model = NS(model=NS(embed_tokens=target.body.embed_tokens), lm_head=target.model.lm_head,
                   set_dflash_layers_to_capture=lambda ids: setattr(self, "captured_ids", list(ids)))
        self.model_runner = NS(model=model, model_config=NS(vocab_size=target.vocab_size,
                                                            num_hidden_layers=len(target.layers)), sample=self.sample)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers whose hidden states the model returns: what the worker asked for (SGLang's
        set_dflash_layers_to_capture), else the drafter's own."""
        return tuple(getattr(self, "captured_ids", None) or self.capture)

    @staticmethod
    def sample(logits_output, batch):
        """SGLang's sampler at a sampling batch: its own draw, and the logits overwritten in place with
        softmax(logits / T) (sglang/srt/layers/sampler.py), which the worker must not read as logits."""
        logits = logits_output.next_token_logits
        if all(float(r.sampling_params.temperature) < 1e-6 or r.sampling_params.top_k == 1 for r in batch.reqs):
            return logits.argmax(-1)
        t = torch.tensor([[float(r.sampling_params.temperature)] for r in batch.reqs])
        logits[:] = torch.softmax(logits / t, dim=-1)
        return torch.multinomial(logits, 1, generator=torch.Generator().manual_seed(0)).flatten()

    def forward_batch_generation(self, batch, is_verify=False, capture_hidden_mode=None):
        assert capture_hidden_mode == CaptureHiddenMode.FULL  # the drafter needs the hidden states
        if not is_verify:  # prefill
            logits, hidden = [], []
            for r in batch.reqs:
                st, fwd = self.target.prefill(torch.tensor(r.origin_input_ids), capture=self.layers)
                self.states[r.rid] = st
                logits.append(fwd.logits[-1:])
                hidden.append(fwd.context)
            out = NS(next_token_logits=torch.cat(logits), hidden_states=torch.cat(hidden))
            return NS(logits_output=out, next_token_ids=self.model_runner.sample(out, batch), can_run_cuda_graph=False)
        vi, n = batch.spec_info, batch.spec_info.draft_token_num
        logits, hidden = [], []
        for b, r in enumerate(batch.reqs):
            toks = vi.draft_token[b * n:(b + 1) * n]
            depths = vi.positions[b * n:(b + 1) * n] - vi.positions[b * n]
            fwd = self.target.forward(self.states[r.rid], toks, torch.tensor(vi.parents[b]), depths, capture=self.layers)
            self.fwds[r.rid] = fwd
            logits.append(fwd.logits)
            hidden.append(fwd.context)
        return NS(logits_output=NS(next_token_logits=torch.cat(logits), hidden_states=torch.cat(hidden)),
                  can_run_cuda_graph=False)

    def commit_mamba(self, batch, accept_lens, accept_index, n) -> None:
        """SGLang's mamba commit: the conv/recurrent state of entry accept_lens-1 of the accept index."""
        for b, r in enumerate(batch.reqs):
            self.mamba[r.rid] = int(accept_index[b, int(accept_lens[b]) - 1]) - b * n

    def move_kv(self, batch, accept_index, num_correct) -> None:
        """SGLang's KV move: the rows of the accept index's first num_correct+1 entries, in order."""
        n = batch.spec_info.draft_token_num
        for b, r in enumerate(batch.reqs):
            fwd = self.fwds[r.rid]
            kv_rows = [int(i) - b * n for i in accept_index[b, : int(num_correct[b]) + 1]]
            new = self.states[r.rid].commit(fwd, kv_rows)
            last = self.mamba.pop(r.rid)
            for layer in fwd.conv:
                new.conv[layer], new.recurrent[layer] = fwd.conv[layer][last].clone(), fwd.recurrent[layer][last].clone()
            self.states[r.rid] = new


@pytest.fixture
def worker_module(monkeypatch):
    engine_box: dict = {}
    mods = {name: ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.model_executor", "sglang.srt.model_executor.forward_batch_info",
        "sglang.srt.speculative", "sglang.srt.speculative.eagle_utils", "sglang.srt.speculative.ngram_worker",
        "sglang.srt.speculative.base_spec_worker", "sglang.srt.speculative.ngram_info")}
    mods["sglang.srt.model_executor.forward_batch_info"].__dict__.update(CaptureHiddenMode=CaptureHiddenMode,
                                                                          ForwardMode=ForwardMode)
    mods["sglang.srt.speculative.eagle_utils"].eagle_sample = eagle_sample
    ng = mods["sglang.srt.speculative.ngram_worker"]
    ng.__dict__.update(
        NGRAMWorker=NGRAMWorker, GenerationBatchResult=lambda **kw: NS(**kw),
        record_stream_for_v2_verify=lambda *a: None,
        commit_mamba_states_after_verify=lambda tw, batch, lens, idx, n: engine_box["engine"].commit_mamba(batch, lens, idx, n),
        move_accept_tokens_to_target_kvcache=lambda batch, idx, num_correct, alloc: engine_box["engine"].move_kv(
            batch, idx, num_correct))
    mods["sglang.srt.speculative.base_spec_worker"].BaseSpecWorker = BaseSpecWorker
    mods["sglang.srt.speculative.ngram_info"].NgramVerifyInput = NgramVerifyInput
    mods["sglang.srt.speculative"].eagle_utils = mods["sglang.srt.speculative.eagle_utils"]
    mods["sglang.srt.speculative"].ngram_worker = ng
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "refcheck.sglang.ddtree.worker", raising=False)
    module = importlib.import_module("refcheck.sglang.ddtree.worker")
    yield module, engine_box
    sys.modules.pop("refcheck.sglang.ddtree.worker", None)


def _params(max_new: int, sampling: Sampling | None, prompt_id: str) -> NS:
    """A request's SGLang sampling params: greedy as SGLang normalises it, or refcheck's keys (what the runner sends)."""
    if sampling is None:
        return NS(temperature=1.0, top_k=1, max_new_tokens=max_new)
    return NS(temperature=sampling.temperature, top_k=sampling.top_k or -1, top_p=sampling.top_p, max_new_tokens=max_new,
              custom_params={"refcheck_seed": sampling.seed, "refcheck_request": request_key(prompt_id)})


def _run(module, engine_box, target, prompts, budget: int, max_new: int, fault: str | None = None,
         sampling: Sampling | None = None):
    from ddtree_reference.drafter import DFlashDrafter

    _, ddir = builtin_pair("hybrid")
    capture = DFlashDrafter.load(ddir, target).target_layer_ids
    engine = Engine(target, capture)
    engine_box["engine"] = engine
    args = NS(disable_overlap_schedule=True, page_size=1, speculative_num_draft_tokens=budget + 1,
              speculative_eagle_topk=2, speculative_num_steps=budget, device="cpu", tp_size=1,
              speculative_draft_model_path=str(ddir), return_hidden_states_mode="full")
    cls = module.DDTreeWorker if fault is None else faulty_worker(module.DDTreeWorker, fault)
    worker = cls(server_args=args, gpu_id=0, ps=NS(tp_rank=0), nccl_port=0, target_worker=engine)
    worker.alloc_memory_pool()
    assert engine.captured_ids == [i + (fault == "draft-wrong-layers") for i in capture]
    reqs = [NS(rid=f"r{i}", origin_input_ids=list(p.prompt_ids), output_ids=[],
               sampling_params=_params(max_new, sampling, p.id)) for i, p in enumerate(prompts)]
    batch = NS(reqs=reqs, forward_mode=ForwardMode.EXTEND, extend_lens=[len(r.origin_input_ids) for r in reqs],
               prefix_lens=[0] * len(reqs), seq_lens=torch.tensor([len(r.origin_input_ids) for r in reqs]))
    res = worker.forward_batch_generation(batch)
    assert worker.last_draft_s is None  # a prefill drafts nothing
    for b, r in enumerate(reqs):
        r.output_ids.append(int(res.next_token_ids[b]))
    taus: dict[str, list[int]] = {r.rid: [] for r in reqs}
    n = budget + 1
    while any(len(r.output_ids) < max_new for r in reqs):
        live = [r for r in reqs if len(r.output_ids) < max_new]
        batch = NS(reqs=live, forward_mode=ForwardMode.DECODE,
                   seq_lens=torch.tensor([len(r.origin_input_ids) + len(r.output_ids) - 1 for r in live]))
        res = worker.forward_batch_generation(batch)
        assert res.speculative_num_draft_tokens == n and res.next_token_ids.shape[0] == len(live) * n
        assert isinstance(worker.last_draft_s, float) and worker.last_draft_s > 0  # the capture's "draft" phase
        for b, r in enumerate(live):
            k = int(res.accept_lens[b])
            r.output_ids += [int(t) for t in res.next_token_ids[b * n: b * n + k]]
            taus[r.rid].append(k)
    return {r.rid: r.output_ids[:max_new] for r in reqs}, taus, worker


@pytest.mark.parametrize("budget", [15, 32])
def test_worker_decodes_exactly_like_the_reference_decoder(worker_module, hybrid, budget):
    module, box = worker_module
    target, drafter = hybrid
    prompts = load_prompts()[:3]
    outputs, taus, worker = _run(module, box, target, prompts, budget, 24)
    for i, p in enumerate(prompts):
        ref = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=24)).generate(list(p.prompt_ids))
        assert outputs[f"r{i}"] == ref.output_ids
        assert taus[f"r{i}"] == [s.accept_length for s in ref.steps]
    # requests that finished left the decode batch: their drafter contexts are gone
    assert set(worker.pool.contexts) <= {f"r{i}" for i in range(3)}


@pytest.mark.parametrize(("budget", "sampling"), [
    (15, Sampling(1.0, seed=7)), (15, Sampling(0.7, top_k=5, top_p=0.9, seed=3)), (32, Sampling(1.3, top_p=0.95, seed=11))])
def test_sampled_worker_draws_exactly_what_the_reference_decoder_draws(worker_module, hybrid, budget, sampling):
    """At T > 0 the worker's keyed sampler (refcheck/sglang/ddtree/sampling.py) gives the reference decoder's
    sampled run token for token: the first token, every tree (built from the draft at the temperature),
    every accepted path and bonus; the capture's draws and uniforms are the reference's."""
    module, box = worker_module
    target, drafter = hybrid
    prompts = load_prompts()[:3]
    spy: list[tuple] = []
    real = module.sampling.keyed_sample

    def keyed_sample(*args):
        out = real(*args)
        spy.append((list(args[1].reqs), out))
        return out

    box_sampling = module.sampling
    box_sampling.keyed_sample = keyed_sample
    try:
        outputs, taus, worker = _run(module, box, target, prompts, budget, 20, sampling=sampling)
    finally:
        box_sampling.keyed_sample = real
    n = budget + 1
    for i, p in enumerate(prompts):
        cfg = DecodeConfig(budget=budget, max_new_tokens=20, sampling=sampling)
        ref = DDTreeDecoder(target, drafter, cfg).generate(list(p.prompt_ids), request=request_key(p.id))
        assert outputs[f"r{i}"] == ref.output_ids
        assert taus[f"r{i}"] == [s.accept_length for s in ref.steps]
        mine = [(reqs.index(r), out) for reqs, out in spy for r in reqs if r.rid == f"r{i}"]
        assert len(mine) == len(ref.steps)
        for (b, (_, _, _, draws, uniforms)), st in zip(mine, ref.steps):
            assert draws[b * n: b * n + st.tree.num_nodes].tolist() == st.draws.tolist()
            assert uniforms[b * n: b * n + st.tree.num_nodes].tolist() == st.uniforms.tolist()
    assert any(t > 1 for ts in taus.values() for t in ts), "nothing was accepted: the test shows nothing"


def test_sampled_run_differs_from_greedy_and_with_the_seed(worker_module, hybrid):
    module, box = worker_module
    target, _ = hybrid
    prompts = load_prompts()[:2]
    greedy, _, _ = _run(module, box, target, prompts, 15, 20)
    a, _, _ = _run(module, box, target, prompts, 15, 20, sampling=Sampling(1.0, seed=1))
    b, _, _ = _run(module, box, target, prompts, 15, 20, sampling=Sampling(1.0, seed=2))
    assert a != greedy and a != b


def test_first_token_uniforms_are_kept_for_the_capture(worker_module, hybrid):
    module, box = worker_module
    target, _ = hybrid
    prompts = load_prompts()[:2]
    s = Sampling(1.0, seed=5)
    _, _, worker = _run(module, box, target, prompts, 15, 1, sampling=s)
    from ddtree_reference.sampling import node_uniforms

    want = {f"r{i}": float(node_uniforms(s, request_key(p.id), -1, [len(p.prompt_ids)])[0]) for i, p in enumerate(prompts)}
    assert worker.last_first_uniforms == want


@pytest.mark.parametrize("extra", [{"frequency_penalty": 0.5}, {"repetition_penalty": 1.1}, {"min_p": 0.05},
                                   {"logit_bias": {"3": 1.0}}])
def test_worker_refuses_sampling_features_it_does_not_implement(worker_module, hybrid, extra):
    module, box = worker_module
    target, _ = hybrid
    engine = Engine(target, (1, 3))
    box["engine"] = engine
    _, ddir = builtin_pair("hybrid")
    args = NS(disable_overlap_schedule=True, page_size=1, speculative_num_draft_tokens=16, speculative_eagle_topk=2,
              speculative_num_steps=15, device="cpu", tp_size=1, speculative_draft_model_path=str(ddir),
              return_hidden_states_mode="full")
    worker = module.DDTreeWorker(server_args=args, gpu_id=0, ps=NS(tp_rank=0), nccl_port=0, target_worker=engine)
    req = NS(rid="r", origin_input_ids=[5, 6, 7], output_ids=[9],
             sampling_params=NS(temperature=0.7, top_k=-1, top_p=1.0, max_new_tokens=8, **extra))
    with pytest.raises(ValueError, match=next(iter(extra))):
        worker._prepare_draft_tokens(NS(reqs=[req]))


def test_worker_refuses_to_start_without_the_full_hidden_state_ceiling(worker_module, hybrid):
    """Without the server's FULL hidden-state ceiling (set by the algorithm's server-args check) SGLang
    would capture the target's verify graphs without hidden states and the first graphed decode step would
    die; the worker refuses at start-up instead. It reads the target model runner's server args (what the
    graph runner reads) where there are any."""
    module, _ = worker_module
    target, _ = hybrid
    _, ddir = builtin_pair("hybrid")
    engine = Engine(target, (1, 3))
    args = {"disable_overlap_schedule": True, "page_size": 1, "speculative_num_draft_tokens": 16,
            "speculative_eagle_topk": 2, "speculative_num_steps": 15, "device": "cpu", "tp_size": 1,
            "speculative_draft_model_path": str(ddir)}
    with pytest.raises(ValueError, match="hidden-state ceiling"):
        module.DDTreeWorker(server_args=NS(**args), gpu_id=0, ps=NS(tp_rank=0), nccl_port=0, target_worker=engine)
    engine.model_runner.server_args = NS(**args, return_hidden_states_mode="last", enable_return_hidden_states=True)
    with pytest.raises(ValueError, match="hidden-state ceiling"):  # the target's args win over the worker's copy
        module.DDTreeWorker(server_args=NS(**args, return_hidden_states_mode="full"), gpu_id=0, ps=NS(tp_rank=0),
                            nccl_port=0, target_worker=engine)
    engine.model_runner.server_args = NS(**args, return_hidden_states_mode="full")
    module.DDTreeWorker(server_args=NS(**args), gpu_id=0, ps=NS(tp_rank=0), nccl_port=0, target_worker=engine)


@pytest.mark.parametrize(("temperature", "top_k", "greedy"), [
    (0.0, -1, True),   # what a client sends
    (1.0, 1, True),    # what SGLang's SamplingParams.normalize turns it into (the first H200 run refused this)
    (0.7, -1, False), (1.0, 40, False)])
def test_greedy_is_temperature_zero_or_top_k_one(worker_module, temperature, top_k, greedy):
    module, _ = worker_module
    assert module.sampling.is_greedy(NS(temperature=temperature, top_k=top_k)) is greedy


# -- faults injected into SGLang (refcheck/sglang/ddtree/faults.py) ---------------------------------------
class KvMoveSkippedLast(DDTreeDecoder):
    """The reference twin of ``kv-move-last``: the last accepted node's committed KV row is flat node
    len(accepted)-1's (what the verify left in that slot); conv/recurrent state right."""

    def commit(self, state, fwd, accepted):
        return _commit(state, fwd, accepted[:-1] + [len(accepted) - 1], accepted[-1], accepted[-1])


@pytest.mark.parametrize(("fault", "twin"), [("mamba-flat-index", StateFromFlatIndex), ("kv-move-last", KvMoveSkippedLast),
                                             ("flat-positions", SequentialPositions)])
def test_injected_sglang_fault_decodes_like_its_reference_twin(worker_module, hybrid, fault, twin):
    """Each fault fed into SGLang's commit / move / positions makes the worker decode exactly as the
    reference decoder with the same bug does, and that decoder's steps differ from the correct one's."""
    module, box = worker_module
    target, drafter = hybrid
    prompts = load_prompts()[:2]
    outputs, taus, _ = _run(module, box, target, prompts, 15, 16, fault=fault)
    onsets = []
    for i, p in enumerate(prompts):
        cfg = DecodeConfig(budget=15, max_new_tokens=16, keep_states=True)
        bad = twin(target, drafter, cfg).generate(list(p.prompt_ids))
        assert outputs[f"r{i}"] == bad.output_ids and taus[f"r{i}"] == [s.accept_length for s in bad.steps]
        onsets.append(fault_onset(DDTreeDecoder(target, drafter, cfg).generate(list(p.prompt_ids)), bad))
    assert any(onsets), f"{fault} changed nothing on these prompts"


def test_bonus_from_the_neighbour_needs_two_requests(worker_module, hybrid):
    module, box = worker_module
    target, drafter = hybrid
    prompts = load_prompts()[:2]
    clean = {f"r{i}": DDTreeDecoder(target, drafter, DecodeConfig(budget=15, max_new_tokens=16)).generate(
        list(p.prompt_ids)).output_ids for i, p in enumerate(prompts)}
    alone, _, _ = _run(module, box, target, prompts[:1], 15, 16, fault="bonus-neighbour")
    assert alone["r0"] == clean["r0"]  # one request: its neighbour is itself
    both, _, _ = _run(module, box, target, prompts, 15, 16, fault="bonus-neighbour")
    assert both != clean


def test_the_capture_keeps_each_steps_drafter_side(worker_module, hybrid, monkeypatch):
    """With capture on, each decode step leaves the drafter's top-k per depth (in the tree builder's order, ranks up
    to the budget) and the positions and sketch of the context the step fed the drafter: the root and the accepted
    nodes, at the committed positions."""
    from refcheck.sglang.env import ENV_DIR

    monkeypatch.setenv(ENV_DIR, "/nonexistent")  # the worker only reads whether it is set
    module, box = worker_module
    target, _ = hybrid
    sides = []
    real = module.DDTreeWorker._verify

    def verify(self, batch, rids):
        prefix = batch.seq_lens.tolist()
        out = real(self, batch, rids)
        sides.append((prefix, out[2].tolist(), {r: dict(v) for r, v in self.last_sides.items()}, rids))
        return out

    monkeypatch.setattr(module.DDTreeWorker, "_verify", verify)
    _run(module, box, target, load_prompts()[:2], 15, 12)
    assert sides
    for prefix, lens, by_rid, rids in sides:
        for b, rid in enumerate(rids):
            side = by_rid[rid]
            assert len(side["ids"][0]) == 15 and side["logprobs"][0] == sorted(side["logprobs"][0], reverse=True)
            assert side["positions"] == list(range(prefix[b], prefix[b] + lens[b]))
            assert tuple(side["sketch"].shape) == (lens[b], 16)


@pytest.mark.parametrize("fault", ["draft-positions-shifted", "draft-skip-last", "draft-wrong-layers", "draft-depth-shift"])
def test_drafter_faults_keep_the_output_and_lower_acceptance(worker_module, hybrid, fault):
    """Each drafter fault leaves the output the target's own (lossless) and changes the drafts: τ moves."""
    module, box = worker_module
    target, drafter = hybrid
    prompts = load_prompts()[:2]
    outputs, taus, _ = _run(module, box, target, prompts, 15, 24, fault=fault)
    clean_taus = []
    for i, p in enumerate(prompts):
        ref = DDTreeDecoder(target, drafter, DecodeConfig(budget=15, max_new_tokens=24)).generate(list(p.prompt_ids))
        assert outputs[f"r{i}"] == ref.output_ids
        clean_taus.append([s.accept_length for s in ref.steps])
    assert [taus[f"r{i}"] for i in range(len(prompts))] != clean_taus
    assert sum(map(sum, (taus[f"r{i}"] for i in range(len(prompts))))) / sum(map(len, taus.values())) < \
        sum(map(sum, clean_taus)) / sum(map(len, clean_taus))
