"""The diff at temperature > 0: exact replay of the engine's draws, the distributional test, the
sampling faults (each caught where it first acts), and hidden randomness (INCONCLUSIVE, exit 5)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ddtree_reference.sampling import inverse_cdf, keyed_uniforms, tempered_probs
from refcheck.diff.distribution import Evidence, judge, n_required, pit_value
from refcheck.diff.judge import judge as judge_trace
from refcheck.errors import EXIT_MISMATCH, EXIT_NOTHING, EXIT_PASS
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.selftest.faults import find_fault
from refcheck.selftest.sampling_faults import SAMPLING_FAULTS, SELFTEST_SAMPLING, hide_randomness
from refcheck.trace.io import trace_bytes, trace_from_bytes

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixtures (the sampled clean run and its reference pool) are computed once.
pytestmark = pytest.mark.xdist_group("sampling_diff")

MAX_NEW = 12


@pytest.fixture(scope="module")
def reference():
    s = ReferencePool()
    spec = EngineSpec(pair="hybrid", drafter="scripted", budget=8, max_new_tokens=MAX_NEW, sampling=SELFTEST_SAMPLING)
    return s, s.runner(spec), load_prompts()[:1]


@pytest.fixture(scope="module")
def clean(reference):
    s, runner, prompts = reference
    trace, _ = runner.trace(prompts)
    return trace_from_bytes(trace_bytes(trace))  # through the file format (schema 1.2)


def test_clean_sampled_trace_records_and_passes(reference, clean):
    s, _, _ = reference
    req = clean.requests[0]
    assert req.temperature == 0.7 and req.top_p == 0.9 and req.rng == "refcheck-philox-position"
    assert 0 <= req.first_uniform < 1 and req.rng_request >= 0
    assert all(len(st_.node_draws) == len(st_.tree_tokens) == len(st_.node_uniforms) for st_ in clean.steps)
    rep = judge_trace(clean, s, "clean", mode="both", strict_acceptance=True)
    assert not rep.failures, [f.message for f in rep.failures]
    assert rep.checks["sampling"] >= len(clean.steps) and rep.checks["ar_tokens"] == 1
    assert rep.stats["distribution"]["n_tokens"] == len(req.output_ids)
    assert rep.exit_code == EXIT_PASS  # exact replay covers every draw: a small sample is not inconclusive


def test_hidden_randomness_small_sample_is_inconclusive(reference, clean):
    s, _, _ = reference
    rep = judge_trace(hide_randomness(clean), s, "hidden", mode="both")
    assert not rep.failures
    assert rep.inconclusive and rep.exit_code == EXIT_NOTHING and rep.verdict == "inconclusive"
    assert any(f.verdict.value == "unsupported" and f.category == "ar_tokens" for f in rep.findings)


def test_a_first_token_without_its_recorded_uniform_is_judged_from_the_key(reference, clean):
    """A sampled capture that did not take a request's prefill records no first uniform (NaN). With refcheck's keyed
    generator the diff recomputes it: the trace still passes exactly (not inconclusive), a first token the keyed
    uniform does not draw fails, and without a recomputable key the draw is left to the distributional test."""
    from refcheck.diff.sampling import SampledRequest, replay_first_token

    s, _, _ = reference
    unrecorded = replace(clean, requests=[replace(r, first_uniform=math.nan) for r in clean.requests])
    rep = judge_trace(unrecorded, s, "no-first-uniform", mode="both")
    assert not rep.failures and rep.exit_code == EXIT_PASS, [f.message for f in rep.failures]
    row = clean.requests[0]
    req = SampledRequest.from_row(row)
    assert req is not None and req.recomputable
    probs = torch.full((1, 8), 1 / 8, dtype=torch.float64)
    drawn = int(inverse_cdf(probs, req.keyed(-1, [len(row.prompt_ids)]))[0])
    assert replay_first_token("r", drawn, probs, math.nan, req, len(row.prompt_ids), 1e-6) == ([], True)
    found, exact = replay_first_token("r", (drawn + 4) % 8, probs, math.nan, req, len(row.prompt_ids), 1e-6)
    assert exact and [f.verdict.value for f in found] == ["fail"]
    hidden = SampledRequest.from_row(replace(row, rng="", rng_request=-1))
    assert hidden is not None and replay_first_token("r", drawn, probs, math.nan, hidden, 5, 1e-6) == ([], False)


def test_a_changed_draw_and_bonus_are_found_at_their_node(reference, clean):
    s, _, _ = reference
    k = next(i for i, st_ in enumerate(clean.steps) if len(st_.tree_tokens) > 2)
    st_ = clean.steps[k]
    node = len(st_.tree_tokens) - 1
    draws = list(st_.node_draws)
    draws[node] = (draws[node] + 1) % 512
    bad = replace(clean, steps=[replace(x, node_draws=draws) if x is st_ else x for x in clean.steps])
    rep = judge_trace(bad, s, "draw", mode="replay")
    f = rep.first_divergence()[st_.request_id]
    assert (f.category, f.step, f.node) in {("sampling", st_.step, node)}
    last = clean.steps[-1]
    bonus = replace(clean, steps=[replace(x, node_draws=[(d + 1) % 512 if i == x.accepted[-1] else d
                                                         for i, d in enumerate(x.node_draws)]) if x is last else x
                                  for x in clean.steps])
    rep = judge_trace(bonus, s, "bonus", mode="replay")
    assert {(f.category, f.step) for f in rep.failures} >= {("bonus", last.step)}


@pytest.mark.parametrize("name", sorted(SAMPLING_FAULTS))
def test_sampling_fault_caught_where_it_first_acts(reference, name):
    s, runner, prompts = reference
    cls, expected = find_fault(name)
    # the clean twin traced here, next to the faulty run: both in this process's numerics as they are now
    # (another test in the same worker may have changed torch's thread count, and with it the last bits of
    # a reduction: a uniform near a CDF edge then draws another token, and the onset would move)
    clean, _ = runner.trace(prompts)
    trace, _ = runner.trace(prompts, cls=cls, engine=f"fault:{name}")
    rep = judge_trace(trace, s, name, mode="replay")
    assert rep.exit_code == EXIT_MISMATCH
    # the first step where the fault's trace departs from the clean one is where it must be caught
    onset = next((a.step for a, b in zip(trace.steps, clean.steps)
                  if (a.node_draws, a.node_uniforms, a.accepted, a.bonus, a.tree_tokens)
                  != (b.node_draws, b.node_uniforms, b.accepted, b.bonus, b.tree_tokens)), None)
    first_uniform_differs = trace.requests[0].output_ids[:1] != clean.requests[0].output_ids[:1]
    at = -1 if first_uniform_differs else onset
    cats = {f.category for f in rep.failures if f.step == at}
    assert expected in cats, (name, at, [(f.category, f.step, f.message) for f in rep.failures][:5])


def test_unknown_fault_lists_sampling_faults():
    from refcheck.errors import UsageError
    from refcheck.selftest.faults import fault

    with pytest.raises(UsageError, match="uniform-shared"):
        fault("no-such-fault")
    assert find_fault("bonus-greedy")[0].__name__ == "BonusGreedy"


# --------------------------------------------------------------------------------- the test itself
def _synthetic(n_tokens: int, seed: int, temp_engine: float = 1.0, V: int = 50) -> Evidence:
    """Tokens drawn at T=1 from random peaked distributions by an engine sampling at ``temp_engine``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, V, generator=g) * 2.5  # [n, V]
    truth = tempered_probs(logits, 1.0)
    engine = tempered_probs(logits, temp_engine)
    u = keyed_uniforms(seed, [[seed & 0xFFFF, i, 7, 9] for i in range(n_tokens)])
    tok = inverse_cdf(engine, u)
    ev = Evidence()
    for i in range(n_tokens):
        ev.add_token(f"r{i // 64}", truth[i], int(tok[i]))
    return ev


def test_pit_value_is_the_randomized_transform():
    p = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    assert math.isclose(pit_value(p, 1, 0.5), 0.3)  # first in descending order
    assert math.isclose(pit_value(p, 2, 0.0), 0.6) and math.isclose(pit_value(p, 0, 1.0), 1.0)


@pytest.mark.parametrize("seed", range(8))  # fixed seeds: a random one would fail 1 run in 1000 (alpha)
def test_clean_synthetic_evidence_is_not_significant(seed):
    v = judge(_synthetic(400, seed))
    assert v.verdict in ("pass", "inconclusive") and v.n_tokens == 400


def test_flattened_temperature_is_detected_with_enough_tokens():
    v = judge(_synthetic(3000, 1, temp_engine=1.3))
    assert v.verdict == "fail" and v.p_value < 1e-3
    assert judge(_synthetic(3000, 2)).verdict == "pass"


def test_acceptance_component_and_required_sample():
    ev = Evidence()
    for i in range(2000):  # the walk always continues where a lossless sampler continues half the time
        ev.add_walk(f"r{i % 7}", 1 + i % 3, True, 0.5)
    v = judge(ev)
    assert v.verdict == "fail" and v.p_values["acceptance"] < 1e-12
    assert [d["depth"] for d in v.per_depth] == [1, 2, 3]
    assert judge(ev.first_requests(2)).n_walk_nodes == sum(1 for i in range(2000) if i % 7 < 2)
    assert n_required() == 626  # ((z(1 - 1e-3 / 10) + z(0.9)) / 0.2) ** 2 = ((3.7190 + 1.2816) / 0.2) ** 2 = 625.2


def test_impossible_token_fails_exactly():
    ev = Evidence()
    ev.add_token("r", torch.tensor([0.0, 1.0], dtype=torch.float64), 0)
    ev.add_token("s", torch.tensor([0.5, 0.5], dtype=torch.float64), 0)
    assert judge(ev).verdict == "fail" and judge(ev).impossible == 1
    assert judge(ev.first_requests(1)).impossible == 1 and judge(ev.first_requests(1)).verdict == "fail"


def test_schema_1_1_golden_reads_as_greedy():
    from refcheck.goldens import default_golden_dir
    from refcheck.trace.io import read_trace

    trace = read_trace(default_golden_dir() / "zlab-hybrid-chain.arrow")
    assert trace.schema_version == "1.1" and trace.checksummed
    assert all(r.temperature == 0 and not r.sampled and r.rng == "" and r.seed == -1 and math.isnan(r.first_uniform)
               for r in trace.requests)
    assert all(s.node_draws == [] and s.node_uniforms == [] for s in trace.steps)


def test_a_uniform_shared_along_walks_shows_in_the_id_order_serial_test():
    g = torch.Generator().manual_seed(4)
    n = 1200
    probs = tempered_probs(torch.randn(n, 40, generator=g), 1.0)  # [n, V] broad distributions
    u = keyed_uniforms(9, [[0, i // 3, 0, 9] for i in range(n)])  # one uniform per walk of 3 tokens
    tok = inverse_cdf(probs, u)
    ev = Evidence()
    for i in range(n):
        ev.add_token(f"r{i // 60}", probs[i], int(tok[i]))
    v = judge(ev)
    assert v.verdict == "fail" and v.p_values["serial_id"] < 1e-6 and v.p_values["mean"] > 1e-3


# -- in the engine's own dtype: draws judged against the node's rounding spread ------------------------------
def test_support_gap_is_how_far_the_logits_must_move():
    from ddtree_reference.sampling import Sampling as S
    from refcheck.diff.sampling import support_gap

    logp = torch.log_softmax(torch.tensor([4.0, 3.0, 2.0, 1.0, -5.0]), -1)
    assert support_gap(logp, 0, S(1.0, top_k=2)) == 0.0
    assert support_gap(logp, 2, S(1.0, top_k=2)) == pytest.approx(0.5)  # half the gap to the 2nd token
    assert support_gap(logp, 4, S(1.0, top_k=2)) == pytest.approx(4.0)
    p = torch.softmax(torch.tensor([4.0, 3.0, 2.0, 1.0, -5.0]), -1)
    before = float(p[:3].sum())
    assert support_gap(logp, 3, S(1.0, top_p=0.5)) == pytest.approx(math.log1p(before - 0.5))
    assert support_gap(logp, 0, S(1.0, top_p=0.5)) == 0.0


@pytest.fixture(scope="module")
def bf16_sampled():
    """The reference run as a bf16 engine at T = 0.7 with top-k 8 and top-p 0.9 (both cuts in play)."""
    s = ReferencePool()
    sampling = replace(SELFTEST_SAMPLING, top_k=8)
    spec = EngineSpec(pair="hybrid", budget=8, max_new_tokens=MAX_NEW, sampling=sampling, dtype="bfloat16")
    trace, _ = s.runner(spec).trace(load_prompts()[:2])
    return s, trace_from_bytes(trace_bytes(trace))


def test_a_correct_bf16_sampling_engine_passes_by_default(bf16_sampled):
    s, trace = bf16_sampled
    rep = judge_trace(trace, s, "bf16-sampled", mode="replay")
    assert not rep.failures, [f.message for f in rep.failures]
    assert rep.checks["sampling"] >= len(trace.steps)
    # the bf16 draws differ from the fp32 reference's somewhere beyond the fp32 floor: held to rounding, not failed
    assert any(f.category == "sampling" and f.verdict.value in ("triaged", "benign_tie") for f in rep.findings)


def test_a_bf16_draw_far_outside_rounding_fails_where_it_is(bf16_sampled):
    """A draw rounding cannot explain (the node's least likely token) fails at its node even in bf16,
    and is not triaged."""
    s, trace = bf16_sampled
    st_ = next(x for x in trace.steps if len(x.tree_tokens) > 1)
    node = len(st_.tree_tokens) - 1
    worst = int(torch.tensor(st_.topk_logprobs[node]).argmin())  # a node's top-k: only 5 ids are known
    draws = list(st_.node_draws)
    draws[node] = (st_.topk_ids[node][worst] + 257) % 512  # almost surely outside top-8 / top-p 0.9
    bad = replace(trace, steps=[replace(x, node_draws=draws) if x is st_ else x for x in trace.steps])
    rep = judge_trace(bad, s, "bf16-bad-draw", mode="replay")
    found = [f for f in rep.failures if f.request_id == st_.request_id and f.step == st_.step]
    assert ("sampling", node) in {(f.category, f.node) for f in found}
    assert not any(f.category == "sampling" and f.verdict.value == "triaged" and f.request_id == st_.request_id
                   for f in rep.findings)
