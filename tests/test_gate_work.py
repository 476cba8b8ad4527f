"""The gate's own work: profiles, work shared between cases, cases over processes, the report cache."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from ddtree_reference.oracle import GreedyMemo, greedy_decode
from ddtree_reference.scripted import ScriptedDrafter
from refcheck.goldens import GOLDEN_CASES, REPO_GOLDEN, GoldenCase
from refcheck.goldens.cache import ReportCache, package_roots, report_from_json, source_digest
from refcheck.goldens.gate import cached_gate_case, gate
from refcheck.goldens.manifest import load_manifest
from refcheck.goldens.regen import regenerate
from refcheck.goldens.schedule import estimated_cost, gate_jobs
from refcheck.parallel import run_queue
from refcheck.pool import ReferencePool
from refcheck.profile import Profile, case_rows, count, phase, phase_rows, timed


def test_profile_phases_are_exclusive_and_nest():
    prof = Profile()

    @timed("inner", counter="inner_calls")
    def inner() -> None:
        time.sleep(0.02)

    with prof.active():
        with phase("outer"):
            time.sleep(0.02)
            inner()
            inner()
            count("things", 3)
    assert prof.counts == {"inner_calls": 2, "things": 3}
    assert 0.035 <= prof.wall["inner"] < 0.2 and 0.015 <= prof.wall["outer"] < 0.1  # outer pauses while inner runs
    inner()  # no active profile: nothing recorded
    assert prof.counts["inner_calls"] == 2
    cols, rows = case_rows({"a": prof, "b": prof})
    assert cols[-2:] == ["steps", "forwards"] and [r[0] for r in rows] == ["a", "b", "total"]
    assert float(rows[2][cols.index("other")]) == pytest.approx(2 * (prof.wall["inner"] + prof.wall["outer"]), abs=0.02)
    assert [r[0] for r in phase_rows({"a": prof})[1]] == ["inner", "outer"]  # costliest first
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    again.merge(prof)
    assert again.counts == {"inner_calls": 4, "things": 6} and again.wall["inner"] == pytest.approx(2 * prof.wall["inner"], abs=1e-3)


def _square(x: int) -> tuple[int, int]:
    import os

    return x * x, os.getpid()


def _slow_square(x: int) -> tuple[int, int]:
    time.sleep(0.3)  # long enough that the worker's feeder takes a job before this process drains the queue
    return _square(x)


def _fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


def test_run_queue_runs_every_job_once_in_this_process_and_the_workers():
    import os

    jobs = [(i,) for i in range(6)]
    finished: list[int] = []
    got = run_queue(_square, jobs, 2, inline=_slow_square, on_result=lambda i, r: finished.append(i))
    assert [r for r, _ in got] == [i * i for i in range(6)]  # results in job order
    assert sorted(finished) == list(range(6))  # each job reported as it finished, once
    assert len({pid for _, pid in got}) == 2 and os.getpid() in {pid for _, pid in got}
    assert run_queue(_square, [(4,)], 4, inline=lambda x: (x, 0)) == [(4, 0)]  # one job: here
    with pytest.raises(ValueError, match="three"):
        run_queue(_fail_on_three, [(i,) for i in range(5)], 2, inline=_fail_on_three)


def test_gate_jobs_keep_shared_work_together_costliest_first():
    manifest = load_manifest(REPO_GOLDEN)
    names = sorted(manifest.cases)
    jobs = gate_jobs(manifest, names)
    assert sorted(n for job in jobs for n in job) == names
    # the three SGLang budget-15 DFlash/DDTree traces share their reference runs: one job
    job_of = {n: i for i, job in enumerate(jobs) for n in job}
    assert job_of["sglang-hybrid-dflash-b15"] == job_of["sglang-hybrid-dflash-tp2"] == job_of["sglang-hybrid-ddtree-b15"]
    assert job_of["sglang-hybrid-ngram-b11"] == job_of["sglang-hybrid-ngram-b11-breadth1-leak"]
    costs = [sum(estimated_cost(manifest.cases[n]) for n in job) for job in jobs]
    # costliest first: the three 768-token NGRAM traces sampled with the tree sampler's coins (one sampling setting)
    assert costs == sorted(costs, reverse=True) and job_of["sglang-hybrid-ngram-b11-t07"] == 0


def test_greedy_memo_equals_the_oracle_and_runs_each_sequence_once(attention):
    """The memo's continuations are greedy_decode's, token for token (stop tokens too), and a
    continuation asked again, or a shorter one, or one from a later point of it, runs no forward."""
    target, _ = attention
    memo = GreedyMemo(target.model)
    prompt = [1, 5, 9, 2]
    full = greedy_decode(target.model, prompt, 12)
    assert memo.decode(prompt, 12) == full and memo.forwards == 12
    assert memo.decode(prompt, 5) == full[:5] and memo.decode(prompt + full[:4], 8) == full[4:12]
    assert memo.forwards == 12
    stop = {full[4]}
    assert memo.decode(prompt, 9, stop) == greedy_decode(target.model, prompt, 9, stop) == full[:5]
    other = [3, 3, 7]
    assert memo.decode(other, 3) == greedy_decode(target.model, other, 3) and memo.forwards == 15


def test_scripted_drafter_with_a_memo_drafts_the_same(hybrid):
    target, _ = hybrid
    plain = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, seed=3)
    memo = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, seed=3, oracle=GreedyMemo(target.model))
    for d in (plain, memo):
        d.extend(torch.zeros(0), torch.zeros(0), torch.tensor([4, 8, 15, 16]))
    for bonus, start in ((23, 4), (42, 5), (23, 4)):
        assert torch.equal(plain.propose(bonus, start), memo.propose(bonus, start))
    assert memo.oracle.forwards == 2 * 15  # the repeated proposal ran nothing


@pytest.fixture
def tiny_golden(tmp_path, monkeypatch) -> Path:
    """A golden dir with one small reference case, written by the real regen workflow."""
    gdir = tmp_path / "golden"
    monkeypatch.setitem(GOLDEN_CASES, "tiny", GoldenCase("tiny", "attention", 4, max_new_tokens=5))
    regenerate(gdir, ["tiny"], "test", True, ReferencePool())
    return gdir


def test_source_digest_covers_every_file_of_the_packages(tmp_path):
    roots = package_roots()
    assert [r.name for r in roots] == ["refcheck", "ddtree_reference"]
    assert any(p.name == "target.py" for p in roots[1].iterdir())  # the reference's code, not a copy
    copy = tmp_path / "ddtree_reference"
    shutil.copytree(roots[1], copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_digest((roots[0], copy))
    assert before == source_digest(roots)
    (copy / "target.py").write_text((copy / "target.py").read_text() + "\n# a change\n")
    assert source_digest((roots[0], copy)) != before
    (copy / "data.bin").write_bytes(b"\0")  # any file, not only Python
    assert len({before, source_digest((roots[0], copy))}) == 2


def test_report_cache_hits_and_a_changed_reference_misses(tmp_path, tiny_golden):
    """A cached report is the stored one, and is used only while the key holds: after a change of
    the reference's code the case is diffed again (its steps replayed, its forwards run)."""
    case, gdir = "tiny", tiny_golden
    cache_dir = tmp_path / "cache"

    def run() -> tuple[dict, Profile]:
        profiles: dict[str, Profile] = {}
        reps = gate(gdir, ReferencePool(), profiles=profiles, cache_dir=cache_dir)
        return json.loads(json.dumps(reps[0].to_json(), default=str)), profiles[case]

    first, p1 = run()
    assert p1.counts["cache_hits"] == 0 and p1.counts["steps_replayed"] > 0 and p1.forwards > 0
    assert len(list(cache_dir.iterdir())) == 1
    second, p2 = run()
    assert p2.counts["cache_hits"] == 1 and p2.forwards == 0 and second == first
    assert json.loads(json.dumps(report_from_json(first).to_json())) == first

    copy = tmp_path / "ddtree_reference"
    shutil.copytree(package_roots()[1], copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "decode.py").write_text((copy / "decode.py").read_text() + "\n# a change\n")
    changed = ReportCache(cache_dir, (package_roots()[0], copy))
    entry = load_manifest(gdir).cases[case]
    assert changed.get(entry) is None
    with Profile().active() as p3:
        third = cached_gate_case(case, entry, gdir, ReferencePool(), changed)
    assert p3.counts["cache_hits"] == 0 and p3.counts["steps_replayed"] == p1.counts["steps_replayed"]
    assert third.to_json()["counts"] == first["counts"] and len(list(cache_dir.iterdir())) == 2
