"""Live SGLang, slice "dflash": DFLASH with and without capture, and a scheduler killed mid-run (markers
``sglang`` and ``gpu``; skipped without a GPU and SGLang).

On the H200: ``scripts/sglang_bundle.sh run python3 -m pytest -m sglang tests/test_gpu_sglang_dflash.py``
(``scripts/gpu_tests.sh`` runs every slice). Three engine runs on the built-in hybrid pair, bf16.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from gpu_sglang_kit import diff_on_gpu, hybrid_spec, logits_failures_rare, structural_failures

from refcheck.errors import EXIT_MISMATCH
from refcheck.prompts import load_prompts
from refcheck.sglang.capture.segments import scan, segment_files
from refcheck.sglang.runner import SGLangRunner
from refcheck.trace.io import read_trace

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    """The captured run's trace and its capture directory, and the run without capture's trace."""
    prompts = load_prompts()
    cdir = tmp_path_factory.mktemp("dflash-capture")
    with_capture = SGLangRunner(hybrid_spec(), "DFLASH", capture_dir=cdir).trace(prompts)
    without = SGLangRunner(hybrid_spec(), "DFLASH", capture=False).trace(prompts)
    return with_capture, without, cdir / "records"


@pytest.fixture(scope="module")
def dflash_traces(dflash_run):
    return dflash_run[:2]


def test_the_capture_directory_alone_gives_the_driven_runs_requests(dflash_run):
    """refcheck/sglang/served.py on the captured run's directory, as if a server refcheck did not start had written
    it: every request's prompt is the driven run's, its output agrees with the driven output where both have tokens,
    its steps are the driven trace's, the records' contexts agree with the generate results, and the diff finds no
    structural or state failure."""
    from refcheck.sglang.served import served_trace

    driven, _, records = dflash_run
    assert not [p for p in driven.provenance["capture"]["problems"] if "context its records carry" in p]
    served = served_trace(records).assembly.trace
    by_rid = {r.request_id.split("-", 3)[3]: r for r in served.requests}  # runner rids: refcheck-PID-I-PROMPT
    assert sorted(by_rid) == sorted(r.request_id for r in driven.requests)
    for r in driven.requests:
        s = by_rid[r.request_id]
        n = min(len(s.output_ids), len(r.output_ids))
        assert s.prompt_ids == r.prompt_ids and s.output_ids[:n] == r.output_ids[:n] and n > 0
    driven_steps = {(r.request_id, s.step) for r in driven.requests for s in driven.steps_of(r.request_id)}
    served_steps = {(s.request_id.split("-", 3)[3], s.step) for s in served.steps}
    assert served_steps and served_steps <= driven_steps
    rep = diff_on_gpu(served, "sglang-dflash-served", mode="replay")
    assert not structural_failures(rep), structural_failures(rep)


def test_capture_does_not_change_tokens(dflash_traces):
    with_capture, without = dflash_traces
    assert [r.output_ids for r in with_capture.requests] == [r.output_ids for r in without.requests]
    assert not with_capture.provenance["capture"]["errors"], with_capture.provenance["capture"]["errors"]
    assert with_capture.provenance["capture"]["stats"]["steps"] > 0


def test_dflash_replay_has_no_structural_or_state_failure(dflash_traces):
    rep = diff_on_gpu(dflash_traces[0], "sglang-dflash", mode="replay")
    assert not structural_failures(rep), structural_failures(rep)
    assert logits_failures_rare(rep)


def _kill_after(records: Path, count: int, killed: dict[str, int], done: threading.Event) -> None:
    """SIGKILL the first scheduler whose record directory under ``records`` holds ``count`` batch records
    (``refcheck.sglang.capture.records.Recorder``'s frames), until ``done`` is set."""
    while not done.is_set() and not killed:
        for d in records.glob("rank0-pid*"):
            n = sum(len(scan(f).frames) for f in segment_files(d, "records"))
            if n >= count:
                pid = int(d.name.split("-pid", 1)[1])
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, records=n)
        time.sleep(0.02)


def test_scheduler_killed_mid_run_keeps_the_partial_trace_and_fails(tmp_path):
    """SIGKILL the scheduler once it has captured 20 batch records: the steps captured so far come back as
    a (checksummed) partial trace, the crash is in the provenance, and the diff fails (exit 1)."""
    runner = SGLangRunner(hybrid_spec(max_new_tokens=256), "DFLASH", capture_dir=tmp_path, timeout_s=300)
    killed: dict[str, int] = {}
    done = threading.Event()
    killer = threading.Thread(target=_kill_after, args=(tmp_path / "records", 20, killed, done))
    killer.start()
    try:
        trace = runner.trace(load_prompts())
    finally:
        done.set()
        killer.join()
    assert killed, "the scheduler finished before 20 step records were captured"
    cap = trace.provenance["capture"]
    assert cap["crash"], cap
    partial = read_trace(Path(cap["partial_trace"]))
    assert partial.checksummed and 0 < len(partial.steps)
    assert len(partial.steps) <= sum(p.max_new_tokens or 256 for p in load_prompts())
    rep = diff_on_gpu(trace, "sglang-killed", mode="replay")
    assert rep.exit_code == EXIT_MISMATCH
    assert any("incomplete" in f.message or f.category == "engine" for f in rep.failures)
