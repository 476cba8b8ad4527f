"""REFCHECK_DDTREE's SGLang-independent parts: tree layout, the drafter over SGLang-style weights,
per-request drafter contexts, and the server-args check. The worker itself runs only inside SGLang
(GPU tests marked ``sglang``)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from ddtree_reference.drafter import DFlashDrafter
from refcheck.models import builtin_pair
from refcheck.prompts import load_prompts
from refcheck.sglang.ddtree.algorithm import check_server_args, ngram_like_spec_class
from refcheck.sglang.ddtree.drafts import DrafterPool, TargetView, draft_tree, extend_context
from refcheck.sglang.ddtree.hidden_states import hidden_states_ceiling_is_full
from refcheck.sglang.ddtree.layout import TreeLayoutError, ancestor_mask, batch_layout

from strategies import rooted_parents  # tests/strategies.py


@settings(max_examples=60, deadline=None)
@given(rooted_parents(max_nodes=24))
def test_mask_rows_are_ancestor_sets_and_give_back_the_parents(parents):
    mask = ancestor_mask(parents)
    for i in range(len(parents)):
        path, j = set(), i
        while j >= 0:
            path.add(j)
            j = parents[j]
        assert set(np.nonzero(mask[i])[0].tolist()) == path
        # SGLang's reconstruction: the parent is the largest-index ancestor other than the node
        anc = [k for k in np.nonzero(mask[i])[0].tolist() if k != i]
        assert (max(anc) if anc else -1) == parents[i]


def test_layout_refuses_what_sglang_cannot_take():
    with pytest.raises(TreeLayoutError):
        ancestor_mask([-1, 2, 0])  # a parent after its child
    with pytest.raises(TreeLayoutError, match="verifies 3"):
        batch_layout([([5, 6], [-1, 0])], 3)
    drafts, mask = batch_layout([([5, 6, 7], [-1, 0, 0]), ([1, 2, 3], [-1, 0, 1])], 3)
    assert drafts.tolist() == [5, 6, 7, 1, 2, 3] and mask.shape == (18,) and mask.dtype == bool


@pytest.fixture(scope="module")
def pair(hybrid):
    target, drafter = hybrid
    _, ddir = builtin_pair("hybrid")
    view = TargetView(target.body.embed_tokens.weight, target.model.lm_head.weight, target.vocab_size, len(target.layers))
    return target, drafter, DFlashDrafter.load(ddir, view)


def test_drafter_over_a_weight_view_equals_the_reference_drafter(pair):
    target, ref, viewed = pair
    prompt = torch.tensor(load_prompts()[0].prompt_ids)
    _, fwd = target.prefill(prompt, capture=ref.target_layer_ids)
    for d in (ref, viewed):
        d.reset()
        d.extend(fwd.context, torch.arange(len(prompt)))
    assert torch.equal(ref.propose(7, len(prompt)), viewed.propose(7, len(prompt)))


def test_pool_contexts_interleave_like_separate_drafters_and_match_the_decoder(pair):
    """Two requests drafted through one pool, interleaved, give each request the tree the reference
    decoder builds at its first step."""
    target, ref, viewed = pair
    pool = DrafterPool(viewed)
    prompts = load_prompts()[:2]
    firsts = {}
    for p in prompts:
        _, fwd = target.prefill(torch.tensor(p.prompt_ids), capture=ref.target_layer_ids)
        extend_context(pool, p.id, fwd.context, 0)
        firsts[p.id] = int(fwd.logits[-1].argmax())
    for p in reversed(prompts):  # interleaved order must not matter
        tokens, parents, _ = draft_tree(pool, p.id, firsts[p.id], len(p.prompt_ids), 15)
        res = DDTreeDecoder(target, ref, DecodeConfig(budget=15, max_new_tokens=40)).generate(list(p.prompt_ids))
        step0 = res.steps[0].tree
        assert tokens == step0.tokens.tolist() and parents == step0.parents.tolist()
    pool.drop([prompts[0].id])
    assert list(pool.contexts) == [prompts[1].id]


def test_view_refuses_a_sharded_head():
    with pytest.raises(ValueError, match="tensor-parallel"):
        TargetView(torch.zeros(10, 4), torch.zeros(5, 4), 10, 2)


def test_server_args_check(tmp_path):
    _, ddir = builtin_pair("hybrid")
    args = NS(speculative_draft_model_path=str(ddir), speculative_num_draft_tokens=16, tp_size=1,
              disable_overlap_schedule=True, speculative_eagle_topk=None, speculative_num_steps=None,
              max_running_requests=None, enable_mixed_chunk=True)
    check_server_args(args)
    assert args.speculative_eagle_topk == 2 and args.speculative_num_steps == 15 and not args.enable_mixed_chunk
    leaky = NS(**{**vars(args), "speculative_eagle_topk": 10})
    check_server_args(leaky, leaky=True)
    assert leaky.speculative_eagle_topk == 1  # the chain layout: what the leak needs
    for bad, msg in (({"speculative_draft_model_path": None}, "draft-model-path"),
                     ({"speculative_num_draft_tokens": 1}, "budget"),
                     ({"tp_size": 2}, "tensor parallelism"),
                     ({"disable_overlap_schedule": False}, "overlap"),
                     ({"speculative_draft_model_path": str(builtin_pair("hybrid")[0])}, "not a DFlash draft")):
        with pytest.raises(ValueError, match=msg):
            check_server_args(NS(**{**vars(args), **bad}))


def test_server_args_check_raises_the_hidden_state_ceiling_for_cuda_graphs():
    """SGLang 0.5.17 captures the target's verify graphs at max(server ceiling, NULL) for an NGRAM-like
    algorithm; the verify asks FULL (the drafter reads every node's hidden states), so without a FULL
    ceiling the first graphed decode step dies ("exceeds the fixed CUDA graph capture mode (NULL)", H200).
    The check sets the ceiling for every twin, with or without graphs, and leaves the verify width (the
    graph's tokens per request) at budget + 1."""
    _, ddir = builtin_pair("hybrid")
    base = {"speculative_draft_model_path": str(ddir), "speculative_num_draft_tokens": 16, "tp_size": 1,
            "disable_overlap_schedule": True, "speculative_eagle_topk": None, "speculative_num_steps": None,
            "max_running_requests": None, "enable_mixed_chunk": True}
    for extra, leaky in (({"disable_cuda_graph": False}, False), ({"disable_cuda_graph": True}, False),
                         ({"return_hidden_states_mode": "last", "enable_return_hidden_states": True}, False),
                         ({}, True)):
        args = NS(**base, **extra)
        assert not hidden_states_ceiling_is_full(args)
        check_server_args(args, leaky=leaky)
        assert args.return_hidden_states_mode == "full" and args.enable_return_hidden_states is True
        assert hidden_states_ceiling_is_full(args)
        assert args.speculative_num_draft_tokens == 16  # the graph is captured for budget + 1 tokens per request


@pytest.mark.parametrize(("mode", "enabled", "full"), [
    (None, False, False), (None, True, True), ("full", False, True), ("full", True, True),
    ("last", True, False), ("last", False, False)])
def test_hidden_state_ceiling_reads_like_sglangs(mode, enabled, full):
    """The mirror of SGLang 0.5.17's get_server_return_hidden_states_mode (forward_batch_info.py:234-240)
    compared with FULL: "last" wins over enable_return_hidden_states."""
    assert hidden_states_ceiling_is_full(NS(return_hidden_states_mode=mode, enable_return_hidden_states=enabled)) is full
    assert hidden_states_ceiling_is_full(NS()) is False


def test_spec_class_answers_like_ngram_where_the_registry_base_is_silent():
    """SGLang 0.5.17's CustomSpecAlgo lacks methods its scheduler calls at start-up (the first H200
    run died on ``carries_draft_hidden_states``): they are borrowed from the builtin enum."""
    import enum

    class Base:  # the registry's base class: defaults of its own, some methods missing
        def __init__(self, name: str) -> None:
            self.name = name

        def is_eagle(self) -> bool:
            return False

        def is_ngram(self) -> bool:
            return False

        def has_draft_kv(self) -> bool:
            return True

    class Builtin(enum.Enum):  # the enum SGLang's own algorithms are
        NGRAM = "ngram"

        def is_eagle(self) -> bool:
            return self is Builtin.NGRAM and False

        def is_ngram(self) -> bool:
            return self is Builtin.NGRAM

        def has_draft_kv(self) -> bool:
            return not self.is_ngram()

        def carries_draft_hidden_states(self) -> bool:
            return self.is_eagle()

        def need_topk(self) -> bool:
            return self.is_eagle()

        @classmethod
        def from_string(cls, name: str) -> Builtin:
            return cls[name]

    cls = ngram_like_spec_class(Base, Builtin)
    algo = cls("REFCHECK_DDTREE")
    assert isinstance(algo, Base) and algo.name == "REFCHECK_DDTREE"
    assert algo.is_ngram() and not algo.is_eagle()
    assert algo.has_draft_kv() is False  # NGRAM's answer, not the base's default
    assert algo.carries_draft_hidden_states() is False and algo.need_topk() is False
    assert {"carries_draft_hidden_states", "need_topk"} <= set(dir(cls))  # what 0.5.23's check reads
    assert "from_string" not in vars(cls)  # classmethods stay the enum's


# -- faults injected into SGLang (refcheck/sglang/ddtree/faults.py) ---------------------------------------
def test_fault_algorithm_names():
    from refcheck.sglang.ddtree.faults import ALGORITHMS
    from refcheck.sglang.pair import DFLASH_DRAFTED

    assert ALGORITHMS == {"REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX": "mamba-flat-index",
                          "REFCHECK_DDTREE_FAULT_KV_MOVE_LAST": "kv-move-last",
                          "REFCHECK_DDTREE_FAULT_FLAT_POSITIONS": "flat-positions",
                          "REFCHECK_DDTREE_FAULT_BONUS_NEIGHBOUR": "bonus-neighbour",
                          "REFCHECK_DDTREE_FAULT_DRAFT_POSITIONS_SHIFTED": "draft-positions-shifted",
                          "REFCHECK_DDTREE_FAULT_DRAFT_SKIP_LAST": "draft-skip-last",
                          "REFCHECK_DDTREE_FAULT_DRAFT_WRONG_LAYERS": "draft-wrong-layers",
                          "REFCHECK_DDTREE_FAULT_DRAFT_DEPTH_SHIFT": "draft-depth-shift",
                          "REFCHECK_DDTREE_FAULT_TEMPERATURE_HIGH": "temperature-high",
                          "REFCHECK_DDTREE_FAULT_TEMPERATURE_LOW": "temperature-low"}
    assert set(ALGORITHMS) <= set(DFLASH_DRAFTED)  # drafted from the DFlash checkpoint, budget checked like DDTree


def test_fault_indices():
    from refcheck.sglang.ddtree.faults import chain_accept_index, flat_positions, neighbour_bonus, skip_last_move

    n = 4
    # request 0 accepted nodes 0, 2, 3 (flat 0, 2, 3); request 1 only its root (flat 4)
    accept_index = torch.tensor([[0, 2, 3, -1], [4, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3, 1], dtype=torch.int32)
    assert chain_accept_index(accept_index, lens, n).tolist() == [[0, 1, 2, -1], [4, -1, -1, -1]]
    assert skip_last_move(accept_index, lens, n).tolist() == [[0, 2, 2, -1], [4, -1, -1, -1]]
    assert accept_index.tolist()[0] == [0, 2, 3, -1]  # inputs untouched
    # depths 0 1 1 2 below seq_len 10, and 0 1 2 3 below 20
    pos = torch.tensor([10, 11, 11, 12, 20, 21, 22, 23])
    assert flat_positions(pos, 2, n).tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    logits = torch.zeros(2 * n, 9)
    for row in range(2 * n):
        logits[row, row] = 1.0  # the argmax of row r is token r
    predict = torch.tensor([5, 0, 7, 8, 6, 0, 0, 0], dtype=torch.int32)
    got = neighbour_bonus(predict, accept_index, lens, logits, n).tolist()
    assert got == [5, 0, 7, 7, 0, 0, 0, 0]  # request 0's bonus (flat 3) from flat 7; request 1's (flat 4) from flat 0


def test_sampler_faults_scale_the_temperature_the_keyed_sampler_draws_at():
    """temperature-high / -low hand the keyed sampler 1.1 x / 0.9 x the request's temperature (greedy requests
    and the other faults untouched); at a node whose uniform lies between the two CDF edges the draw moves."""
    from ddtree_reference.sampling import Sampling
    from refcheck.sglang.ddtree.faults import sampler_keys
    from refcheck.sglang.ddtree.sampling import RequestKeys, sample_tree

    keys = [RequestKeys(Sampling(temperature=0.8, top_p=0.9, seed=3), 7), None]
    assert sampler_keys(keys, None) is keys and sampler_keys(keys, "kv-move-last") is keys
    high, greedy = sampler_keys(keys, "temperature-high")
    assert greedy is None and high is not None
    assert high.sampling.temperature == pytest.approx(0.88) and high.sampling.top_p == 0.9 and high.request == 7
    assert keys[0] is not None and keys[0].sampling.temperature == 0.8  # the request's own keys stay
    low = sampler_keys(keys, "temperature-low")[0]
    assert low is not None and low.sampling.temperature == pytest.approx(0.72)
    # one root, no drafts: every draw is the first token; over many keys the scaled sampler draws differently
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))  # [1, V]
    one = torch.tensor([[0]])
    none = torch.tensor([[-1]])
    moved = 0
    for word in range(500):  # about 2.6 % of uniforms lie between the edges of T = 1.0 and T = 1.1
        k = [RequestKeys(Sampling(temperature=1.0, seed=1), word)]
        a = sample_tree(logits, one, none, none, k, [5], 1)[0]
        b = sample_tree(logits, one, none, none, sampler_keys(k, "temperature-high"), [5], 1)[0]
        moved += int(a[0] != b[0])
    assert 0 < moved < 50


def test_fault_algorithms_register_with_their_worker(monkeypatch):
    """register_algorithm registers every fault algorithm with the tree layout's check and a worker
    subclass that carries the fault (the registry and the worker module are stand-ins here)."""
    import sys
    from types import ModuleType

    import refcheck.sglang.ddtree.algorithm as alg

    registered: dict[str, tuple] = {}

    class SpeculativeAlgorithm:
        @staticmethod
        def register(name, supports_overlap, validate_server_args, spec_class):
            return lambda factory: registered.setdefault(name, (validate_server_args, factory))

    class DDTreeWorker:
        fault = None

    mods = {"sglang": ModuleType("sglang"), "sglang.srt": ModuleType("sglang.srt"),
            "sglang.srt.speculative": ModuleType("sglang.srt.speculative"),
            "sglang.srt.speculative.spec_info": ModuleType("sglang.srt.speculative.spec_info"),
            "sglang.srt.speculative.spec_registry": ModuleType("sglang.srt.speculative.spec_registry"),
            "refcheck.sglang.ddtree.worker": ModuleType("refcheck.sglang.ddtree.worker")}
    mods["sglang.srt.speculative.spec_info"].SpeculativeAlgorithm = SpeculativeAlgorithm
    mods["sglang.srt.speculative.spec_registry"].CustomSpecAlgo = type("CustomSpecAlgo", (), {})
    mods["refcheck.sglang.ddtree.worker"].DDTreeWorker = DDTreeWorker
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(alg, "_done", False)
    assert alg.register_algorithm()
    assert set(registered) == {alg.NAME, alg.LEAKY_NAME, alg.SHADOW_NAME, *alg.FAULT_NAMES}
    assert registered[alg.NAME][1](None) is DDTreeWorker
    _, ddir = builtin_pair("hybrid")
    for name, fault in (("REFCHECK_DDTREE_FAULT_KV_MOVE_LAST", "kv-move-last"),
                        ("REFCHECK_DDTREE_FAULT_BONUS_NEIGHBOUR", "bonus-neighbour")):
        validate, factory = registered[name]
        worker = factory(None)
        assert issubclass(worker, DDTreeWorker) and worker.fault == fault
        args = NS(speculative_draft_model_path=str(ddir), speculative_num_draft_tokens=16, tp_size=1,
                  disable_overlap_schedule=True, speculative_eagle_topk=None, speculative_num_steps=None,
                  max_running_requests=None, enable_mixed_chunk=True)
        validate(args)
        assert args.speculative_eagle_topk == 2  # the tree layout: only the injected fault is wrong


def test_a_prefix_served_from_the_prefix_cache_leaves_the_drafter_context_partial():
    """REFCHECK_DDTREE's drafter is fed the target's hidden states of what the target computes: a new request whose
    prefix the radix cache served starts a context without it (partial: its drafts are not judged), a later chunk
    of a known request goes on, a request prefilled from scratch starts whole, and dropping forgets it."""
    pool = DrafterPool(drafter=None)
    pool.admit("a", 0)
    pool.contexts["a"] = ([], [], 5)  # its first chunk fed
    pool.admit("a", 5)  # the next chunk of the same request
    assert "a" in pool.contexts and not pool.partial
    pool.admit("b", 32)  # new, its first 32 tokens from the cache
    assert "b" not in pool.contexts and pool.partial == {"b"}
    pool.contexts["b"] = ([], [], 40)
    pool.admit("b", 40)
    assert pool.partial == {"b"}  # still missing its cached prefix
    pool.drop(["b"])
    pool.admit("b", 0)  # prefilled again from scratch (a retraction)
    assert not pool.partial
