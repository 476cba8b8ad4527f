"""Published baselines: data files, lookup, and acceptance-length statistics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.baselines import (
    BaselineError,
    BaselineRow,
    NoMatchingBaseline,
    baseline_names,
    load_baselines,
    match,
)
from refcheck.baselines.stats import (
    acceptance_verdict,
    bootstrap_mean_ci,
    histogram,
    histogram_distance,
    per_position_acceptance,
    positions_from_histogram,
)
from refcheck.errors import EXIT_USAGE, UsageError, exit_code_for

EXPECTED_ROWS = {  # rows after loading (the histogram CSV groups 16 bins per row)
    "ddtree_table1": 120,
    "ddtree_budget_sweep": 8,
    "ddtree_accept_hist": 2,
    "dflash_readme": 40,
}


# ------------------------------------------------------------------------------ data files

def test_known_names():
    assert baseline_names() == sorted(EXPECTED_ROWS)


@pytest.mark.parametrize("name", sorted(EXPECTED_ROWS))
def test_every_csv_loads(name):
    rows = load_baselines(name)
    assert len(rows) == EXPECTED_ROWS[name]
    for r in rows:
        assert isinstance(r, BaselineRow)
        assert r.method in ("dflash", "ddtree")
        assert 1.0 <= r.tau <= r.block_size, r
        assert r.block_size == 16
        assert r.source and r.model and r.drafter and r.dataset
        assert r.temperature in (0.0, 1.0)
        assert r.extra["file"] == name
        if r.method == "dflash":
            assert r.budget is None
        if r.speedup is not None:
            assert r.speedup > 0


def test_load_all_and_csv_suffix():
    assert len(load_baselines()) == sum(EXPECTED_ROWS.values())
    assert load_baselines("dflash_readme.csv") == load_baselines("dflash_readme")


def _one(rows, **kw):
    found = match(rows, **kw)
    assert len(found) == 1, found
    return found[0]


def test_table1_spot_checks():
    rows = load_baselines("ddtree_table1")
    cases = [  # (T, dataset, model, dflash speedup, dflash tau, ddtree speedup, ddtree tau)
        (0.0, "MATH-500", "Qwen3-4B", 5.54, 7.72, 7.50, 10.71),
        (0.0, "MATH-500", "Qwen3-8B", 5.56, 7.79, 7.52, 10.73),
        (0.0, "HumanEval", "Qwen3-Coder-30B-A3B-Instruct", 6.09, 8.02, 8.22, 10.72),
        (0.0, "SWE-bench Lite", "Qwen3-8B", 2.65, 3.60, 4.23, 5.91),
        (0.0, "Alpaca", "Qwen3-Coder-30B-A3B-Instruct", 1.53, 2.22, 2.46, 3.55),
        (1.0, "AIME 2024", "Qwen3-4B", 3.50, 5.01, 5.31, 7.82),
        (1.0, "MT-Bench", "Qwen3-8B", 2.30, 3.77, 3.75, 6.02),
        (1.0, "Alpaca", "Qwen3-Coder-30B-A3B-Instruct", 1.51, 2.14, 2.43, 3.51),
    ]
    for t, ds, model, dsp, dtau, tsp, ttau in cases:
        d = _one(rows, model=model, dataset=ds, temperature=t, method="dflash")
        g = _one(rows, model=model, dataset=ds, temperature=t, method="ddtree")
        assert (d.speedup, d.tau, g.speedup, g.tau) == (dsp, dtau, tsp, ttau)
        assert d.budget is None and g.budget is None
        assert g.extra["budget_candidates"] == "16;32;64;128;256;512;1024"
    r = _one(rows, model="qwen3-4b", dataset="math-500", temperature=0, method="DDTREE")
    assert r.drafter == "z-lab/Qwen3-4B-DFlash-b16"
    assert r.extra["n_prompts"] == 128 and r.extra["max_new_tokens"] == 2048
    assert "H200" in r.extra["hardware"]
    humaneval = _one(rows, model="Qwen3-8B", dataset="HumanEval", temperature=0, method="dflash")
    assert humaneval.extra["n_prompts"] == 164
    # every (T, dataset, target) appears once per method
    assert len({(r.temperature, r.dataset, r.model, r.method) for r in rows}) == 120


def test_budget_sweep_spot_checks():
    rows = load_baselines("ddtree_budget_sweep")
    expected = {16: (6.09, 8.61), 128: (7.33, 10.20), 512: (7.52, 10.73), 1024: (6.82, 10.98)}
    for b, (sp, tau) in expected.items():
        r = _one(rows, budget=b)
        assert (r.speedup, r.tau) == (sp, tau)
        assert (r.model, r.dataset, r.temperature, r.method) == ("Qwen3-8B", "MATH-500", 0.0,
                                                                 "ddtree")
    ref = _one(rows, method="dflash")
    assert (ref.speedup, ref.tau) == (5.56, 7.79)
    taus = [r.tau for r in sorted(match(rows, method="ddtree"), key=lambda r: r.budget)]
    assert taus == sorted(taus)  # tau grows with budget in Fig. 3


def test_accept_hist():
    rows = load_baselines("ddtree_accept_hist")
    d = _one(rows, method="dflash")
    g = _one(rows, method="ddtree", budget=512)
    assert d.extra["histogram"][0] == pytest.approx(0.1025)
    assert d.extra["histogram"][-1] == pytest.approx(0.1862)
    assert g.extra["histogram"][0] == pytest.approx(0.0007)
    assert g.extra["histogram"][-1] == pytest.approx(0.3205)
    for r in rows:
        assert len(r.extra["histogram"]) == 16
        assert sum(r.extra["histogram"]) == pytest.approx(1.0, abs=0.001)
        assert r.extra["tau_converted_from"].startswith("histogram mean")
    assert d.tau == pytest.approx(7.605, abs=1e-3)
    assert g.tau == pytest.approx(10.664, abs=1e-3)


def test_dflash_readme_spot_checks():
    rows = load_baselines("dflash_readme")
    cases = [  # (model, T, dataset, speedup, tau)
        ("Qwen3-4B", 0.0, "GSM8K", 5.17, 6.50),
        ("Qwen3-4B", 0.0, "MATH-500", 6.19, 7.84),
        ("Qwen3-8B", 0.0, "LiveCodeBench", 5.43, 7.12),
        ("Qwen3-4B", 1.0, "AIME25", 3.89, 5.01),
        ("Qwen3-8B", 1.0, "SWE-Bench", 2.30, 2.82),
        ("Qwen3-8B", 1.0, "Alpaca", 2.11, 2.88),
    ]
    for model, t, ds, sp, tau in cases:
        r = _one(rows, model=model, temperature=t, dataset=ds)
        assert (r.speedup, r.tau) == (sp, tau)
        assert r.method == "dflash" and r.budget is None
        assert r.extra["hardware"] == "NVIDIA B200"
        assert r.drafter == f"z-lab/{model}-DFlash-b16"


# ------------------------------------------------------------------------------ errors

def test_unknown_name():
    with pytest.raises(BaselineError) as ei:
        load_baselines("ddtree_tabel1")
    msg = str(ei.value)
    assert "ddtree_tabel1" in msg and "did you mean 'ddtree_table1'" in msg
    for n in EXPECTED_ROWS:
        assert n in msg
    assert isinstance(ei.value, UsageError) and exit_code_for(ei.value) == EXIT_USAGE == 2


def test_no_match_lists_nearest():
    rows = load_baselines()
    with pytest.raises(NoMatchingBaseline) as ei:
        match(rows, model="Qwen3-4B", dataset="AIME 24", temperature=0.0, method="ddtree")
    msg = str(ei.value)
    assert "dataset='AIME 24' matches no row" in msg
    assert "AIME 2024" in msg and "AIME24" in msg
    assert "nearest available conditions (1 of 4 criteria differ)" in msg
    assert "model=Qwen3-4B dataset=AIME 2024 temperature=0 method=ddtree" in msg
    assert exit_code_for(ei.value) == 2

    with pytest.raises(NoMatchingBaseline) as ei:
        match(load_baselines("ddtree_table1"), model="Qwen3-8B", dataset="MATH-500",
              temperature=0.0, method="ddtree", budget=512)
    msg = str(ei.value)
    assert "budget=512 matches no row" in msg
    assert "[ddtree_table1] model=Qwen3-8B dataset=MATH-500 temperature=0 method=ddtree " \
           "budget=-  (differs in: budget)" in msg

    with pytest.raises(NoMatchingBaseline, match="row list is empty"):
        match([], model="Qwen3-4B")


# ------------------------------------------------------------------------------ statistics

def _requests(rng, hist, n_requests, steps_per_request, concentration=100.0):
    """Draw per-request taus over 1..16: each request gets its own histogram from a Dirichlet
    centred on ``hist`` (between-request correlation), so the marginal distribution is ``hist``."""
    p = np.asarray(hist) / np.sum(hist)
    out = []
    for _ in range(n_requests):
        q = rng.dirichlet(concentration * p + 1e-3)
        out.append(rng.choice(np.arange(1, 17), size=steps_per_request, p=q).tolist())
    return out


def test_bootstrap_ci_contains_mean_and_narrows():
    rng = np.random.default_rng(1)
    hist = load_baselines("ddtree_accept_hist")[1].extra["histogram"]
    small = _requests(rng, hist, 8, 40)
    large = _requests(rng, hist, 128, 40)
    m1, lo1, hi1 = bootstrap_mean_ci(small)
    m2, lo2, hi2 = bootstrap_mean_ci(large)
    assert lo1 <= m1 <= hi1 and lo2 <= m2 <= hi2
    assert m1 == pytest.approx(np.mean(np.concatenate(small)))
    assert (hi2 - lo2) < 0.6 * (hi1 - lo1)
    assert bootstrap_mean_ci(small, seed=3) == bootstrap_mean_ci(small, seed=3)
    assert bootstrap_mean_ci([[16] * 10, [16] * 3]) == (16.0, 16.0, 16.0)
    m, lo, hi = bootstrap_mean_ci([[1, 2, 3, 4, 5]])  # single request: step-level fallback
    assert lo < m == 3.0 < hi
    with pytest.raises(ValueError):
        bootstrap_mean_ci([[], []])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([[0, 3]])


def test_per_position_and_histogram_examples():
    taus = [1, 2, 4, 4]
    assert per_position_acceptance(taus, 4) == [0.75, 0.5, 0.5]
    assert histogram(taus, 4) == [0.25, 0.25, 0.0, 0.5]
    assert positions_from_histogram(histogram(taus, 4)) == pytest.approx([0.75, 0.5, 0.5])
    assert histogram_distance([1, 0], [0, 1]) == 1.0
    assert histogram_distance([0.5, 0.5], [0.5, 0.5]) == 0.0
    rows = load_baselines("ddtree_accept_hist")
    tv = histogram_distance(rows[0].extra["histogram"], rows[1].extra["histogram"])
    assert 0.1 < tv < 0.5
    with pytest.raises(ValueError):
        per_position_acceptance([5], 4)
    with pytest.raises(ValueError):
        histogram_distance([1, 0], [1, 0, 0])


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=16).flatmap(
    lambda bs: st.tuples(st.just(bs), st.lists(st.integers(1, bs), min_size=1, max_size=60))))
def test_property_positions_monotone_histogram_sums_to_one(case):
    bs, taus = case
    pos = per_position_acceptance(taus, bs)
    assert len(pos) == bs - 1
    assert all(0.0 <= p <= 1.0 for p in pos)
    assert all(a >= b for a, b in zip(pos, pos[1:]))
    h = histogram(taus, bs)
    assert len(h) == bs and sum(h) == pytest.approx(1.0)
    assert positions_from_histogram(h) == pytest.approx(pos)
    assert histogram_distance(h, h) == 0.0


def test_verdict_pass_fail_inconclusive():
    rows = load_baselines("ddtree_accept_hist")
    dflash_hist = _one(rows, method="dflash").extra["histogram"]
    ddtree = _one(rows, method="ddtree")
    base_pos = positions_from_histogram(ddtree.extra["histogram"])
    rng = np.random.default_rng(0)

    good = _requests(rng, ddtree.extra["histogram"], 64, 50)
    v = acceptance_verdict(good, ddtree.tau, baseline_positions=base_pos, position_floor=0.05)
    assert v["verdict"] == "PASS", v["reason"]
    assert v["inconclusive_reason"] is None
    assert v["ci"][0] <= v["mean"] <= v["ci"][1]
    assert v["n_steps"] == 64 * 50 and v["n_requests"] == 64
    assert v["band"] == pytest.approx([ddtree.tau * 0.95, ddtree.tau * 1.05])
    assert len(v["positions"]) == 15
    assert all(p["status"] == "ok" for p in v["positions"])
    assert v["positions"][0]["delta"] == pytest.approx(
        v["positions"][0]["observed"] - base_pos[0])

    worse = _requests(rng, dflash_hist, 64, 50)  # DFlash-like run vs the DDTree baseline
    v = acceptance_verdict(worse, ddtree.tau)
    assert v["verdict"] == "FAIL" and "significantly below" in v["reason"]
    assert v["ci"][1] < v["band"][0]
    v = acceptance_verdict(worse, 7.0, baseline_positions=base_pos)  # tau ok, positions not
    assert v["verdict"] == "FAIL" and "per-position" in v["reason"]
    assert any(p["status"] == "significantly_below" for p in v["positions"])

    v = acceptance_verdict([[10, 12, 9], [11, 10]], ddtree.tau)
    assert v["verdict"] == "INCONCLUSIVE" and v["inconclusive_reason"] == "too_few_steps"
    assert v["n_steps"] == 5 and "5 < min_steps=30" in v["reason"]

    noisy = [[1] * 20, [16] * 20, [2] * 20, [15] * 20]  # enough steps, huge between-request spread
    v = acceptance_verdict(noisy, 8.5)
    assert v["verdict"] == "INCONCLUSIVE" and v["inconclusive_reason"] == "ci_too_wide"
    assert v["ci_halfwidth"] > v["max_halfwidth"]

    v = acceptance_verdict([good[0] + good[1]], ddtree.tau)
    assert v["verdict"] == "INCONCLUSIVE" and v["inconclusive_reason"] == "too_few_requests"

    v = acceptance_verdict([], ddtree.tau)
    assert v["verdict"] == "INCONCLUSIVE" and v["mean"] is None


def test_a_budget_on_a_best_budget_source_says_what_the_rows_give():
    """Table 1 reports the best budget per row: asking it for --budget 15 names the candidates and the
    per-budget source, never an empty "available:" list."""
    import pytest

    from refcheck.baselines import NoMatchingBaseline, load_baselines, match

    with pytest.raises(NoMatchingBaseline) as exc:
        match(load_baselines("ddtree_table1"), model="Qwen3-8B", dataset="MATH-500", temperature=0.0,
              method="ddtree", budget=15)
    msg = str(exc.value)
    assert "available: \n" not in msg + "\n" and "available: " not in msg.split("nearest")[0]
    assert "best of budgets 16, 32, 64, 128, 256, 512, 1024" in msg
    assert "--source ddtree_budget_sweep (per-budget rows: 16, 32" in msg
    assert match(load_baselines("ddtree_budget_sweep"), model="Qwen3-8B", dataset="MATH-500", budget=16)
