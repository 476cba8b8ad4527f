"""Exact tree verify and commit of the reference target against independent oracles.

The oracles are transformers' own cache-free forward over plain token sequences (per-path verify)
and transformers' own cache after a plain prefill (committed state). Trees come from the scripted
drafter with decoys always ranked above the target's token, so accepted nodes have non-ancestor
siblings before them in the flattened order: the only trees on which a leaky verify shows.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from ddtree_reference.compat import hf_cache_state
from ddtree_reference.oracle import path_logits
from ddtree_reference.scripted import ScriptedDrafter
from ddtree_reference.tree import build_ddtree

TOL = 1e-5  # fp32 CPU, relative to the tensor's scale: rounding only (chunked vs recurrent delta rule)


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """max |got - ref| <= TOL * max(1, max |ref|)."""
    return float((got.float() - ref.float()).abs().max()) <= TOL * max(1.0, float(ref.float().abs().max()))


def _tiny_qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from ddtree_reference.target import Target

    cfg = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=256, initializer_range=0.1,
    )
    torch.manual_seed(3)
    return Target(Qwen3NextForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def qwen3_next():
    return _tiny_qwen3_next()


def _decoy_tree(target, prompt, budget=24, seed=0):
    """Prefill, then a DDTree from a scripted drafter that always puts decoys above the truth."""
    state, fwd = target.prefill(torch.tensor(prompt))
    bonus = int(fwd.logits[-1].argmax())
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, block_size=8,
                              seed=seed, decoy_prob=1.0, max_decoys=1, miss_prob=0.0)
    drafter.extend(fwd.context, torch.arange(len(prompt)), torch.tensor(prompt))
    tree = build_ddtree(bonus, drafter.propose(bonus, state.length), budget)
    return state, tree


def _check_trap(tree, accepted):
    """The leak needs a non-ancestor ahead of an accepted node in the flat order."""
    vis = tree.visibility()
    return any(not bool(vis[node, j]) for node in accepted[1:] for j in range(node))


@pytest.mark.parametrize("length, rel", [(37, TOL), (150, 3 * TOL)])  # 150: > 2 prefill chunks
@pytest.mark.parametrize("which", ["hybrid", "attention", "qwen3_next"])
def test_prefill_equals_transformers_forward(which, length, rel, request):
    """Rounding grows with length: 1.03e-5 relative measured on qwen3_next at 147 tokens (both methods)."""
    target = _tiny_qwen3_next() if which == "qwen3_next" else request.getfixturevalue(which)[0]
    ids = torch.arange(3, 3 + length) % target.vocab_size
    _, fwd = target.prefill(ids)
    from ddtree_reference.compat import full_forward_logits

    ref = full_forward_logits(target.model, ids)
    assert float((fwd.logits - ref).abs().max()) <= rel * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("method", ["chunk", "levels"])
@pytest.mark.parametrize("which", ["hybrid", "attention", "qwen3_next"])
def test_exact_verify_equals_per_path_oracle_on_decoy_trees(which, method, request, monkeypatch):
    target = request.getfixturevalue(which) if which == "qwen3_next" else request.getfixturevalue(which)[0]
    monkeypatch.setattr(target, "gdn_method", method)
    prompt = [int(t) for t in (torch.arange(7, 31) * 5) % (target.vocab_size - 1)]
    state, tree = _decoy_tree(target, prompt)
    fwd = target.forward(state, tree.tokens, tree.parents, tree.depths)
    accepted = tree.walk_greedy(fwd.logits.argmax(-1))
    assert len(accepted) >= 3, "scripted drafter should give a deep accepted path"
    assert any(int(tree.ranks[i]) > 0 for i in accepted), "no accepted non-first sibling"
    assert _check_trap(tree, accepted)
    oracle = path_logits(target.model, prompt, tree.tokens.tolist(), tree.parents.tolist())
    assert _close(fwd.logits, oracle)


def test_leaky_verify_fails_the_same_test(hybrid):
    target = hybrid[0]
    prompt = [int(t) for t in (torch.arange(7, 31) * 5) % (target.vocab_size - 1)]
    state, tree = _decoy_tree(target, prompt)
    leaky = target.forward(state, tree.tokens, tree.parents, tree.depths, leaky=True)
    exact = target.forward(state, tree.tokens, tree.parents, tree.depths)
    oracle = path_logits(target.model, prompt, tree.tokens.tolist(), tree.parents.tolist())
    assert (leaky.logits - oracle).abs().max() > 1e-2
    assert _close(exact.logits, oracle)


def test_leaky_is_harmless_without_recurrent_layers(attention):
    target = attention[0]
    prompt = list(range(5, 25))
    state, tree = _decoy_tree(target, prompt)
    leaky = target.forward(state, tree.tokens, tree.parents, tree.depths, leaky=True)
    exact = target.forward(state, tree.tokens, tree.parents, tree.depths)
    assert torch.equal(leaky.logits, exact.logits)


@pytest.mark.parametrize("method", ["chunk", "levels"])
@pytest.mark.parametrize("which", ["hybrid", "attention"])
def test_commit_equals_plain_prefill_of_committed_tokens(which, method, request, monkeypatch):
    from ddtree_reference.decode import DDTreeDecoder, DecodeConfig

    target, _ = request.getfixturevalue(which)
    monkeypatch.setattr(target, "gdn_method", method)
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, block_size=8, seed=1)
    prompt = list(range(11, 30))
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=15, max_new_tokens=24, keep_states=True)).generate(prompt)
    assert any(s.accept_length > 2 for s in res.steps)
    committed = list(prompt) + [res.output_ids[0]]
    for step in res.steps:
        committed += [int(step.tree.tokens[i]) for i in step.accepted[1:]]
        ids = torch.tensor(committed[: step.state.length])
        assert step.state.length == len(committed)
        got = step.state.tensors()
        replay, _ = target.prefill(ids)
        hf = hf_cache_state(target.model, ids)
        for name, ref in replay.tensors().items():
            assert got[name].shape == ref.shape, name
            assert _close(got[name], ref), name
            if hf is not None:
                assert _close(got[name], hf[name]), name
        committed.append(step.bonus)


def test_qwen3_6_style_composite_checkpoint_loads(tmp_path):
    """Qwen3.5/3.6 checkpoints are vision-language (model_type qwen3_5, text_config nested, weights
    under model.language_model): the reference loads the text model from them."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from ddtree_reference.target import Target

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    vlm.save_pretrained(str(tmp_path))
    target = Target.load(tmp_path)
    ids = torch.arange(5, 30)
    _, fwd = target.prefill(ids)
    with torch.no_grad():
        ref = vlm(input_ids=ids[None]).logits[0]
    assert _close(fwd.logits, ref)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_target_equals_eager_on_decoy_trees(pair):
    """Target.compile (Inductor, for speed at scale) computes the eager reference's math: exact
    and leaky verify of a decoy tree, and the commit built from it, agree to float rounding."""
    from ddtree_reference.target import Target

    eager = pair[0]
    compiled = Target(copy.deepcopy(eager.model))  # its own model: compile re-points the weights it fuses
    compiled.compile()
    first = compiled.fusions
    compiled.compile()  # idempotent: the weights are fused once
    assert compiled.fusions is first
    fused = [f for f in compiled.fusions if f.mixer is not None and f.mlp is not None]
    assert len(fused) == len(compiled.layers)  # every layer's input projections and gate | up are one GEMM each
    import torch._dynamo.utils

    torch._dynamo.reset()  # an earlier compile of the same shapes in this process would serve ours from its cache
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls: list[int] = []
    fn = compiled._layer_fn  # count calls into the compiled layer
    compiled._layer_fn = lambda *a, **k: (calls.append(1), fn(*a, **k))[1]
    prompt = [int(t) for t in (torch.arange(7, 31) * 5) % (eager.vocab_size - 1)]
    state, tree = _decoy_tree(eager, prompt)
    compiled.forward(state, tree.tokens, tree.parents, tree.depths)
    assert not calls  # a validated forward checks on the host: it runs eager
    for leaky in (True, False):  # the exact pair last: its commit is checked below
        want = eager.forward(state, tree.tokens, tree.parents, tree.depths, leaky=leaky)
        got = compiled.forward(state, tree.tokens, tree.parents, tree.depths, leaky=leaky, validate=False)
        assert len(calls) == len(compiled.layers)
        calls.clear()
        assert _close(got.logits, want.logits)
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    # one graph per layer kind, shared by every layer of the kind whatever its weights, and by the leaky
    # and exact forwards (the tree plan carries the difference)
    kinds = len(set(compiled.layer_types))  # hybrid: Gated DeltaNet and attention; the attention pair: one
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == kinds
    accepted = tree.walk_greedy(want.logits.argmax(-1))
    assert len(accepted) >= 3
    got_state, want_state = state.commit(got, accepted).tensors(), state.commit(want, accepted).tensors()
    assert got_state.keys() == want_state.keys()
    for name, ref in want_state.items():
        assert _close(got_state[name], ref), name
