"""The reference pool (refcheck/pool.py) and the judge it serves (refcheck/diff/judge.py).

* One runner per model, numerics, drafter and seed: two traces of the same model, recorded at different budgets
  and token limits, are judged on one load, the runner's spec set to each trace's.
* The judge loads nothing itself: every model load of a judgement happens inside the pool's ``load``, and a pool
  that has loaded the model is used as it is (a pool subclass counts the loads).
* The pool's input checks come before any reference work, and a mode the judge does not know is refused before the
  pool is asked for anything.
"""

from __future__ import annotations

import dataclasses

import pytest

from refcheck.diff.judge import MODES, judge
from refcheck.errors import UsageError
from refcheck.pool import ReferencePool, reference_spec_for
from refcheck.profile import Profile
from refcheck.prompts import load_prompts
from refcheck.reference_runner import ReferenceRunner
from refcheck.spec import EngineSpec
from refcheck.trace.rows import Trace
from refcheck.trace.schema import TraceValidationError

pytestmark = pytest.mark.xdist_group("pool")


class CountingPool(ReferencePool):
    """A reference pool that records each load (the spec's model label) and whether one is under way."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []
        self.loading = False

    def load(self, spec: EngineSpec) -> ReferenceRunner:
        self.loads.append(spec.model_label)
        self.loading = True
        try:
            return super().load(spec)
        finally:
            self.loading = False


@pytest.fixture(scope="module")
def traces() -> tuple[Trace, Trace]:
    """Two reference traces of the built-in hybrid pair, scripted drafter: budget 4 with 6 new tokens, budget 2
    with 8."""
    pool = ReferencePool()
    prompts = load_prompts()[:1]
    a, _ = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=4, max_new_tokens=6)).trace(prompts)
    b, _ = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=2, max_new_tokens=8)).trace(prompts)
    return a, b


def test_two_traces_of_one_model_share_one_load(traces: tuple[Trace, Trace]) -> None:
    a, b = traces
    pool = CountingPool()
    prof = Profile()
    with prof.active():
        ra = pool.runner_for(a, "a")
        assert (ra.spec.budget, ra.spec.max_new_tokens) == (4, 6)
        rb = pool.runner_for(b, "b")
    assert rb is ra and (rb.spec.budget, rb.spec.max_new_tokens) == (2, 8)
    assert pool.loads == [reference_spec_for(a).model_label] and prof.counts["runner_loads"] == 1
    assert "load_models" in prof.wall


def test_the_judge_loads_no_model_itself(traces: tuple[Trace, Trace], monkeypatch: pytest.MonkeyPatch) -> None:
    import refcheck.reference_runner as reference_runner

    pool = CountingPool()
    real = reference_runner.load_pair

    def load_pair(spec: EngineSpec):  # type: ignore[no-untyped-def]
        assert pool.loading, "a model was loaded outside the pool"
        return real(spec)

    monkeypatch.setattr(reference_runner, "load_pair", load_pair)
    reports = [judge(t, pool, name, mode="both", strict_acceptance=True) for name, t in zip("ab", traces)]
    assert [r.verdict for r in reports] == ["pass", "pass"] and [r.case for r in reports] == ["a", "b"]
    assert len(pool.loads) == 1
    again = judge(traces[0], pool, "a", mode="both", strict_acceptance=True)
    assert len(pool.loads) == 1
    assert (again.counts, [f.to_json() for f in again.findings]) == (reports[0].counts,
                                                                     [f.to_json() for f in reports[0].findings])


def test_a_token_outside_the_vocabulary_is_refused_before_reference_work(traces: tuple[Trace, Trace]) -> None:
    a, _ = traces
    pool = CountingPool()
    vocab = pool.runner_for(a, "a").target.vocab_size
    bad = dataclasses.replace(a, requests=[dataclasses.replace(a.requests[0], output_ids=[vocab])])
    with pytest.raises(TraceValidationError, match="bad.*outside the vocabulary"):
        judge(bad, pool, "bad")
    assert not pool._decodes and all(m.forwards == 0 for m in pool._memos.values())


def test_an_unknown_mode_is_refused_before_the_pool_is_asked(traces: tuple[Trace, Trace]) -> None:
    pool = CountingPool()
    with pytest.raises(UsageError, match="unknown diff mode 'sideways'"):
        judge(traces[0], pool, "a", mode="sideways")
    assert pool.loads == [] and MODES == ("replay", "free", "both")
