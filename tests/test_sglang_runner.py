"""The SGLang runner's CPU-testable parts: engine arguments, budgets, plugin discovery, refusals.

The capture path itself is tested against a reference-built fake SGLang in test_sglang_capture.py;
the live engine runs on the GPU machine only (tests marked ``sglang`` in tests/test_gpu_sglang_*.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from pathlib import Path

import pytest

from refcheck.errors import EXIT_USAGE, UsageError
from refcheck.models import builtin_pair
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.capture import versions
from refcheck.sglang.child import summarise_error
from refcheck.sglang.pair import draft_block_size, resolve_budget
from refcheck.sglang.runner import (
    PLUGIN_ENTRY,
    EngineUnavailableError,
    SGLangRunner,
    engine_kwargs,
    install_entry_point,
)


def test_engine_kwargs_for_clean_diffs():
    kw = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m")
    assert kw["skip_tokenizer_init"] and kw["attention_backend"] == "triton" and kw["disable_radix_cache"]
    assert kw["disable_overlap_schedule"] and kw["disable_cuda_graph"] and kw["page_size"] == 1
    assert "speculative_algorithm" not in kw and "base_gpu_id" not in kw
    dfl = engine_kwargs(EngineSpec(dtype="bfloat16", device="cuda:1"), "/m", "DFLASH", cuda_graphs=True, budget=15,
                        draft_path="/d")
    assert dfl["disable_cuda_graph"] is False and dfl["speculative_draft_model_path"] == "/d"
    assert dfl["base_gpu_id"] == 1 and dfl["linear_attn_backend"] == "triton"
    ng = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "NGRAM", budget=11, ngram_breadth=1)
    assert ng["speculative_num_draft_tokens"] == 12 and ng["speculative_ngram_max_bfs_breadth"] == 1
    tp = engine_kwargs(EngineSpec(dtype="bfloat16", device="cuda:1"), "/m", "DFLASH", budget=15, draft_path="/d", tp=2)
    assert tp["tp_size"] == 2 and tp["base_gpu_id"] == 2  # data-parallel worker 1 of TP-2 engines: GPUs 2, 3
    custom = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "MYTREE", budget=31, draft_path="/d")
    assert custom["speculative_algorithm"] == "MYTREE" and custom["speculative_num_draft_tokens"] == 32
    with pytest.raises(UsageError):
        engine_kwargs(EngineSpec(dtype="int8"), "/m")


def test_budgets_follow_the_algorithm():
    _, ddir = builtin_pair("hybrid")
    assert draft_block_size(ddir) == 16
    assert resolve_budget("NONE", 15, ddir) == 0
    assert resolve_budget("DFLASH", None, ddir) == resolve_budget("DFLASH", 15, ddir) == 15
    with pytest.raises(UsageError, match="block size 16"):
        resolve_budget("DFLASH", 64, ddir)
    with pytest.raises(UsageError, match="dflash_config"):
        resolve_budget("DFLASH", 15, None)
    assert resolve_budget("NGRAM", 7, None) == 7
    with pytest.raises(UsageError, match="--budget"):
        resolve_budget("NGRAM", None, None)


def test_entry_point_is_discoverable_and_inert_without_capture_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.delenv("REFCHECK_CAPTURE_DIR", raising=False)
    install_entry_point(tmp_path)
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.value.startswith("refcheck.")]
    assert eps, "the plugin entry point is not visible to importlib.metadata"
    register = eps[0].load()
    register()  # no SGLang here: no model to patch, and no capture dir: no hooks
    from refcheck.sglang import plugin
    from refcheck.sglang.capture import hooks

    assert plugin._registered and not hooks._originals
    assert str(tmp_path) in __import__("os").environ["PYTHONPATH"]


def test_the_runner_declares_the_entry_point_pyproject_declares():
    """SGLang's scheduler processes load the module the runner's dist-info names; an installed refcheck loads
    pyproject.toml's: both are refcheck.sglang.plugin:register."""
    assert PLUGIN_ENTRY == "refcheck = refcheck.sglang.plugin:register"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]\nrefcheck = "refcheck.sglang.plugin:register"' in pyproject


def test_versions_resolve_targets_and_bindings():
    assert versions.resolve("json.decoder.JSONDecoder.decode") is __import__("json").decoder.JSONDecoder.decode
    with pytest.raises((ImportError, AttributeError)):
        versions.resolve("refcheck.no_such_module.f")
    assert set(versions.HOOK_TARGETS) == {"run_batch", "eagle_sample", "dflash", "ddtree_sample", "sample", "verify_coins"}
    assert versions.patch_models() == [] or "sglang" in sys.modules  # nothing to patch without SGLang

    class Args:
        speculative_eagle_topk = 4

    class Sched:
        server_args = Args()

    assert versions.server_topk(Sched()) == 4


def test_runner_refuses_without_gpu_or_sglang():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(EngineUnavailableError, match="CUDA GPU"):
        SGLangRunner(EngineSpec(dtype="bfloat16"), "NONE")
    with pytest.raises(UsageError, match="block size"):
        SGLangRunner(EngineSpec(dtype="bfloat16", budget=63), "DFLASH")
    with pytest.raises(UsageError, match="mem-fraction must be between 0 and 1, got 1.5"):
        SGLangRunner(EngineSpec(dtype="bfloat16"), "NONE", mem_fraction=1.5)
    assert engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "NONE", False, 0.2)["mem_fraction_static"] == 0.2


def test_cli_sglang_unavailable_is_a_clear_usage_error(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = cli("diff", "--engine", "sglang", "--sglang-algorithm", "DFLASH", "--budget", "15", "--max-new-tokens", "4")
    assert code == EXIT_USAGE and "CUDA GPU" in err and "Traceback" not in err + out
    code, _, err = cli("diff", "--engine", "reference", "--sglang-algorithm", "DFLASH")
    assert code == EXIT_USAGE and "needs --engine sglang" in err
    code, _, err = cli("diff", "--engine", "reference", "--sglang-mem-fraction", "0.2")
    assert code == EXIT_USAGE and "engine reference takes no mem_fraction option (only sglang[:ALGORITHM] does)" in err
    code, _, err = cli("diff", "--engine", "fault:sibling-leak", "--cuda-graphs", "--layer-sketches")
    assert code == EXIT_USAGE and "takes no cuda_graphs, layer_sketches option" in err


def test_error_summary_keeps_the_end_of_long_messages():
    exc = RuntimeError("\n".join(f"line {i}" for i in range(40)) + "\nValueError: weight shape mismatch")
    s = summarise_error(exc)
    assert "weight shape mismatch" in s and "line 0" not in s and len(s) <= 600
    assert json.dumps(s)


@pytest.fixture
def fake_sglang(monkeypatch, tmp_path):
    """The runner against tests/fake_sglang (no GPU needed: the GPU check is patched)."""
    from pathlib import Path

    import torch

    fake = str(Path(__file__).parent / "fake_sglang")
    monkeypatch.syspath_prepend(fake)
    monkeypatch.setenv("PYTHONPATH", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def make(mode: str, **kw):
        monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
        return SGLangRunner(EngineSpec(dtype="bfloat16", device="cuda", max_new_tokens=3), "NONE",
                            capture_dir=tmp_path / mode, **kw)
    return make


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


def test_a_byte_budget_reaches_the_engine_and_the_trace(fake_sglang, tmp_path, monkeypatch):
    """--capture-max-mb: the engine's environment carries the budget in bytes and the trace names it; without one,
    a budget in the parent's environment does not leak into the engine; out of range is refused before any start."""
    from refcheck.prompts import load_prompts
    from refcheck.sglang.capture.byte_budget import ENV_MAX_BYTES

    monkeypatch.setenv(ENV_MAX_BYTES, "99")
    runner = fake_sglang("ok", capture_max_mb=2)
    assert runner._engine_env(tmp_path / "records")[ENV_MAX_BYTES] == str(2 << 20)
    assert ENV_MAX_BYTES not in fake_sglang("ok")._engine_env(tmp_path / "records")
    trace = runner.trace(load_prompts()[:1])
    assert trace.provenance["capture"]["max_bytes"] == 2 << 20
    with pytest.raises(UsageError, match=r"--capture-max-mb takes 1\.\.\d+ MiB, got 0"):
        fake_sglang("ok", capture_max_mb=0)
    from refcheck.sglang.capture.byte_budget import ENV_ROLL

    monkeypatch.setenv(ENV_ROLL, "1")
    assert ENV_ROLL not in runner._engine_env(tmp_path / "records")
    rolling = fake_sglang("ok", capture_max_mb=2, capture_roll=True)
    assert rolling._engine_env(tmp_path / "records")[ENV_ROLL] == "1"
    assert rolling.trace(load_prompts()[:1]).provenance["capture"]["roll"] is True
    with pytest.raises(UsageError, match="--capture-roll rolls the records within a byte budget"):
        fake_sglang("ok", capture_roll=True)


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


def test_an_earlier_runs_records_in_the_capture_dir_are_never_read_as_this_runs(fake_sglang, tmp_path):
    """A capture directory used before (a matrix cell resumed after its first engine was killed) keeps that
    engine's status and records; the next run clears them instead of reading two scheduler processes."""
    from refcheck.prompts import load_prompts

    stale = tmp_path / "ok" / "records"
    stale.mkdir(parents=True)
    (stale / "status-rank0-pid1.json").write_text('{"pid": 1, "tp_rank": 0, "hooks": {}}')
    trace = fake_sglang("ok").trace(load_prompts()[:1])
    errors = trace.provenance["capture"]["errors"]
    assert not (stale / "status-rank0-pid1.json").exists()
    assert not any("scheduler processes" in e or "pid 1" in e for e in errors), errors


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


def test_engine_hang_times_out(fake_sglang, monkeypatch, tmp_path):
    """A hung engine is a reported crash, and its whole session ends with it (the stand-in scheduler too)."""
    from process_kit import alive

    from refcheck.prompts import load_prompts

    monkeypatch.setenv("FAKE_SGLANG_SCHEDULER_PID", str(tmp_path / "scheduler.pid"))
    trace = fake_sglang("hang", timeout_s=5).trace(load_prompts()[:1])
    assert "timed out" in trace.provenance["capture"]["crash"]
    assert not alive(int((tmp_path / "scheduler.pid").read_text()))


def test_sglang_sweep_table_from_recorded_traces(tmp_path):
    """The sweep's bookkeeping over stand-in runs: the stored SGLang goldens play the engine."""
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest
    from refcheck.prompts import load_prompts
    from refcheck.sglang.sweep import run_sglang_sweep
    from refcheck.trace.io import read_trace

    cases = load_manifest(REPO_GOLDEN).cases
    traces = {"GOOD": read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11"].file),
              "LEAKY": read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11-breadth1-leak"].file)}

    class Replayed:
        def __init__(self, spec, alg, timing_repeats=0, **options):
            self.alg, self.repeats = alg, timing_repeats
            seen.append(options)

        def trace(self, prompts):
            t = traces[self.alg]
            t.provenance["engine"]["settings"].update(generate_s=2.0, repeat_generate_s=[0.5, 1.0, 0.25][: self.repeats],
                                                      repeats_match=self.alg == "GOOD")
            return t

    seen: list[dict] = []
    res = run_sglang_sweep(EngineSpec(pair="hybrid", dtype="bfloat16"), load_prompts(), [11], repeats=3,
                           algorithms=("GOOD", "LEAKY"), ref_device="cpu", runner_factory=Replayed, save_dir=tmp_path,
                           runner_options={"mem_fraction": 0.15, "cuda_graphs": True})
    assert seen == [{"mem_fraction": 0.15, "cuda_graphs": True}] * 2  # every engine gets the sweep's options
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{a}-b11.arrow" for a in ("GOOD", "LEAKY")]
    good, leaky = res["rows"]
    assert good["verdict"] == "pass" and good["fail_categories"] == []  # its 3 deviating nodes judged bf16 rounding
    assert leaky["verdict"] == "fail" and "recurrent" in leaky["fail_categories"]
    assert leaky["first_divergence"].split(" · ")[1] == "logits" and "step 0" in leaky["first_divergence"]
    emitted = sum(len(r.output_ids) for r in traces["GOOD"].requests)
    assert good["cold_tokens_per_s"]["median"] == emitted / 2.0  # the captured run
    assert good["tokens_per_s"] == {"median": emitted / 0.5, "min": emitted / 1.0, "max": emitted / 0.25}  # warm repeats
    assert good["repeats_match"] is True and leaky["repeats_match"] is False
    assert abs(good["mean_tau"] - 1.785) < 1e-3 and good["steps"] == 219


def test_sglang_sweep_from_saved_traces_groups_by_algorithm_and_budget(tmp_path):
    """`sweep --engine sglang --from-traces`: the same rows from saved traces, no engine; bad input refused."""
    from click.testing import CliRunner

    from refcheck.cli import main
    from refcheck.errors import UsageError
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest
    from refcheck.sglang.sweep import tabulate_traces
    from refcheck.trace.io import read_trace

    cases = load_manifest(REPO_GOLDEN).cases
    good = read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11"].file)
    leaky = read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11-breadth1-leak"].file)
    res = tabulate_traces([leaky, good, good], ref_device="cpu")
    rows = {r["algorithm"]: r for r in res["rows"]}
    assert set(rows) == {"NGRAM breadth 1", "NGRAM breadth 10"} and res["repeats"] == 2
    assert rows["NGRAM breadth 10"]["verdict"] == "pass"  # by default: its 3 deviating nodes judged rounding
    assert rows["NGRAM breadth 1"]["verdict"] == "fail" and "recurrent" in rows["NGRAM breadth 1"]["fail_categories"]
    # where the leak lands in the carried state: the first GDN layer's recurrent state
    assert rows["NGRAM breadth 1"]["first_state_failure"].endswith("recurrent layer 0")
    assert rows["NGRAM breadth 10"]["first_state_failure"] == ""
    assert rows["NGRAM breadth 10"]["steps"] == 219 and rows["NGRAM breadth 10"]["budget"] == 11
    reference_trace = read_trace(REPO_GOLDEN / cases["hybrid-b15"].file)
    with pytest.raises(UsageError, match="not an SGLang trace"):
        tabulate_traces([reference_trace])
    out = CliRunner().invoke(main, ["sweep", "--from-traces", str(REPO_GOLDEN / cases["hybrid-b15"].file)])
    assert out.exit_code != 0 and "--engine sglang" in str(out.exception or out.output)


def test_ddtree_refusals_come_before_any_engine_starts(tmp_path):
    """REFCHECK_DDTREE's bad input is refused on the CPU side: a tree beyond SGLang's verify kernels, a
    draft that is not DFlash or not made for the target, and the leak demonstration on a target with
    no recurrent layers. Never a scheduler dying at start-up, never a silent fallback."""
    import json
    import shutil

    from refcheck.errors import ModelError
    from refcheck.models import builtin_pair

    tdir, ddir = builtin_pair("hybrid")
    atdir, addir = builtin_pair("attention")
    assert resolve_budget("REFCHECK_DDTREE", 64, ddir, tdir) == 64
    assert resolve_budget("REFCHECK_DDTREE", 1023, ddir, tdir) == 1023
    assert resolve_budget("REFCHECK_DDTREE", 15, addir, atdir) == 15  # DDTree itself runs on attention targets
    with pytest.raises(UsageError, match="at most 1024 tokens"):
        resolve_budget("REFCHECK_DDTREE", 1024, ddir, tdir)
    with pytest.raises(ModelError, match="made for a 4-layer target, this target has 6 layers"):
        resolve_budget("REFCHECK_DDTREE", 15, addir, tdir)
    with pytest.raises(UsageError, match="no linear-attention layers"):
        resolve_budget("REFCHECK_DDTREE_LEAKY_CHAIN", 15, addir, atdir)
    plain = tmp_path / "plain"
    shutil.copytree(ddir, plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "dflash_config"}))
    with pytest.raises(ModelError, match="not one"):
        resolve_budget("REFCHECK_DDTREE", 15, plain, tdir)
    wide = tmp_path / "wide"
    shutil.copytree(ddir, wide)
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(ModelError, match="hidden_size is 96, the target's 128"):
        resolve_budget("REFCHECK_DDTREE", 15, wide, tdir)


def test_float32_is_refused_where_the_release_has_no_float32_kernel(monkeypatch):
    """SGLang 0.5.17 cannot run the Qwen3.5 built-in pair in float32 (gemma_rmsnorm): a usage error up
    front, not an engine that dies mid-run; bf16, and releases with no known limit, go on to the GPU check."""
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.17")
    with pytest.raises(UsageError, match="cannot run this target in float32: sgl_kernel's gemma_rmsnorm"):
        SGLangRunner(EngineSpec(dtype="float32"), "NONE")
    assert versions.float32_refusal("0.5.23", "qwen3_5_text") is None
    assert versions.float32_refusal("0.5.17", "llama") is None
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.23")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(EngineUnavailableError, match="CUDA GPU"):
            SGLangRunner(EngineSpec(dtype="float32"), "NONE")


def test_refchecks_ddtree_under_cuda_graphs_is_no_longer_refused(monkeypatch):
    """REFCHECK_DDTREE under SGLang's CUDA graphs died at its first decode step on the H200 (graphs captured
    without hidden states); its server-args check now raises SGLang's hidden-state ceiling, so the runner
    lets --cuda-graphs through: the CPU-side checks pass and the engine arguments ask for graphs."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineUnavailableError, match="CUDA GPU"):  # past every refusal, to the missing GPU
        SGLangRunner(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15), "REFCHECK_DDTREE", cuda_graphs=True)
    kw = engine_kwargs(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15), "/m", "REFCHECK_DDTREE",
                       cuda_graphs=True, budget=15, draft_path="/d")
    assert kw["disable_cuda_graph"] is False and kw["speculative_num_draft_tokens"] == 16
    assert kw["disable_overlap_schedule"] is True

def test_layer_sketches_under_cuda_graphs_are_refused_up_front():
    """A graph replay runs no module hooks: per-layer sketches under --cuda-graphs would be missing or stale,
    so the runner refuses the pair before any engine starts (a usage error, naming both options)."""
    from refcheck.errors import UsageError

    with pytest.raises(UsageError, match="--layer-sketches cannot be captured under --cuda-graphs"):
        SGLangRunner(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15), "REFCHECK_DDTREE", cuda_graphs=True,
                     layer_sketches=True)


def test_sampled_request_params_carry_refcheck_keys_only_for_the_keyed_sampler():
    from ddtree_reference.sampling import Sampling, request_key
    from refcheck.prompts import load_prompts
    from refcheck.sglang.requests import check_sampling, request_sampling_params, sampling_rng

    p = load_prompts()[0]
    greedy = EngineSpec(pair="hybrid", budget=15, max_new_tokens=8)
    assert request_sampling_params(p, greedy, "REFCHECK_DDTREE")["temperature"] == 0.0
    s = Sampling(0.8, top_k=0, top_p=0.9, seed=12)
    spec = EngineSpec(pair="hybrid", budget=15, max_new_tokens=8, sampling=s)
    mine = request_sampling_params(p, spec, "REFCHECK_DDTREE")
    assert (mine["temperature"], mine["top_k"], mine["top_p"]) == (0.8, -1, 0.9)  # SGLang's top-k "off" is -1
    assert mine["custom_params"] == {"refcheck_seed": 12, "refcheck_request": request_key(p.id)}
    assert "custom_params" not in request_sampling_params(p, spec, "NGRAM")
    assert sampling_rng("REFCHECK_DDTREE") == "refcheck-philox-position" and sampling_rng("NGRAM") == "engine-children-first"
    assert sampling_rng("NONE") == "engine"
    with pytest.raises(UsageError, match="cannot sample"):
        check_sampling("DFLASH", s)
    with pytest.raises(UsageError, match="position"):
        check_sampling("REFCHECK_DDTREE", Sampling(0.8, keying="node"))
    check_sampling("NGRAM", Sampling(0.8, keying="node"))  # SGLang's own generator: the keying is not its
    check_sampling("DFLASH", None)


def test_sglang_sweep_at_temperature_one(tmp_path, cli):
    """`sweep --engine sglang --temperature 1`: the runner gets the sampling (no refusal before it), the row is the
    sampled replay's verdict, and SGLang-generator repeats are not held to the captured tokens."""
    import copy

    from ddtree_reference.sampling import Sampling
    from refcheck.prompts import load_prompts
    from refcheck.reference_runner import ReferenceRunner
    from refcheck.sglang.sweep import run_sglang_sweep, sweep_row
    from refcheck.trace.io import Trace

    s = Sampling(temperature=1.0, seed=1)
    # a short sampled run of the reference plays the engine (keyed draws, replayed exactly)
    keyed, _ = ReferenceRunner(EngineSpec(pair="hybrid", budget=15, max_new_tokens=6, sampling=s)).trace(load_prompts()[:1])
    keyed.provenance["engine"]["settings"].update(generate_s=1.0, repeat_generate_s=[0.5], repeats_match=False)
    seen = []

    class Replayed:
        def __init__(self, spec, alg, timing_repeats=0):
            seen.append(spec.sampling)

        def trace(self, prompts):
            return keyed

    res = run_sglang_sweep(EngineSpec(pair="hybrid", dtype="bfloat16", sampling=s), load_prompts(), [15],
                           algorithms=("REFCHECK_DDTREE",), ref_device="cpu", runner_factory=Replayed)
    assert seen == [s] and res["temperature"] == 1.0 and res["seed"] == 1
    row = res["rows"][0]
    assert row["verdict"] == "pass" and row["repeats_match"] is False  # keyed draws must repeat: a mismatch shows

    class Same:  # the same report stands in for an NGRAM row: only the repeats bookkeeping differs
        verdict, counts, failures, stats = row["verdict"], row["counts"], [], {}

        @staticmethod
        def first_divergence():
            return {}

    engine_rng = copy.deepcopy(keyed.provenance)
    engine_rng["engine"]["settings"]["rng"] = "engine"
    assert sweep_row("NGRAM", 11, [Trace(engine_rng, keyed.requests, keyed.steps)], Same())["repeats_match"] is None
    code, _, err = cli("sweep", "--engine", "sglang", "--temperature", "1", "--budgets", "15", "--out", str(tmp_path / "o"))
    assert code == EXIT_USAGE and "cannot sample" not in err  # refused only for want of a GPU or SGLang


def test_first_differences_name_the_request_position_and_both_tokens():
    from refcheck.sglang.child import first_differences

    captured = [[1, 2, 3], [4, 5], [6, 7]]
    assert first_differences(captured, [[1, 2, 9], [4, 5], [6]]) == [[0, 2, 3, 9], [2, 1, 7, -1]]
    assert first_differences(captured, captured) == []
    assert first_differences([[1]], [[1, 8]]) == [[0, 1, -1, 8]]


def test_each_part_of_an_engine_times_its_rounds_in_an_equal_share_of_the_time_left():
    """child.part_until: with k parts left, a part's rounds end by now + (until - now) / k, taken as the part begins;
    the last part, or no end, keeps the job's until; an end already passed gives no rounds (now)."""
    from refcheck.sglang.child import part_until

    assert part_until(None, 40.0, 2) is None
    assert part_until(100.0, 40.0, 2) == 70.0 and part_until(100.0, 40.0, 3) == 60.0
    assert part_until(100.0, 40.0, 1) == 100.0
    assert part_until(100.0, 120.0, 2) == 120.0


def test_a_later_workload_that_hangs_is_timed_out_with_its_own_error_not_the_earlier_ones(fake_sglang):
    """The first workload's generate fails (its scheduler error in the shared log) and the engine goes on to the
    second, which hangs: the first reports its own error, the second the timeout, not the first's error."""
    from refcheck.prompts import load_prompts

    prompts = load_prompts()[:2]
    first, second = fake_sglang("first_fails_second_hangs", capture=False, timeout_s=8).traces([prompts[:1], prompts])
    assert "part0 bad request" in first.provenance["capture"]["crash"]
    assert "timed out after 8 s" in second.provenance["capture"]["crash"]
    assert "part0" not in second.provenance["capture"]["crash"]


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
