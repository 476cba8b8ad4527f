"""``refcheck matrix`` without a GPU: the cells and their refusals, a whole matrix over stand-in engines (the
reference recording traces the way the SGLang runner would), the capture-off twin, the Markdown table, the
workloads it runs and the command's bad input."""

from __future__ import annotations

import copy
import json

import pytest

from refcheck.errors import EXIT_USAGE, ModelError, UsageError
from refcheck.prompts import load_prompts
from refcheck.prompts.workloads import WORKLOADS, needed_context, workload, write_workload
from refcheck.reference_runner import EngineSpec, ReferenceRunner
from refcheck.sglang.matrix import (
    MEMORY_RACE,
    SETTINGS,
    MatrixRun,
    cells,
    markdown,
    merge_twin,
    named_cells,
    run_matrix,
)

_BASE: dict[str, object] = {}  # one reference trace, decoded on the main thread (see FakeRunner.trace)


class FakeRunner:
    """A stand-in SGLang runner: a reference trace of two prompts plays every engine; the provenance carries what
    SGLangRunner's does. The trace is decoded once, outside the matrix's threads: model loading patches torch
    globally while it runs, so two threads loading at once can leave later loads on the meta device."""

    calls: list[tuple[str, str, bool]] = []
    fail_start: dict[str, int] = {}

    def __init__(self, spec, algorithm, settings, timing_repeats, warmup, mem_fraction, tp, capture_dir=None,
                 capture=True, **extra):
        if algorithm == "REFCHECK_DDTREE" and settings.overlap:
            raise UsageError("REFCHECK_DDTREE runs synchronously")
        self.algorithm, self.settings, self.capture = algorithm, settings, capture

    def trace(self, prompts):
        left = FakeRunner.fail_start.get(self.algorithm, 0)
        if left:
            FakeRunner.fail_start[self.algorithm] = left - 1
            raise ModelError(f"SGLang could not start: Loaded weights {MEMORY_RACE} under 0.1")
        FakeRunner.calls.append((self.algorithm, self.settings.label(), self.capture))
        trace = copy.deepcopy(_BASE["trace"])
        trace.provenance["engine"]["settings"].update(
            serving_label=self.settings.label(), generate_s=0.3 if self.capture else 0.1, repeat_generate_s=[0.1],
            warmup_match=True, repeats_match=True)
        return trace


@pytest.fixture
def run(tmp_path, monkeypatch):
    import refcheck.sglang.matrix as m

    monkeypatch.setattr(m.time, "sleep", lambda s: None)
    FakeRunner.calls, FakeRunner.fail_start = [], {}
    if "trace" not in _BASE:
        spec = EngineSpec(pair="hybrid", dtype="float32", device="cpu", max_new_tokens=6, budget=4)
        _BASE["trace"], _ = ReferenceRunner(spec).trace(load_prompts()[:2])
    return MatrixRun(EngineSpec(pair="hybrid", max_new_tokens=6), tmp_path, ref_device="cpu", runner_factory=FakeRunner,
                     diff_processes=0)


def test_cells_are_the_product_and_names_parse_back():
    todo = cells(["NONE", "REFCHECK_DDTREE"], ["default", "radix"])
    assert [c.name for c in todo] == ["NONE-default", "REFCHECK_DDTREE-default", "NONE-radix", "REFCHECK_DDTREE-radix"]
    assert named_cells([c.name for c in todo]) == todo
    with pytest.raises(UsageError, match="algorithm.*EAGLE.*setting.*bogus"):
        cells(["EAGLE"], ["bogus"])


def test_a_matrix_runs_every_cell_or_says_why_not(run):
    todo = cells(["NONE", "DFLASH", "REFCHECK_DDTREE"], ["default", "overlap", "tp2"])
    FakeRunner.fail_start = {"NONE": 1}  # engines starting side by side: the memory race, started again
    result = run_matrix(run, todo, parallel=3, stagger_s=0.0)
    rows = {r["cell"]: r for r in result["rows"]}
    assert list(rows) == [c.name for c in todo]
    assert rows["NONE-default"]["status"] == "run" and rows["NONE-default"]["verdict"] == "pass"
    assert rows["REFCHECK_DDTREE-overlap"]["status"] == "not run" and "synchronously" in rows["REFCHECK_DDTREE-overlap"]["reason"]
    assert rows["DFLASH-tp2"]["reason"] == "needs 2 GPUs, this machine has 1"
    r = rows["DFLASH-default"]
    assert r["capture_off_twin"] == "tokens identical" and r["capture_overhead_vs_off"] == pytest.approx(3.0)
    assert r["capture_overhead"] == pytest.approx(3.0) and r["tokens_unchanged_by_capture"] is True
    assert r["tau"] is not None and r["warm_tokens_per_s"] > 0 and r["trace"].endswith("DFLASH-default.arrow")
    assert ("DFLASH", "default", False) in FakeRunner.calls and ("DFLASH", "overlap", False) in FakeRunner.calls
    assert "outputs" not in r  # the twin's comparison data stays out of the result
    md = markdown(result)
    assert "| DFLASH | default | pass |" in md and "needs 2 GPUs" in md and "EAGLE / NEXTN" in md
    json.dumps(result)


def test_a_twin_whose_tokens_differ_is_named():
    row = {"outputs": {"a": [1, 2], "b": [3]}, "captured_generate_s": 2.0}
    merge_twin(row, {"outputs": {"a": [1, 2], "b": [4]}, "generate_s": 1.0, "repeat_generate_s": []})
    assert row["capture_off_twin"] == "1 request(s) differ: ['b']" and row["tokens_identical_to_capture_off"] is False
    assert row["capture_overhead_vs_off"] == pytest.approx(2.0)
    row = {"outputs": {}}
    merge_twin(row, {"twin_error": "ModelError: boom"})
    assert row["capture_off_twin"] == "ModelError: boom"


def test_the_long_workload_runs_on_a_long_context_copy(run):
    prompts, spec = run.prompts_for(cells(["NONE"], ["long"])[0])
    assert max(len(p.prompt_ids) for p in prompts) == 16384 and spec.model_dir is not None
    cfg = json.loads((spec.model_dir / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= needed_context(prompts, 32) and cfg["refcheck_context"]
    assert cells(["NONE"], ["default"])[0].setting.workload == "builtin"


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_and_fit_the_builtin_vocabulary(name, tmp_path):
    a, b = workload(name), workload(name)
    assert a == b and all(max(p.prompt_ids) < 512 and min(p.prompt_ids) >= 0 for p in a)
    assert load_prompts(write_workload(a, tmp_path / "w.jsonl")) == a


def test_workload_shapes():
    mixed = workload("mixed")
    assert len(mixed) >= 32 and min(len(p.prompt_ids) for p in mixed) <= 16 and max(len(p.prompt_ids) for p in mixed) >= 500
    assert len({p.max_new_tokens for p in mixed}) > 2
    fam = [p for p in workload("shared-prefix") if p.id.startswith("prefix-0-")]
    assert all(p.prompt_ids[:100] == fam[0].prompt_ids[:100] for p in fam)
    assert fam[1].prompt_ids[:300] == fam[2].prompt_ids[:300] and fam[1].prompt_ids[300:] != fam[2].prompt_ids[300:]
    with pytest.raises(UsageError, match="unknown workload"):
        workload("huge")


def test_every_setting_parses_and_names_a_workload():
    from refcheck.sglang.settings import parse_settings

    for s in SETTINGS.values():
        parse_settings(s.serving)
        assert s.workload in WORKLOADS


def test_cli_lists_and_refuses(cli):
    code, _, err = cli("matrix", "--list")
    assert code == 0 and "radix" in err and "not runnable: EAGLE" in err
    code, _, err = cli("matrix", "--cells", "DFLASH-bogus")
    assert code == EXIT_USAGE and "unknown setting(s) bogus" in err


def test_a_cut_short_run_resumes_where_it_stopped(run, tmp_path):
    """--resume: the cells an earlier run finished (ran, or refused for a reason of their own) are kept; cells it
    only did not reach run now; the twin it had finished is merged into its kept row."""
    from refcheck.sglang.matrix import finished_rows, resumed

    todo = cells(["NONE", "DFLASH"], ["default", "radix"])
    rows: list[dict] = []
    first = run_matrix(run, todo[:2], parallel=1, on_row=rows.append)  # the run was cut after two cells
    rows.append({"cell": "NONE-radix", "algorithm": "NONE", "setting": "radix", "status": "not run",
                 "reason": "not reached: the call ended"})
    rows.append({"cell": "NONE-tp2", "status": "not run", "reason": "needs 2 GPUs, this machine has 1"})
    rows.append({"cell": "REFCHECK_DDTREE-overlap", "status": "not run", "reason": "UsageError: runs synchronously"})
    f = tmp_path / "partial.json"
    f.write_text(json.dumps({"rows": rows}))
    done = finished_rows(f)
    assert set(done) == {"NONE-default", "DFLASH-default", "twin:DFLASH-default", "REFCHECK_DDTREE-overlap"}
    FakeRunner.calls = []
    again = resumed(run_matrix(run, [c for c in todo if c.name not in done], parallel=1), todo, done)
    assert [r["cell"] for r in again["rows"]] == [c.name for c in todo] and again["resumed"] == ["DFLASH-default", "NONE-default"]
    assert {c[:2] for c in FakeRunner.calls} == {("NONE", "radix,stagger=40"), ("DFLASH", "radix,stagger=40")}
    assert again["rows"][1]["capture_off_twin"] == "tokens identical" == first["rows"][1]["capture_off_twin"]
    assert all("outputs" not in r for r in again["rows"])
    with pytest.raises(UsageError, match="no such file"):
        finished_rows(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UsageError, match="not a matrix result"):
        finished_rows(tmp_path / "bad.json")


def _untraced(trace, target, k: int, rank: int) -> list[int]:
    """[request 0, position k, captured token, the reference's rank-th choice there]."""
    import torch

    from ddtree_reference.compat import full_forward_logits

    req = trace.requests[0]
    logits = full_forward_logits(target.model, torch.tensor(list(req.prompt_ids) + list(req.output_ids[:k])))[-1]
    return [0, k, req.output_ids[k], int(logits.argsort(descending=True)[rank])]


def test_untraced_differences_are_judged_at_the_references_near_ties(run):
    """Where an untraced pass leaves the captured one, the reference's log-prob margin between the two tokens
    decides: under the engine dtype's tie margin it is a near-tie a different batch may flip; the last token of
    the vocabulary's order is not, and is named as capture changing a token."""
    from refcheck.diff.tolerance import calibration_for
    from refcheck.pool import ReferencePool, reference_spec_for
    from refcheck.sglang.capture_effect import judge_untraced, untraced_text

    trace = copy.deepcopy(_BASE["trace"])
    trace.provenance["dtype"] = "bfloat16"
    target = ReferencePool().runner(reference_spec_for(trace)).target
    tie = calibration_for("bfloat16", "cuda").tolerance.tie_margin
    second = _untraced(trace, target, 2, 1)
    worst = _untraced(trace, target, 3, target.vocab_size - 1)
    trace.provenance["engine"]["settings"]["untraced_diffs"] = {"warmup": [second], "repeat0": [worst]}
    got = judge_untraced(trace, target)
    margins = {p["pass"]: p["margin"] for p in got["places"]}
    assert got["differences"] == 2 and margins["repeat0"] > tie and got["at_near_ties"] == (margins["warmup"] < tie)
    assert not got["all_near_ties"]
    row = {"tokens_unchanged_by_capture": False, "untraced_judged": got}
    assert untraced_text(row).startswith("DIFFER: 1 not at a near-tie")
    trace.provenance["engine"]["settings"]["untraced_diffs"] = {"warmup": [[0, 2, second[2], second[2] + 0]]}
    assert judge_untraced(trace, target)["places"][0]["margin"] == 0.0  # (the same token: margin 0, a tie)
    assert untraced_text({"tokens_unchanged_by_capture": True}) == "same"
    assert untraced_text({"tokens_unchanged_by_capture": None}) == "—"
    del trace.provenance["engine"]["settings"]["untraced_diffs"]
    assert judge_untraced(trace, target) is None


def test_a_cell_whose_untraced_passes_differ_says_where(run, monkeypatch):
    """A greedy cell whose untraced passes differ from the captured one carries the judgement, and the table
    says whether the differences are near-ties."""
    class Differing(FakeRunner):
        def trace(self, prompts):
            trace = super().trace(prompts)
            req = trace.requests[0]
            trace.provenance["engine"]["settings"].update(
                warmup_match=False, untraced_diffs={"warmup": [[0, 1, req.output_ids[1], req.output_ids[1]]]})
            return trace

    run.runner_factory = Differing
    result = run_matrix(run, cells(["NONE"], ["default"]), parallel=1, stagger_s=0.0)
    row = result["rows"][0]
    assert row["tokens_unchanged_by_capture"] is False and row["untraced_judged"]["all_near_ties"]
    assert "differ at 1 near-tie(s)" in markdown(result)


def test_matrix_tables_of_several_runs_merge_latest_run_first(tmp_path):
    """scripts/matrix_table.py: a cell takes the latest run that ran it; a 'not run' never hides a run; twins'
    raw records are skipped; a re-judged report adds its verdict."""
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parents[1] / "scripts"))
    import matrix_table

    ran = {"cell": "A-x", "algorithm": "A", "setting": "x", "status": "run", "verdict": "fail", "first_finding": "f",
           "tau": 1.0, "warm_tokens_per_s": 2.0, "steps": 3}
    first = {"rows": [ran, {"cell": "B-x", "algorithm": "B", "setting": "x", "status": "not run", "reason": "not reached"}]}
    second = {"rows": [{**ran, "verdict": "pass"}, {"twin_of": "A-x", "outputs": {}},
                       {"cell": "B-x", "algorithm": "B", "setting": "x", "status": "not run", "reason": "refused"}]}
    third = {"rows": [{"cell": "A-x", "algorithm": "A", "setting": "x", "status": "not run", "reason": "cut short"}]}
    got = {r["cell"]: r for r in matrix_table.merge([("1", first), ("2", second), ("3", third)])["rows"]}
    assert got["A-x"]["verdict"] == "pass" and got["A-x"]["from"] == "2" and got["B-x"]["reason"] == "refused"
    assert got["DFLASH-radix"]["status"] == "not run" and "none of the runs" in got["DFLASH-radix"]["reason"]
    (tmp_path / "r").mkdir()
    for name in ("m12-A-x.json", "m12-B-x.json"):
        (tmp_path / "r" / name).write_text(json.dumps({"reports": [{"verdict": "pass", "counts": {
            "pass": 5, "benign_tie": 1, "triaged": 2, "fail": 0}}]}))
    for i, run in enumerate((first, second)):
        (tmp_path / f"{i}.json").write_text(json.dumps(run))
    assert matrix_table.main([str(tmp_path / "out"), str(tmp_path / "0.json"), str(tmp_path / "1.json"),
                              "--rejudged", str(tmp_path / "r")]) == 0
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "| A | x | pass |" in md and "A-x: pass (5/1/2/0)" in md
    assert "| B | x | not run | captured on the GPU, not diffed there; its trace diffed later: pass (5/1/2/0)" in md
    assert matrix_table.main([str(tmp_path / "out"), str(tmp_path / "missing.json")]) == 2
