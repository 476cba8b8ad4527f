"""The SGLang engine's process, driven by the runner against the stand-in SGLang (tests/fake_sglang, the
``fake_sglang`` fixture): outputs becoming the trace, the timing passes on the warm engine, several workloads in turn
on one engine, and how a start-up failure, a crash or a hang reaches each workload's trace
(refcheck/sglang/runner.py, refcheck/sglang/engine_process.py, refcheck/sglang/child.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from refcheck.errors import UsageError
from refcheck.sglang.child import summarise_error


def test_error_summary_keeps_the_end_of_long_messages():
    exc = RuntimeError("\n".join(f"line {i}" for i in range(40)) + "\nValueError: weight shape mismatch")
    s = summarise_error(exc)
    assert "weight shape mismatch" in s and "line 0" not in s and len(s) <= 600
    assert json.dumps(s)


def test_engine_process_outputs_become_the_trace(fake_sglang):
    from refcheck.prompts import load_prompts

    prompts = load_prompts()[:2]
    trace = fake_sglang("ok", capture=False).trace(prompts)
    assert [r.output_ids for r in trace.requests] == [[p.prompt_ids[-1]] * 3 for p in prompts]
    assert trace.provenance["engine"]["version"] == "0.0-fake" and not trace.provenance["capture"]["crash"]


@pytest.mark.parametrize("mode", ["ok", "drift"])
def test_timing_repeats_run_on_the_warm_engine_and_are_checked_against_the_capture(fake_sglang, mode):
    """--repeats of an SGLang sweep: k more untraced generates after the captured one, each timed and
    compared with the captured tokens (a nondeterministic engine is reported, not averaged over)."""
    from refcheck.prompts import load_prompts

    prompts = load_prompts()[:2]
    trace = fake_sglang(mode, capture=False, timing_repeats=3).trace(prompts)
    settings = trace.provenance["engine"]["settings"]
    assert len(settings["repeat_generate_s"]) == 3 and all(t >= 0 for t in settings["repeat_generate_s"])
    assert settings["repeats_match"] is (mode == "ok")
    assert [r.output_ids for r in trace.requests] == [[p.prompt_ids[-1]] * 3 for p in prompts]  # the captured run
    with pytest.raises(UsageError, match="timing repeats"):
        fake_sglang("ok", timing_repeats=-1)
    for bad in (0.0, -5.0):
        with pytest.raises(UsageError, match="timing rounds' budget"):
            fake_sglang("ok", timing_repeats=3, timing_budget_s=bad)
    spent = fake_sglang(mode, capture=False, timing_repeats=6, timing_budget_s=1e-9).trace(prompts)
    assert len(spent.provenance["engine"]["settings"]["repeat_generate_s"]) == 3  # the budget spent: the minimum
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="timing rounds' end"):
            fake_sglang("ok", timing_repeats=3, timing_until_s=bad)
    ended = fake_sglang(mode, capture=False, timing_repeats=6, timing_until_s=time.time() - 1).trace(prompts)
    assert ended.provenance["engine"]["settings"]["repeat_generate_s"] == []  # the end passed: no round, no minimum


def test_a_sampled_timing_rule_adds_sampled_and_full_capture_passes_to_each_timing_round(fake_sglang, tmp_path):
    """scripts/capture_cost.py's passes: with a sampled timing rule every timing round holds an untraced, a sampled
    and a full-capture pass, each under rids of its own (marked with its rule), all timed and checked against the
    captured tokens; without full timing, no full-capture pass; without a rule, only the untraced passes run."""
    from refcheck.prompts import load_prompts
    from refcheck.sglang.capture.sample_rule import SampleRule, rule_for

    prompts = load_prompts()[:2]
    settings = fake_sglang("ok", timing_repeats=2, sampled_timing="16:3").trace(prompts).provenance["engine"]["settings"]
    assert [len(settings[k]) for k in ("repeat_generate_s", "sampled_generate_s", "full_generate_s")] == [2, 2, 2]
    assert settings["repeats_match"] is True and settings["sampled_match"] is True and settings["full_match"] is True
    job = json.loads((tmp_path / "ok" / "job.json").read_text())
    rids = [r for kind in ("timing_rids", "sampled_rids", "full_rids") for p in job[kind] for r in p] + job["rids"]
    assert len(set(rids)) == len(rids) == 14
    assert {rule_for(r, SampleRule(7)) for p in job["sampled_rids"] for r in p} == {SampleRule(16, 3)}
    assert {rule_for(r, SampleRule(7)) for p in job["full_rids"] for r in p} == {SampleRule(1, 0)}
    lean = fake_sglang("ok", timing_repeats=2, sampled_timing="16:3", full_timing=False).trace(prompts)
    settings = lean.provenance["engine"]["settings"]
    assert [len(settings[k]) for k in ("repeat_generate_s", "sampled_generate_s", "full_generate_s")] == [2, 2, 0]
    assert json.loads((tmp_path / "ok" / "job.json").read_text())["full_rids"] == []
    plain = fake_sglang("drift", timing_repeats=1).trace(prompts).provenance["engine"]["settings"]
    assert plain["sampled_generate_s"] == plain["full_generate_s"] == [] and plain["full_match"] is None
    assert plain["repeats_match"] is False


def test_engine_start_failure_is_a_model_error_with_the_scheduler_message(fake_sglang):
    from refcheck.errors import ModelError
    from refcheck.prompts import load_prompts

    with pytest.raises(ModelError, match="gemma_rmsnorm failed to dispatch"):
        fake_sglang("start_fail").trace(load_prompts()[:1])


def test_engine_crash_mid_run_keeps_a_partial_trace_and_is_reported(fake_sglang):
    from refcheck.diff.findings import Report
    from refcheck.diff.trace_verdicts import capture_findings
    from refcheck.prompts import load_prompts

    runner = fake_sglang("crash")
    trace = runner.trace(load_prompts()[:2])
    cap = trace.provenance["capture"]
    assert "illegal memory access" in cap["crash"] and len(cap["incomplete"]) == 2
    assert Path(cap["partial_trace"]).is_file()
    rep = Report("x", "replay")
    capture_findings(rep, trace)
    assert any("incomplete" in f.message for f in rep.failures)


def test_engine_hang_times_out(fake_sglang, monkeypatch, tmp_path):
    """A hung engine is a reported crash, and its whole session ends with it (the stand-in scheduler too)."""
    from process_kit import alive

    from refcheck.prompts import load_prompts

    monkeypatch.setenv("FAKE_SGLANG_SCHEDULER_PID", str(tmp_path / "scheduler.pid"))
    trace = fake_sglang("hang", timeout_s=5).trace(load_prompts()[:1])
    assert "timed out" in trace.provenance["capture"]["crash"]
    assert not alive(int((tmp_path / "scheduler.pid").read_text()))


def test_first_differences_name_the_request_position_and_both_tokens():
    from refcheck.sglang.child import first_differences

    captured = [[1, 2, 3], [4, 5], [6, 7]]
    assert first_differences(captured, [[1, 2, 9], [4, 5], [6]]) == [[0, 2, 3, 9], [2, 1, 7, -1]]
    assert first_differences(captured, captured) == []
    assert first_differences([[1]], [[1, 8]]) == [[0, 1, -1, 8]]


def test_workloads_run_in_turn_on_one_engine_each_with_its_own_job_result_and_trace(fake_sglang, tmp_path):
    """traces(): one engine start for every workload. The drifting stand-in answers each generate with a shift of the
    calls it has served, so the second workload's captured pass shows the first's calls (one engine, not two). Each
    workload has its own directory with its job and result, its own rids, timing passes and trace."""
    from refcheck.prompts import load_prompts
    from refcheck.prompts.workloads import workload

    one, mixed = load_prompts()[:1], list(workload("mixed"))[:3]
    runner = fake_sglang("drift", capture=False, timing_repeats=2)
    first, second = runner.traces([one, mixed], [tmp_path / "b"])
    assert [r.output_ids for r in first.requests] == [[one[0].prompt_ids[-1]] * 3]
    # part 0: the captured pass and two untraced ones (3 calls); part 1's captured pass is the engine's 4th generate
    assert [set(r.output_ids) for r in second.requests] == [{p.prompt_ids[-1] + 3} for p in mixed]
    top = json.loads((tmp_path / "drift" / "job.json").read_text())
    assert top["more"] == [str(tmp_path / "b" / "job.json")] and "engine_kwargs" in top
    part = json.loads((tmp_path / "b" / "job.json").read_text())
    assert part["result"] == str(tmp_path / "b" / "result.json") and "engine_kwargs" not in part
    assert part["engine_job"] == str(tmp_path / "drift" / "job.json")
    assert not set(top["rids"]) & set(part["rids"]) and len(part["timing_rids"]) == 2
    s1, s2 = (t.provenance["engine"]["settings"] for t in (first, second))
    assert s1["engine_start_s"] == s2["engine_start_s"] and len(s2["repeat_generate_s"]) == 2
    assert len(s1["repeat_generate_s"]) == 2
    default = fake_sglang("ok", capture=False).traces([one, one])
    assert len(default) == 2 and (tmp_path / "ok" / "part1" / "result.json").is_file()
    with pytest.raises(UsageError, match="2 workloads need 1 part directories, got 2"):
        runner.traces([one, one], [tmp_path / "c", tmp_path / "d"])
    with pytest.raises(UsageError, match="2 workloads need 1 part directories, got 0"):
        runner.traces([one, one], [])
    with pytest.raises(UsageError, match="--capture-max-mb bounds the records of one engine"):
        fake_sglang("ok", capture_max_mb=2).traces([one, one])


def test_a_failure_reaches_every_workload_of_the_engine(fake_sglang):
    """A start-up failure is every workload's ModelError; a crash in the first workload leaves both traces partial,
    the second reporting that the engine ended before it began."""
    from refcheck.errors import ModelError
    from refcheck.prompts import load_prompts

    prompts = load_prompts()[:2]
    with pytest.raises(ModelError, match="gemma_rmsnorm failed to dispatch"):
        fake_sglang("start_fail").traces([prompts[:1], prompts])
    first, second = fake_sglang("crash").traces([prompts[:1], prompts])
    assert "illegal memory access" in first.provenance["capture"]["crash"]
    assert "ended before this part began" in second.provenance["capture"]["crash"]
    assert len(second.provenance["capture"]["incomplete"]) == 2


def test_a_later_workload_that_hangs_is_timed_out_with_its_own_error_not_the_earlier_ones(fake_sglang):
    """The first workload's generate fails (its scheduler error in the shared log) and the engine goes on to the
    second, which hangs: the first reports its own error, the second the timeout, not the first's error."""
    from refcheck.prompts import load_prompts

    prompts = load_prompts()[:2]
    first, second = fake_sglang("first_fails_second_hangs", capture=False, timeout_s=8).traces([prompts[:1], prompts])
    assert "part0 bad request" in first.provenance["capture"]["crash"]
    assert "timed out after 8 s" in second.provenance["capture"]["crash"]
    assert "part0" not in second.provenance["capture"]["crash"]


def test_each_part_of_an_engine_times_its_rounds_in_an_equal_share_of_the_time_left():
    """child.part_until: with k parts left, a part's rounds end by now + (until - now) / k, taken as the part begins;
    the last part, or no end, keeps the job's until; an end already passed gives no rounds (now)."""
    from refcheck.sglang.child import part_until

    assert part_until(None, 40.0, 2) is None
    assert part_until(100.0, 40.0, 2) == 70.0 and part_until(100.0, 40.0, 3) == 60.0
    assert part_until(100.0, 40.0, 1) == 100.0
    assert part_until(100.0, 120.0, 2) == 120.0


def test_the_engine_process_shares_its_rounds_time_among_its_parts(tmp_path, monkeypatch):
    """child.main over two parts on one engine, every generate taking one second of a stand-in clock and 100 s to
    the job's end: each part gets half, its warm-up and captured pass (2 s) out of its own, and rounds in the rest
    (the first part does not spend the second's time)."""
    from refcheck.sglang import child

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_sglang"))
    monkeypatch.setenv("FAKE_SGLANG_MODE", "ok")
    monkeypatch.delenv("REFCHECK_CAPTURE_DIR", raising=False)
    monkeypatch.setattr(child, "_end_with_the_runner", lambda: None)
    clock = [1000.0]

    def one_second(engine, job, rids):
        clock[0] += 1.0
        return [{"output_ids": [7]} for _ in rids]

    monkeypatch.setattr(child, "generate", one_second)
    monkeypatch.setattr(child.time, "time", lambda: clock[0])
    monkeypatch.setattr(child.time, "perf_counter", lambda: clock[0])
    jobs, results = [tmp_path / f"job{k}.json" for k in (0, 1)], [tmp_path / f"result{k}.json" for k in (0, 1)]
    for k in (0, 1):
        part = {"result": str(results[k]), "input_ids": [[1]], "sampling_params": [{}], "rids": [f"r{k}"],
                "warmup_rids": [f"w{k}"], "timing_rids": [[f"u{k}-{i}"] for i in range(500)], "timing_until": 1100.0}
        jobs[k].write_text(json.dumps({**({"engine_kwargs": {}, "more": [str(jobs[1])]} if k == 0 else {}), **part}))
    assert child.main(str(jobs[0])) == 0
    rounds = [len(json.loads(r.read_text())["repeat_generate_s"]) for r in results]
    assert all(45 <= n <= 49 for n in rounds), rounds


def test_each_part_reads_its_own_stretch_of_the_engine_log(tmp_path):
    """engine_process.outcome over a stand-in log of two parts: a part that hung reports the timeout, not the earlier
    part's error; a marker printed after a line left open still starts the part's stretch; a part whose process died
    with the cause printed before its marker takes the log's last error; a start-up failure written to a later part
    reads the whole log's (the scheduler's traceback)."""
    from refcheck.sglang.child import PART_MARKER
    from refcheck.sglang.engine_process import log_error, outcome

    log, r0, r1 = tmp_path / "engine.log", tmp_path / "r0.json", tmp_path / "r1.json"
    log.write_text(f"start-up\n{PART_MARKER.format(0)}\nValueError: part0 bad request\n"
                   f"a progress bar left open{PART_MARKER.format(1)}\nstill going\n")
    r0.write_text(json.dumps({"stage": "failed", "failed_at": "generate", "error": "ValueError: part0 bad request"}))
    r1.write_text(json.dumps({"stage": "started", "start_s": 3.0}))
    assert log_error(log, part=1) is None and log_error(log, part=0) == "ValueError: part0 bad request"
    first = outcome(r0, "timed out after 8 s", log, timed_out=True)
    assert outcome(r1, "timed out after 8 s", log, first, 1, timed_out=True)["error"] == "timed out after 8 s"
    died = outcome(r1, "engine process exited with code -9", log, first, 1, timed_out=False)
    assert died["error"] == "ValueError: part0 bad request"  # the cause, printed before the part's marker
    log.write_text("Traceback (most recent call last):\nRuntimeError: gemma_rmsnorm failed to dispatch data type Float\n")
    for r in (r0, r1):
        r.write_text(json.dumps({"stage": "failed", "failed_at": "start", "error": "RuntimeError: Initialization failed."}))
    assert "gemma_rmsnorm" in outcome(r1, "engine process exited with code 4", log, None, 1)["error"]
