"""The calibration corpus (refcheck/calibrate.py, `refcheck calibrate`) and the default verdict in the
engine's own dtype, on CPU: a correct bf16 engine passes with default options; faults run in bf16 are
caught at the step where they first act with nothing triaged; the table's counts follow the rows."""

from __future__ import annotations

import json

import pytest

from ddtree_reference.decode import DDTreeDecoder
from refcheck.calibrate import (
    CorpusRun,
    corpus_prompts,
    default_corpus,
    detectability,
    first_change,
    markdown,
    run_one,
    summarize,
)
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.selftest.faults import FAULTS


def _run(kind: str, engine: str, dtype: str = "bfloat16", budget: int | None = 15, drafter: str = "scripted") -> dict:
    run = CorpusRun(f"{kind}-{engine}", kind, engine, "hybrid", drafter, budget, dtype, "cpu")
    row, data = run_one(run, n_prompts=2, max_new_tokens=16, ref_device="cpu")
    assert data[:6] == b"ARROW1"  # the trace comes back whole
    return row


def test_a_correct_bf16_engine_passes_with_default_options():
    row = _run("clean", "reference", drafter="dflash")
    assert row["verdict"] == "pass", row["first_finding"]
    assert row["fail_findings"] == 0 and row["calibration"]["rule"] is not None


@pytest.mark.parametrize("fault", ["sibling-leak", "state-flat-index", "conv-not-rolled-back"])
def test_faults_in_bf16_are_caught_where_they_first_act_with_nothing_triaged(fault):
    row = _run("fault", f"fault:{fault}")
    assert row["verdict"] == "fail" and row["triaged"] == 0, row
    assert row["first_change"] is not None and row["located"], (row["first_change"], row["first_finding_in_request"])


def test_first_change_finds_the_first_differing_step_and_node():
    pool = ReferencePool()
    runner = pool.runner(EngineSpec(pair="hybrid", drafter="scripted", budget=15, max_new_tokens=16))
    prompts = load_prompts()[:2]
    clean, _ = runner.trace(prompts, cls=DDTreeDecoder)
    again, _ = runner.trace(prompts, cls=DDTreeDecoder)
    assert first_change(clean, again) is None  # deterministic: the clean engine equals itself
    leak, _ = runner.trace(prompts, cls=FAULTS["sibling-leak"][0], engine="fault:sibling-leak")
    ch = first_change(clean, leak)
    assert ch is not None and ch["step"] == 0 and ch["what"] == "logits" and ch["node"] >= 1


def test_first_change_of_a_sampling_fault_is_the_first_draw_it_moves():
    from refcheck.selftest.sampling_faults import SAMPLING_FAULTS, SELFTEST_SAMPLING

    pool = ReferencePool()
    runner = pool.runner(EngineSpec(pair="hybrid", budget=8, max_new_tokens=12, sampling=SELFTEST_SAMPLING))
    prompts = load_prompts()[:1]
    clean, _ = runner.trace(prompts)
    assert first_change(clean, runner.trace(prompts)[0]) is None
    twice, _ = runner.trace(prompts, cls=SAMPLING_FAULTS["temperature-twice"][0])
    ch = first_change(clean, twice)
    assert ch is not None and ch["what"] in ("draws", "first token"), ch


def test_the_default_corpus_covers_dtypes_budgets_pairs_and_every_fault():
    runs = default_corpus(["bfloat16", "float16"], "cuda", ["sibling-leak", "rec-scale:0.01", "temperature-1.1x"])
    clean = [r for r in runs if r.kind == "clean"]
    assert len(clean) == 2 * 2 * 5 + 2 * 2 + 2 * 2 * 2 + 2 and {r.dtype for r in clean} == {"bfloat16", "float16"}
    assert {r.budget for r in clean} == {8, 15, 32, 64, None}
    sampled = [r for r in clean if r.sampling is not None]  # each dtype x pair at T = 1 and at T = 0.7 / top-p 0.9
    assert sorted((r.sampling.temperature, r.sampling.top_p) for r in sampled) == [(0.7, 0.9)] * 4 + [(1.0, 1.0)] * 4
    assert all(r.budget == 15 and r.drafter == "dflash" and r.spec(8).sampled for r in sampled)
    assert [(r.kind, r.engine, r.dtype) for r in runs if r.kind != "clean"] == [
        ("fault", "fault:sibling-leak", "bfloat16"), ("graded", "fault:rec-scale:0.01", "bfloat16"),
        ("fault", "fault:temperature-1.1x", "bfloat16")]
    temp = runs[-1]  # a sampling fault runs sampled (T = 1.0: a temperature 10 % off), with the DFlash drafter
    assert temp.sampling is not None and temp.sampling.temperature == 1.0 and temp.drafter == "dflash"
    assert runs[-3].sampling is None


def test_the_long_context_runs_decode_the_long_prompts_with_their_own_limits():
    """Each dtype's clean run and each long-context fault run on LONG_PROMPTS (DFlash: the fault is the drafter's)."""
    runs = default_corpus(["bfloat16", "float16"], "cpu", ["sibling-leak", "draft-rope-bf16"])
    long = [r for r in runs if r.long]
    assert [(r.name, r.drafter, r.budget) for r in long] == [
        ("clean-bfloat16-hybrid-dflash-b15-long", "dflash", 15), ("clean-float16-hybrid-dflash-b15-long", "dflash", 15),
        ("fault-draft-rope-bf16-bfloat16", "dflash", 15)]
    prompts = corpus_prompts(long[0], n_prompts=3)
    assert [(p.id, len(p.prompt_ids), p.max_new_tokens) for p in prompts] == [("mixed-02", 600, 64), ("mixed-04", 438, 48)]
    assert len(corpus_prompts(runs[0], n_prompts=3)) == 3 and not runs[0].long


def _row(name, kind, verdict, triaged=0, located=None, ratios=(), engine="reference"):
    return {"name": name, "kind": kind, "engine": engine, "dtype": "bfloat16", "verdict": verdict, "fail_findings": 0,
            "triaged": triaged, "ensemble_steps": 1, "first_finding": None, "rounding_ratios": list(ratios),
            "max": {"max_logprob_abs": 0.5}, "located": located, "located_node": located}


def test_summary_counts_follow_the_rows():
    rows = [_row("c1", "clean", "pass", 2, ratios=(0.1, 0.5, 1.2)), _row("c2", "clean", "fail"),
            _row("f1", "fault", "fail", located=True), _row("f2", "fault", "pass", 3, located=False),
            _row("g1", "graded", "pass", engine="fault:rec-scale:0.001"),
            _row("g2", "graded", "fail", engine="fault:rec-scale:0.1")]
    s = summarize(rows)
    assert (s["clean_runs"], s["false_alarms"], s["faulty_runs"], s["detected"], s["located"]) == (2, 1, 2, 1, 1)
    assert s["faulty_nodes_triaged"] == 3 and s["clean_triaged"] == 2 and s["clean_ratio_quantiles"]["max"] == 1.2
    assert detectability(rows) == {"rec-scale (bfloat16)": [(0.001, False), (0.1, True)]}
    md = markdown(rows, s)
    assert "1 false alarms of 2" in md and "| rec-scale (bfloat16) | . | x |" in md
    fp16 = [{**_row("h1", "graded", "fail", engine="fault:rec-scale:0.01"), "dtype": "float16"}]
    curves = detectability(rows + fp16)  # a curve per dtype; a size one dtype did not run is blank in the table
    assert curves["rec-scale (float16)"] == [(0.01, True)] and len(curves) == 2
    assert "| rec-scale (float16) |   | x |   |" in markdown(rows + fp16, summarize(rows + fp16))


def test_the_command_writes_the_table_and_exits_by_its_claims(tmp_path, cli):
    code, out, err = cli("calibrate", "--out", str(tmp_path), "--dtype", "bfloat16", "--device", "cpu", "--pair", "hybrid",
                         "--budget", "15", "--fault", "sibling-leak", "--prompts", "1", "--max-new-tokens", "12", "--no-long", "--json")
    assert code == 0, err
    summary = json.loads(out)
    # clean: DFlash b15, scripted b15 and b64, and sampled (DFlash b15) at T = 1 and at T = 0.7 / top-p 0.9
    assert summary["clean_runs"] == 5 and summary["false_alarms"] == 0 and summary["detected"] == 1
    assert (tmp_path / "calibration.md").read_text().count("| clean |") == 5
    rows = json.loads((tmp_path / "calibration.json").read_text())["rows"]
    assert len(rows) == 6 and [r["sampling"]["temperature"] for r in rows if r["sampling"]] == [1.0, 0.7]
    # the sampled clean rows pass the exact replay in bf16 (draws held to rounding) and the temperature check
    assert all(r["temperature"]["verdict"] == "pass" and r["temperature"]["keyed_draws"] > 0 for r in rows if r["sampling"])
    assert summary["clean_temperature"]["runs"] == 2
    code, _, err = cli("calibrate", "--out", str(tmp_path), "--fault", "no-such-fault", "--device", "cpu")
    assert code == 2 and "unknown fault" in err and "rec-scale:EPS" in err


def test_the_corpus_on_a_pair_given_by_its_directories(tmp_path):
    """--model/--draft: every run (clean and faulty) names that pair and runs on its directories."""
    runs = default_corpus(["bfloat16"], "cuda", ["sibling-leak"], budgets=(15,), own=("wide", "/m/t", "/m/d"))
    assert {r.pair for r in runs} == {"wide"} and {(r.model_dir, r.draft_dir) for r in runs} == {("/m/t", "/m/d")}
    assert [r.name for r in runs] == ["clean-bfloat16-wide-dflash-b15", "clean-bfloat16-wide-scripted-b15",
                                      "clean-bfloat16-wide-scripted-b64", "clean-bfloat16-wide-dflash-b15-t1",
                                      "clean-bfloat16-wide-dflash-b15-t07-p09", "clean-bfloat16-wide-dflash-b15-long",
                                      "fault-sibling-leak-bfloat16-wide"]
    spec = runs[0].spec(8)
    assert str(spec.model_dir) == "/m/t" and str(spec.draft_dir) == "/m/d" and spec.model_label == "/m/t"


def test_the_command_runs_the_corpus_on_a_given_pair_and_refuses_half_of_one(tmp_path, cli):
    from refcheck.models import builtin_pair

    tdir, ddir = builtin_pair("hybrid")
    code, out, err = cli("calibrate", "--out", str(tmp_path), "--dtype", "bfloat16", "--device", "cpu", "--model",
                         str(tdir), "--draft", str(ddir), "--label", "mine", "--budget", "15", "--fault", "sibling-leak",
                         "--prompts", "1", "--max-new-tokens", "10", "--no-faults", "--no-long", "--json")
    assert code == 0, err
    rows = json.loads((tmp_path / "calibration.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["clean-bfloat16-mine-dflash-b15", "clean-bfloat16-mine-scripted-b15",
                                         "clean-bfloat16-mine-scripted-b64", "clean-bfloat16-mine-dflash-b15-t1",
                                         "clean-bfloat16-mine-dflash-b15-t07-p09"]
    assert all(r["verdict"] == "pass" for r in rows)
    assert all(r["model_dir"] == str(tdir) for r in rows)
    code, _, err = cli("calibrate", "--out", str(tmp_path), "--device", "cpu", "--model", str(tdir))
    assert code == 2 and "--model and --draft go together" in err
    code, _, err = cli("calibrate", "--out", str(tmp_path), "--device", "cpu", "--model", str(tdir), "--draft", str(ddir),
                       "--pair", "hybrid")
    assert code == 2 and "with --model the corpus runs on that pair alone" in err


def test_traces_of_one_configuration_from_two_runs_keep_a_row_each():
    from pathlib import Path

    from refcheck.cli.calibrate import trace_names

    paths = [Path("a/call1/dflash.arrow"), Path("b/call5/dflash.arrow"), Path("b/call5/none.arrow"),
             Path("x/s/ngram.arrow"), Path("y/s/ngram.arrow")]
    assert trace_names(paths) == ["call1/dflash", "call5/dflash", "none", "x/s/ngram.arrow", "y/s/ngram.arrow"]

