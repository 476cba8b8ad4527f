"""The fixed-shape reference step (ddtree_reference/static.py) against the eager one: same trees, same
accepted paths, same bonus, same logits and same committed state, step after step, on both built-in
targets; and the device walk against Tree.walk_greedy on random trees (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from ddtree_reference.errors import PromptError
from ddtree_reference.static import StaticState, device_walk, verify_walk_commit
from ddtree_reference.tree import Tree, build_ddtree
from ddtree_reference.treechunk import ancestor_matrix
from refcheck.prompts import load_prompts

from strategies import rooted_parents  # tests/strategies.py


def _assert_states_equal(a, b, atol: float = 1e-5) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert a.length == b.length and ta.keys() == tb.keys()
    for name in ta:
        assert torch.allclose(ta[name].float(), tb[name].float(), atol=atol, rtol=1e-5), name


@pytest.mark.parametrize("budget", [15, 64])
def test_static_step_equals_the_eager_decoder(pair, budget):
    target, drafter = pair
    target.gdn_method = "chunk"
    prompt = list(load_prompts()[0].prompt_ids)
    steps = 6
    ref = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=64, keep_states=True)).generate(prompt)
    max_depth = drafter.block_size - 1

    # the same decode, every step through the fixed-shape path (the trees are rebuilt from the same drafts)
    capture = tuple(drafter.target_layer_ids)
    drafter.reset()
    p = torch.tensor(prompt)
    state, fwd = target.prefill(p, capture=capture)
    drafter.extend(fwd.context, torch.arange(len(prompt)), p)
    bonus = int(fwd.logits[-1].argmax())
    sstate = StaticState.from_state(state, capacity=len(prompt) + steps * (max_depth + 1) + max_depth + 1)
    for k in range(steps):
        rec = ref.steps[k]
        prev = int(sstate.length)
        assert prev == rec.committed_len and bonus == int(rec.tree.tokens[0])
        tree = build_ddtree(bonus, drafter.propose(bonus, prev), budget)
        assert torch.equal(tree.tokens, rec.tree.tokens) and torch.equal(tree.parents, rec.tree.parents)
        out = verify_walk_commit(target, sstate, tree.tokens, tree.parents, tree.depths, max_depth, capture)
        n_acc = int(out.n_accepted)
        path = out.path[:n_acc].tolist()
        assert path == rec.accepted and n_acc == rec.accept_length and int(out.bonus) == rec.bonus
        assert torch.equal(out.forward.logits.argmax(-1).cpu(), rec.target_argmax)
        _assert_states_equal(sstate.to_state(), rec.state)
        acc = torch.tensor(path)
        drafter.extend(out.forward.context[acc], prev + tree.depths[acc], tree.tokens[acc])
        bonus = int(out.bonus)


def test_static_state_round_trip_and_refusals(hybrid):
    target, _ = hybrid
    state, _ = target.prefill(torch.tensor(list(load_prompts()[1].prompt_ids)))
    back = StaticState.from_state(state, capacity=state.length + 8).to_state()
    _assert_states_equal(back, state, atol=0.0)
    with pytest.raises(PromptError, match="capacity"):
        StaticState.from_state(state, capacity=state.length - 1)
    target.gdn_method = "levels"
    try:
        sstate = StaticState.from_state(state, capacity=state.length + 32)
        t = torch.tensor([5, 6]), torch.tensor([-1, 0]), torch.tensor([0, 1])
        with pytest.raises(PromptError, match="tree-chunk"):
            verify_walk_commit(target, sstate, *t, max_depth=1)
    finally:
        target.gdn_method = "chunk"


@settings(max_examples=60, deadline=None)
@given(data=st.data(), parents=rooted_parents(max_nodes=24))
def test_device_walk_equals_the_greedy_walk_on_trees_with_distinct_sibling_tokens(data, parents):
    n = len(parents)
    par = torch.tensor(parents)
    depths = torch.zeros(n, dtype=torch.long)
    for t in range(1, n):
        depths[t] = depths[par[t]] + 1
    # distinct tokens among siblings: a child's token is its rank among its parent's children
    tokens, seen = [7], {}
    for t in range(1, n):
        seen[parents[t]] = seen.get(parents[t], -1) + 1
        tokens.append(seen[parents[t]])
    tokens = torch.tensor(tokens)
    argmax = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    ranks = torch.zeros(n, dtype=torch.long)
    tree = Tree(tokens, par, depths, ranks, torch.zeros(n))
    want = tree.walk_greedy(argmax)
    max_depth = int(depths.max())
    leaf, path, n_acc = device_walk(tokens, par, depths, argmax, ancestor_matrix(par), max_depth)
    assert int(n_acc) == len(want) and path[: int(n_acc)].tolist() == want and int(leaf) == want[-1]


def test_snapshot_restore_undoes_a_step(hybrid):
    """Warm-up and capture runs of a graph commit too; restore() takes the state back exactly."""
    target, drafter = hybrid
    prompt = torch.tensor(list(load_prompts()[2].prompt_ids))
    drafter.reset()
    state, fwd = target.prefill(prompt, capture=tuple(drafter.target_layer_ids))
    drafter.extend(fwd.context, torch.arange(len(prompt)), prompt)
    bonus = int(fwd.logits[-1].argmax())
    sstate = StaticState.from_state(state, capacity=len(prompt) + 64)
    tree = build_ddtree(bonus, drafter.propose(bonus, len(prompt)), 15)
    snap = sstate.snapshot()
    first = verify_walk_commit(target, sstate, tree.tokens, tree.parents, tree.depths, drafter.block_size - 1)
    first_path = first.path[: int(first.n_accepted)].tolist()
    assert int(sstate.length) > len(prompt)
    sstate.restore(snap)
    _assert_states_equal(sstate.to_state(), state, atol=0.0)
    again = verify_walk_commit(target, sstate, tree.tokens, tree.parents, tree.depths, drafter.block_size - 1)
    assert again.path[: int(again.n_accepted)].tolist() == first_path


@pytest.mark.parametrize("budget", [15, 64])
def test_whole_fixed_shape_step_with_the_static_drafter_decodes_like_the_decoder(pair, budget):
    """Draft from fixed-size context buffers, tree on the host, verify + walk + commit + context
    extend on the device: the same trees, accepted paths, bonus tokens and output as the eager
    decoder, step after step (full draft blocks: max_new_tokens stays far away)."""
    from ddtree_reference.static_draft import StaticDraftContext

    target, drafter = pair
    prompt = list(load_prompts()[3].prompt_ids)
    steps = 8
    block = drafter.block_size
    # a step emits at most a block, and drafts block - 1 deep while that much room is left: with
    # (steps + 1) blocks of room, every compared step drafts full blocks (the decoder runs no further)
    ref = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=(steps + 1) * block)).generate(prompt)
    assert len(ref.steps) >= steps
    capture = tuple(drafter.target_layer_ids)
    drafter.reset()
    p = torch.tensor(prompt)
    state, fwd = target.prefill(p, capture=capture)
    drafter.extend(fwd.context, torch.arange(len(prompt)), p)
    room = len(prompt) + (steps + 1) * block
    sstate = StaticState.from_state(state, capacity=room)
    ctx = StaticDraftContext.from_drafter(drafter, capacity=room)
    bonus = fwd.logits[-1].argmax()
    out_ids = [int(bonus)]
    for k in range(steps):
        lp = ctx.propose(bonus, sstate.length)
        tree = build_ddtree(int(bonus), lp, budget)
        rec = ref.steps[k]
        assert torch.equal(tree.tokens, rec.tree.tokens) and torch.equal(tree.parents, rec.tree.parents), k
        out = verify_walk_commit(target, sstate, tree.tokens, tree.parents, tree.depths, block - 1, capture, ctx)
        n = int(out.n_accepted)
        assert out.path[:n].tolist() == rec.accepted and int(out.bonus) == rec.bonus
        assert int(ctx.length) == int(sstate.length)  # the context covers every committed position
        out_ids += tree.tokens[out.path[1:n]].tolist() + [int(out.bonus)]
        bonus = out.bonus
    assert out_ids == ref.output_ids[: len(out_ids)]


class _NoHostReads(TorchDispatchMode):
    """Fails any operator that hands a tensor's value to the host: item() and the C++ paths that
    call it (indexing with a 0-dim tensor, int(), bool()), and data-dependent shapes (nonzero)."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.nonzero.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"a host read inside the fixed-shape step: {func}")
        return func(*args, **(kwargs or {}))


def test_the_fixed_shape_step_reads_nothing_back_to_the_host(hybrid, monkeypatch):
    """What a CUDA graph forbids, checked on CPU: no tensor is turned into a Python value (item,
    bool, int, float, tolist, or indexing by a 0-dim tensor, which reads it in C++) while the draft,
    the verify, the walk, the commit or the extend run."""
    from ddtree_reference.static_draft import StaticDraftContext

    target, drafter = hybrid
    prompt = torch.tensor(list(load_prompts()[5].prompt_ids))
    cap = tuple(drafter.target_layer_ids)
    drafter.reset()
    state, fwd = target.prefill(prompt, capture=cap)
    drafter.extend(fwd.context, torch.arange(len(prompt)), prompt)
    sstate = StaticState.from_state(state, capacity=len(prompt) + 64)
    ctx = StaticDraftContext.from_drafter(drafter, capacity=len(prompt) + 64)
    bonus = fwd.logits[-1].argmax()
    tree = build_ddtree(int(bonus), drafter.propose(int(bonus), len(prompt)), 15)

    def host_read(*_a, **_k):
        raise AssertionError("a host read inside the fixed-shape step")

    with monkeypatch.context() as m, _NoHostReads():
        for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
            m.setattr(torch.Tensor, name, host_read)
        ctx.propose(bonus, sstate.length)
        verify_walk_commit(target, sstate, tree.tokens, tree.parents, tree.depths, drafter.block_size - 1, cap, ctx)
    assert int(sstate.length) > len(prompt)
