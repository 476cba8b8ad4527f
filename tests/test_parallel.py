"""Data-parallel diffs: splitting prompts over processes gives the same trace and the same verdicts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, UsageError
from refcheck.goldens import REPO_GOLDEN
from refcheck.parallel import merge_traces, shard_device, split
from refcheck.trace.io import read_trace


def test_split_round_robin_and_devices():
    assert split(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert split([1], 4) == [[1]]
    with pytest.raises(UsageError):
        split([1, 2], 0)
    assert shard_device("cuda", 1) == "cuda:1" and shard_device("cuda:0", 2) == "cuda:2" and shard_device("cpu", 3) == "cpu"


def test_merge_traces_restores_order_and_refuses_mixed_provenance():
    t = read_trace(REPO_GOLDEN / "hybrid-b15.arrow")
    ids = [r.request_id for r in t.requests]
    shards = []
    for part in split(ids, 2):
        shards.append(dataclasses.replace(t, requests=[r for r in t.requests if r.request_id in part],
                                          steps=[s for s in t.steps if s.request_id in part]))
    merged = merge_traces(shards, ids)
    assert [r.request_id for r in merged.requests] == ids
    assert [(s.request_id, s.step) for s in merged.steps] == [(s.request_id, s.step) for s in t.steps]
    other = dataclasses.replace(shards[1], provenance={**shards[1].provenance, "budget": 64})
    with pytest.raises(UsageError, match="budget"):
        merge_traces([shards[0], other], ids)


def _normalised(path):
    t = read_trace(path)
    for k in ("created", "workers"):
        t.provenance.pop(k, None)
    return t


@pytest.mark.parametrize("engine, code", [("reference", EXIT_PASS), ("fault:state-flat-index", EXIT_MISMATCH)])
def test_two_workers_equal_one(cli, tmp_path, engine, code):
    from refcheck.prompts import BUILTIN_PROMPTS

    # three of the built-in prompts: split over two workers as [0, 2] and [1], so the merge has to
    # interleave the shards back into prompt order
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(Path(BUILTIN_PROMPTS).read_text().splitlines(keepends=True)[:3]))
    results = {}
    for w in (1, 2):
        out = tmp_path / f"w{w}.arrow"
        rc, stdout, err = cli("diff", "--engine", engine, "--drafter", "scripted", "--max-new-tokens", "12",
                              "--prompts", str(prompts), "--workers", str(w), "--save-trace", str(out), "--json")
        assert rc == code, err
        rep = json.loads(stdout)["reports"][0]
        results[w] = (rep, _normalised(out))
    (r1, t1), (r2, t2) = results[1], results[2]
    assert r1["counts"] == r2["counts"] and r1["checks"] == r2["checks"]
    assert r1["first_divergence"] == r2["first_divergence"]
    # Same findings (verdict, category, place). Numbers in the details may differ in the last bits on
    # CPU: a worker runs with fewer threads, so reductions are ordered differently.
    def key(f):
        return json.dumps([f["verdict"], f["category"], f["request_id"], f["step"], f["node"], f["layer"]])

    assert sorted(map(key, r1["findings"])) == sorted(map(key, r2["findings"]))
    assert t1.provenance == t2.provenance
    assert [r.request_id for r in t2.requests] == [r.request_id for r in t1.requests] and len(t2.requests) == 3
    assert [r.output_ids for r in t1.requests] == [r.output_ids for r in t2.requests]
    assert [(s.request_id, s.step, s.tree_tokens, s.accepted) for s in t1.steps] == \
        [(s.request_id, s.step, s.tree_tokens, s.accepted) for s in t2.steps]


def test_gate_with_workers(cli):
    rc, stdout, err = cli("gate", "--workers", "2", "--case", "hybrid-b1", "--case", "attention-b15", "--json")
    assert rc == EXIT_PASS, err
    assert [r["case"] for r in json.loads(stdout)["reports"]] == ["hybrid-b1", "attention-b15"]


def test_thread_share_is_capped_by_omp_num_threads(monkeypatch):
    from refcheck import parallel

    monkeypatch.setattr(parallel, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [parallel.thread_share(w) for w in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # e.g. one of several test or CI processes on the host
    assert [parallel.thread_share(w) for w in (1, 2, 4)] == [3, 3, 2]
    for junk in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert parallel.thread_share(2) == 4


def test_a_live_diff_run_inline_keeps_the_callers_thread_count(cli, tmp_path, monkeypatch):
    """`refcheck diff --engine` with one worker runs in this process: it takes its share of the cores
    while it runs and gives the old count back (a test process left at two threads oversubscribed the
    cores for every test after it)."""
    import torch

    from refcheck import parallel

    seen = []
    real = parallel.live_trace
    monkeypatch.setattr(parallel, "usable_cpus", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(parallel, "live_trace", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [30, 31, 32, 33]}\n')
    torch.set_num_threads(1)
    rc, _, err = cli("diff", "--engine", "reference", "--drafter", "scripted", "--prompts", str(prompts),
                     "--max-new-tokens", "4", "--mode", "replay")
    assert rc == EXIT_PASS, err
    assert seen == [2] and torch.get_num_threads() == 1
