"""The temperature check (refcheck/diff/temperature.py): the lean of a draw (which way the temperature must
move for the reference to draw the engine's token), the sign test over steps with its slack, and end to end
in bf16: a sampler at a temperature 10 % off fails with default options, a correct one passes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_reference.sampling import inverse_cdf, keyed_uniforms, tempered_probs
from refcheck.diff.temperature import (
    ALPHA,
    SLACK,
    Leans,
    binomial_tail,
    draw_lean,
    judge_leans,
    lean_p_value,
    node_leans,
)


def _edge(logp: torch.Tensor, T: float, k: int, p: float, upto: int) -> float:
    """``F(<upto)`` of the sampling distribution at temperature ``T`` (support fixed by ``T``'s cut)."""
    return float(tempered_probs(logp[None], T, k, p)[0, :upto].sum())


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 40), scale=st.floats(0.3, 6.0), T=st.floats(0.3, 2.0),
       u=st.floats(0.0, 1.0, exclude_max=True), token=st.integers(0, 39))
def test_the_lean_is_the_direction_that_moves_the_edge_towards_the_uniform(seed, V, scale, T, u, token):
    """For a token other than the one the reference draws, the lean is the sign of the temperature change that
    moves the token's near CDF edge towards ``u``: checked against a finite difference of that edge."""
    token %= V
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * scale, -1)
    probs = tempered_probs(logp[None], T)[0]
    drawn = int(inverse_cdf(probs[None], torch.tensor([u], dtype=torch.float64))[0])
    lean = draw_lean(logp, probs, u, token)
    if token == drawn:
        assert lean is None
        return
    assert lean in (-1, 0, 1)
    h = 1e-6
    upto = token if token > drawn else token + 1  # the edge that must cross u: F(<token) falls, F(<=token) rises
    want = -1.0 if token > drawn else 1.0  # the way that edge must move
    moved = _edge(logp, T * (1 + h), 0, 1.0, upto) - _edge(logp, T * (1 - h), 0, 1.0, upto)  # per unit of higher T
    if abs(moved) < 1e-10:  # the edge does not move with the temperature (to the precision a difference resolves)
        return
    assert lean == (1 if moved * want > 0 else -1)


def test_a_token_outside_the_support_has_no_lean():
    logp = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, -4.0], dtype=torch.float64), -1)
    probs = tempered_probs(logp[None], 1.0, top_k=2)[0]
    assert probs[3] == 0 and draw_lean(logp, probs, 0.5, 3) == 0
    assert node_leans(logp[None], probs[None], [0.5], [int(inverse_cdf(probs[None], torch.tensor([0.5]))[0])]) == [None]


def test_binomial_tail_is_exact():
    for n in (0, 1, 7, 30):
        for q in (0.3, 0.5, 0.6):
            for k in range(-1, n + 2):
                want = sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(max(k, 0), n + 1))
                assert binomial_tail(n, k, q) == pytest.approx(min(want, 1.0), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("n", [1, 10, 40, 150, 600])
def test_the_sign_test_keeps_its_level_for_every_lean_within_the_slack(n):
    """The exact chance of a failure, for a correct engine whose steps lean higher with any probability q in
    1/2 +- SLACK, is at most ALPHA (both sides); the test is symmetric."""
    fails = [k for k in range(n + 1) if lean_p_value(k, n - k) < ALPHA]
    for q in (0.5 - SLACK, 0.45, 0.5, 0.55, 0.5 + SLACK):
        size = sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in fails)
        assert size <= ALPHA
    assert all(lean_p_value(k, n - k) == lean_p_value(n - k, k) for k in range(n + 1))


def test_one_sided_steps_fail_and_balanced_ones_pass():
    # 15 steps all one way: 2 * 0.6**15 = 9.4e-4 < alpha; 14: 1.6e-3
    assert lean_p_value(15, 0) < ALPHA < lean_p_value(14, 0)
    assert lean_p_value(83, 5) < 1e-10 and lean_p_value(45, 43) == 1.0
    assert lean_p_value(0, 0) == 1.0


def _synthetic_leans(engine_temperature: float, noise: float, n_steps: int, seed: int, nodes: int = 16) -> Leans:
    """Steps of ``nodes`` draws each from random peaked distributions at T = 1 by an engine sampling at
    ``engine_temperature`` with its logits off by N(0, noise) (the stand-in for its rounding)."""
    g = torch.Generator().manual_seed(seed)
    V = 64
    leans = Leans()
    for step in range(n_steps):
        logits = torch.randn(nodes, V, generator=g, dtype=torch.float64) * 2.5  # [N, V]
        logp = torch.log_softmax(logits, -1)
        noisy = logp + noise * torch.randn(nodes, V, generator=g, dtype=torch.float64)
        u = keyed_uniforms(seed, [[seed & 0xFFFF, step, i, 9] for i in range(nodes)])
        tokens = inverse_cdf(tempered_probs(noisy, engine_temperature), u).tolist()
        leans.add("r", step, node_leans(logp, tempered_probs(logp, 1.0), u.tolist(), tokens))
    return leans


@pytest.mark.parametrize("seed", range(4))
def test_rounding_alone_leans_both_ways_and_passes(seed):
    v = judge_leans(_synthetic_leans(1.0, 0.05, 200, seed))
    assert v.verdict == "pass" and v.higher + v.lower > 50, v
    assert v.draws_higher + v.draws_lower + v.draws_neither > 0 and v.keyed_draws == 200 * 16


@pytest.mark.parametrize(("factor", "side"), [(1.1, "higher"), (0.9, "lower")])
def test_a_temperature_off_by_ten_percent_leans_one_way_and_fails(factor, side):
    v = judge_leans(_synthetic_leans(factor, 0.05, 60, 7))
    assert v.verdict == "fail" and v.side == side and v.p_value < 1e-6, v


def test_the_running_test_names_the_step_and_the_tokens_it_first_fails_at():
    """Steps in the order added; the count is the emitted tokens once that step is done, requests in order."""
    from types import SimpleNamespace

    from refcheck.diff.temperature import emitted_after, first_failing_step

    leans = Leans()
    leans.add("a", 0, [-1])  # one lower vote first, then higher ones: 20 against 1 is the first below alpha
    for step in range(1, 25):
        leans.add("a" if step < 10 else "b", step, [1, None])
    higher = [k for k in leans.steps][1:]
    first = first_failing_step(leans)
    assert lean_p_value(19, 1) >= ALPHA > lean_p_value(20, 1) and first == higher[19] == ("b", 20)
    # request b's first recorded step is its step 10 (a sampled capture): counted from its own place in the output
    step = lambda i, n: SimpleNamespace(step=i, emitted=[0] * n, committed_len=3 + 2 * i)  # noqa: E731
    trace = SimpleNamespace(requests=[SimpleNamespace(request_id="a", output_ids=[0] * 21, prompt_ids=[0] * 3),
                                      SimpleNamespace(request_id="b", output_ids=[0] * 51, prompt_ids=[0] * 3)],
                            steps_of=lambda rid: [step(i, 2) for i in (range(10) if rid == "a" else range(10, 25))])
    counts = emitted_after(trace)  # type: ignore[arg-type]
    assert counts[("a", -1)] == 1 and counts[("a", 9)] == 21 and counts[("b", -1)] == 22 and counts[("b", 20)] == 64
    v = judge_leans(leans, emitted_after=counts)
    assert v.verdict == "fail" and v.fails_after_tokens == counts[first]
    assert judge_leans(leans).fails_after_tokens is None


# -- end to end: the reference run as a bf16 engine, diffed with default options ------------------------------
@pytest.fixture(scope="module")
def pool():
    from refcheck.pool import ReferencePool

    return ReferencePool()


def _bf16_trace(pool, pair: str, engine: str, prompts: int, tokens: int):
    from ddtree_reference.decode import DDTreeDecoder
    from refcheck.prompts import load_prompts
    from refcheck.reference_runner import EngineSpec
    from refcheck.selftest.sampling_faults import CORPUS_SAMPLING, SAMPLING_FAULTS

    sampling = CORPUS_SAMPLING["temperature-1.1x"]  # T = 1.0, top-k and top-p off
    spec = EngineSpec(pair=pair, drafter="dflash", budget=15, max_new_tokens=tokens, sampling=sampling, dtype="bfloat16")
    cls = DDTreeDecoder if engine == "reference" else SAMPLING_FAULTS[engine][0]
    trace, _ = pool.runner(spec).trace(load_prompts()[:prompts], cls=cls, engine=engine)
    return trace


@pytest.mark.xdist_group("temperature_e2e")  # one worker loads the models once for the three end-to-end tests
@pytest.mark.parametrize(("pair", "fault", "side"), [("attention", "temperature-1.1x", "higher"),
                                                      ("hybrid", "temperature-0.9x", "lower")])
def test_a_bf16_engine_at_a_temperature_ten_percent_off_fails_by_default(pool, pair, fault, side):
    """Every draw the fault moves is within bf16 rounding at its node; the check over the trace is not, within
    300 emitted tokens (here 2 prompts x 40), and no deviation of the trace stays triaged."""
    trace = _bf16_trace(pool, pair, fault, 2, 40)
    assert sum(len(r.output_ids) for r in trace.requests) <= 300
    from refcheck.diff.judge import judge

    rep = judge(trace, pool, fault, mode="replay")
    outright = [f for f in rep.failures if "not_triaged" not in f.details]
    assert [f.category for f in outright] == ["temperature"], [f.message for f in outright][:3]
    t = rep.stats["temperature"]
    assert t["verdict"] == "fail" and max(t["higher"], t["lower"]) > 4 * min(t["higher"], t["lower"]), t
    assert side in outright[0].message and t["withdrawn"] > 0
    emitted = sum(len(r.output_ids) for r in trace.requests)
    assert 0 < t["fails_after_tokens"] <= emitted and f"from {t['fails_after_tokens']} emitted tokens" in outright[0].message
    assert not any(f.verdict.value == "triaged" for f in rep.findings)


@pytest.mark.xdist_group("temperature_e2e")
def test_a_correct_bf16_engine_passes_the_temperature_check(pool):
    from refcheck.diff.judge import judge

    trace = _bf16_trace(pool, "hybrid", "reference", 2, 32)
    rep = judge(trace, pool, "clean", mode="replay")
    assert not rep.failures, [f.message for f in rep.failures][:3]
    t = rep.stats["temperature"]
    assert t["verdict"] == "pass" and t["higher"] + t["lower"] > 5 and rep.checks["temperature"] == 1, t
