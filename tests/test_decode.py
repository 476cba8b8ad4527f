"""End-to-end DDTree decoding: lossless against target-only greedy decoding, for every budget."""

from __future__ import annotations

import copy

import pytest

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from ddtree_reference.errors import BudgetError, PromptError
from ddtree_reference.oracle import GreedyMemo, greedy_decode
from ddtree_reference.scripted import ScriptedDrafter

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixture (the greedy continuations) is computed once.
pytestmark = pytest.mark.xdist_group("decode")

PROMPT = [17, 3, 99, 250, 41, 8, 8, 120, 77, 5, 301, 64]
MAX_NEW = 32
BUDGETS = [None, 1, 4, 15, 64]  # None = chain mode


@pytest.fixture(scope="module")
def greedy(request):
    cache: dict[str, list[int]] = {}

    def get(name, target):
        if name not in cache:
            cache[name] = greedy_decode(target.model, PROMPT, MAX_NEW)
        return cache[name]

    return get


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("which", ["hybrid", "attention"])
def test_dflash_ddtree_equals_greedy(which, budget, request, greedy):
    target, drafter = request.getfixturevalue(which)
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=MAX_NEW)).generate(PROMPT)
    assert res.output_ids == greedy(which, target)
    assert len(res.output_logprobs) == len(res.output_ids)
    assert sum(len(s.emitted) for s in res.steps) + 1 == len(res.output_ids)


@pytest.fixture(scope="module")
def oracle():
    """One GreedyMemo per model for the module's scripted drafters: their true continuations are the
    same greedy prefixes whatever the budget (the memo returns what greedy_decode does,
    tests/test_gate_work.py); the expected outputs still come from ``greedy``'s own greedy_decode."""
    memos: dict[str, GreedyMemo] = {}

    def get(name, target):
        return memos.setdefault(name, GreedyMemo(target.model))

    return get


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("which", ["hybrid", "attention"])
def test_scripted_ddtree_equals_greedy_with_deep_nonfirst_acceptance(which, budget, request, greedy, oracle):
    target, _ = request.getfixturevalue(which)
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, seed=5,
                              oracle=oracle(which, target))
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=MAX_NEW)).generate(PROMPT)
    assert res.output_ids == greedy(which, target)
    if budget is not None and budget >= 4:
        assert any(int(s.tree.ranks[i]) > 0 for s in res.steps for i in s.accepted), "no non-first sibling accepted"
        assert max(res.accept_lengths) >= 4
    for s in res.steps:  # τ counts the bonus, accepted nodes form a root path
        assert s.accept_length == len(s.accepted) >= 1
        assert s.accepted == s.tree.path(s.accepted[-1])


def test_tau_grows_with_budget_scripted(hybrid, oracle):
    target, _ = hybrid
    taus = []
    for budget in [1, 15, 64]:
        drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, seed=2,
                                  oracle=oracle("hybrid", target))
        taus.append(DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=MAX_NEW)).generate(PROMPT).mean_tau)
    assert taus[0] < taus[1] <= taus[2]


def test_stop_token_and_mask_token_output(hybrid, greedy):
    target, drafter = hybrid
    ref = greedy("hybrid", target)
    stop = ref[10]
    cut = ref[: ref.index(stop) + 1]
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=15, max_new_tokens=MAX_NEW, stop_token_ids=frozenset({stop}))).generate(PROMPT)
    assert res.output_ids == cut
    # A drafter whose MASK id is a token the target emits: that token must stay in the output.
    masked = copy.copy(drafter)
    masked.mask_token_id = ref[5]
    res = DDTreeDecoder(target, masked, DecodeConfig(budget=15, max_new_tokens=MAX_NEW)).generate(PROMPT)
    assert res.output_ids == ref and ref[5] in res.output_ids


@pytest.mark.parametrize("max_new", [1, 2, 17])
def test_max_new_tokens_is_exact(hybrid, greedy, max_new):
    target, drafter = hybrid
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=15, max_new_tokens=max_new)).generate(PROMPT)
    assert res.output_ids == greedy("hybrid", target)[:max_new]


def test_bad_inputs(hybrid):
    target, drafter = hybrid
    with pytest.raises(BudgetError):
        DDTreeDecoder(target, drafter, DecodeConfig(budget=-1))
    with pytest.raises(PromptError):
        DDTreeDecoder(target, drafter, DecodeConfig()).generate([])
    with pytest.raises(PromptError):
        DDTreeDecoder(target, drafter, DecodeConfig(max_new_tokens=10)).generate([1] * target.max_positions)
    with pytest.raises(PromptError):
        DDTreeDecoder(target, drafter, DecodeConfig(max_new_tokens=4)).generate([target.vocab_size + 5])
