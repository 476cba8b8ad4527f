"""Sampling in the reference: Philox known answers, the tempered distribution, the draw, and the
lossless invariant at T > 0 (the tree decoder equals target-only sampling token for token)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from ddtree_reference.errors import SamplingError
from ddtree_reference.oracle import GreedyMemo, sample_decode
from ddtree_reference.sampling import (
    Sampling,
    boundary_margin,
    inverse_cdf,
    keyed_uniforms,
    node_uniforms,
    philox4x32,
    tempered_probs,
)
from ddtree_reference.scripted import ScriptedDrafter

PROMPT = [17, 3, 99, 250, 41, 8, 8, 120]
NEAR = 1e-6  # a draw this close to a CDF edge may flip under the tree-vs-plain forward's round-off


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox-4x32-10."""
    assert philox4x32(np.zeros((1, 4)), 0)[0].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox4x32(np.full((1, 4), 0xFFFFFFFF), 2**64 - 1)[0].tolist()
    assert ones == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = philox4x32(np.array([[0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]]), 0xA4093822 | (0x299F31D0 << 32))
    assert pi[0].tolist() == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_keyed_uniforms_are_pure_and_uniform():
    rows = [[7, q, 0, 1] for q in range(20000)]
    a, b = keyed_uniforms(3, rows), keyed_uniforms(3, rows[::-1]).flip(0)
    assert torch.equal(a, b)  # a pure function of (seed, counter): order does not matter
    assert not torch.equal(a, keyed_uniforms(4, rows))
    assert 0.0 <= float(a.min()) and float(a.max()) < 1.0
    # Kolmogorov-Smirnov distance of 20000 uniforms: the 1e-3 critical value is 1.95 / sqrt(n)
    s = a.sort().values.numpy()
    n = len(s)
    d = max(np.max(np.arange(1, n + 1) / n - s), np.max(s - np.arange(n) / n))
    assert d < 1.95 / math.sqrt(n)


def test_node_keying_differs_per_node_and_position_keying_per_depth():
    s = Sampling(1.0, seed=1)
    u = node_uniforms(s, 0, 3, [5, 6, 6, 7])
    assert float(u[1]) == float(u[2]) and len(set(u.tolist())) == 3  # siblings share their position's number
    un = node_uniforms(Sampling(1.0, seed=1, keying="node"), 0, 3, [5, 6, 6, 7])
    assert len(set(un.tolist())) == 4


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(seed=-3), dict(keying="step")])
def test_bad_sampling_parameters_are_typed_errors(bad):
    with pytest.raises(SamplingError):
        Sampling(**{"temperature": 1.0, **bad})


@given(st.integers(2, 40), st.floats(0.05, 3.0), st.integers(0, 45), st.floats(0.01, 1.0), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_tempered_probs_support_and_mass(V, T, k, p, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, V, generator=g) * 3
    probs = tempered_probs(logits, T, k, p)
    assert probs.dtype == torch.float64
    assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    full = torch.softmax(logits.double() / T, -1)
    for row in range(3):
        support = (probs[row] > 0).nonzero().flatten().tolist()
        if 0 < k < V:
            assert len(support) <= k
        if k == 0 or k >= V:  # the support is the top-p nucleus of the full distribution
            kept = full[row, support].sum()
            assert kept >= p - 1e-12
            smallest = full[row, support].min()
            assert kept - smallest < p + 1e-12  # minimal: dropping the least likely kept token falls short
        ratio = probs[row, support] / full[row, support]  # renormalised, shape unchanged on the support
        assert torch.allclose(ratio, ratio[0].expand_as(ratio))


def test_inverse_cdf_frequencies_and_margins():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25]], dtype=torch.float64)
    u = keyed_uniforms(0, [[0, i, 0, 9] for i in range(40000)])
    tok = inverse_cdf(probs.expand(len(u), 5), u)
    freq = torch.bincount(tok, minlength=5).double() / len(u)
    assert freq[0] == 0 and freq[2] == 0
    assert torch.allclose(freq, probs[0], atol=0.01)
    assert inverse_cdf(probs, torch.tensor([0.4999999], dtype=torch.float64)).item() == 1
    assert inverse_cdf(probs, torch.tensor([0.5], dtype=torch.float64)).item() == 3
    assert inverse_cdf(probs, torch.tensor([1 - 2**-53], dtype=torch.float64)).item() == 4
    m = boundary_margin(probs, torch.tensor([0.6], dtype=torch.float64), torch.tensor([3]))
    assert abs(float(m) - 0.1) < 1e-12


def _agree(a: list[int], b: list[int], margins: list[float]) -> None:
    """Token-for-token equality up to the first draw within NEAR of a CDF edge (a round-off tie)."""
    stop = next((i for i, m in enumerate(margins) if m < NEAR), len(margins))
    assert a[:stop] == b[:stop], (a, b, stop)
    assert len(a) == len(b) or stop < min(len(a), len(b))


@pytest.fixture(scope="module")
def oracle_cache():
    return {}


@given(seed=st.integers(0, 2**40), budget=st.sampled_from([None, 0, 1, 4, 15]),
       temp=st.sampled_from([0.6, 1.0, 1.7]), top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.9]),
       request=st.integers(0, 5))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_tree_sampling_equals_target_only_sampling(hybrid, oracle_cache, seed, budget, temp, top_k, top_p, request):
    target, _ = hybrid
    # the drafter's truth (greedy prefixes) is shared between examples: a GreedyMemo on the same weights
    memo = oracle_cache.setdefault("greedy", GreedyMemo(target.model))
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, seed=3, oracle=memo)
    s = Sampling(temp, top_k, top_p, seed)
    key = (seed, temp, top_k, top_p, request)
    if key not in oracle_cache:
        oracle_cache[key] = sample_decode(target.model, PROMPT, 12, s, request)
    want, margins = oracle_cache[key]
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=12, sampling=s)).generate(
        PROMPT, request=request)
    _agree(res.output_ids, want, margins)
    for st_ in res.steps:
        assert st_.draws is not None and st_.draws.shape == st_.tree.tokens.shape
        assert st_.accepted == st_.tree.walk_greedy(st_.draws)
        assert st_.bonus == int(st_.draws[st_.accepted[-1]])


def test_sampled_dflash_chain_and_tree_equal_oracle(attention):
    target, drafter = attention
    s = Sampling(1.0, 0, 1.0, 11)
    want, margins = sample_decode(target.model, PROMPT, 16, s, 2)
    for budget in (None, 8):
        res = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=16, sampling=s)).generate(
            PROMPT, request=2)
        _agree(res.output_ids, want, margins)


def test_temperature_zero_is_greedy(hybrid):
    target, drafter = hybrid
    a = DDTreeDecoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=10)).generate(PROMPT)
    b = DDTreeDecoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=10, sampling=Sampling(0.0, 3, 0.5, 9))
                      ).generate(PROMPT)
    assert a.output_ids == b.output_ids and all(s.draws is None for s in b.steps)
