"""`refcheck sweep`, `refcheck baseline` and the live z-lab runner."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from refcheck.diff.judge import judge
from refcheck.errors import EXIT_MISMATCH, EXIT_NOTHING, EXIT_PASS, EXIT_USAGE
from refcheck.goldens import REPO_GOLDEN
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.trace.io import read_trace, write_trace


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    p = tmp_path / "p.jsonl"
    rows = [{"id": q.id, "kind": q.kind, "prompt_ids": list(q.prompt_ids)} for q in load_prompts()[::2]]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_sweep_writes_table_json_and_plots(cli, monkeypatch, tmp_path, prompts_file):
    out = tmp_path / "sweep"
    code, stdout, err = cli("sweep", "--budgets", "chain,4,15", "--max-new-tokens", "16",
                            "--prompts", str(prompts_file), "--out", str(out), "--repeats", "2", "--json")
    assert code == EXIT_PASS, err
    result = json.loads(stdout)
    assert [r["budget"] for r in result["budgets"]] == ["chain", "4", "15"]
    for r in result["budgets"]:
        assert r["lossless"] and abs(sum(r["histogram"]) - 1) < 1e-9 and r["speedup_vs_autoregressive"] > 0
        assert r["ms_per_step"]["verify"]["min"] <= r["ms_per_step"]["verify"]["median"] <= r["ms_per_step"]["verify"]["max"]
    assert json.loads((out / "sweep.json").read_text())["repeats"] == 2
    for png in ("sweep_tau_speed.png", "sweep_acceptance_histogram.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("budgets", ["1,x", "-3", "", "4,,"])
def test_sweep_malformed_budgets(cli, monkeypatch, budgets):
    code, _, err = cli("sweep", "--budgets", budgets, "--no-plots")
    assert code == EXIT_USAGE and "--budgets" in err


def test_sweep_without_plotting_backend(cli, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = cli("sweep", "--budgets", "4", "--out", str(tmp_path))
    assert code == EXIT_USAGE and "plotting backend missing" in err


def test_baseline_fail_nomatch_unknown_and_empty(cli, monkeypatch, tmp_path):
    trace = str(REPO_GOLDEN / "hybrid-b15.arrow")
    code, out, _ = cli("baseline", trace, "--source", "ddtree_table1", "--model", "Qwen3-8B",
                       "--dataset", "MATH-500", "--json")
    rep = json.loads(out)
    assert code == EXIT_MISMATCH and rep["verdict"]["verdict"] == "FAIL" and rep["baseline"]["tau"] == 10.73
    code, _, err = cli("baseline", trace, "--model", "Qwen3-8B", "--dataset", "NOPE")
    assert code == EXIT_USAGE and "no baseline matches" in err
    code, _, err = cli("baseline", trace, "--source", "nope")
    assert code == EXIT_USAGE and "unknown baseline" in err
    t = read_trace(REPO_GOLDEN / "hybrid-b15.arrow")
    write_trace(dataclasses.replace(t, steps=[]), tmp_path / "nosteps.arrow")
    code, _, _ = cli("baseline", str(tmp_path / "nosteps.arrow"), "--model", "Qwen3-8B")
    assert code == EXIT_NOTHING


@pytest.fixture(scope="module")
def zlab():
    pytest.importorskip("dflash.model")
    from refcheck.runners.zlab import ZlabRunner

    return ZlabRunner


def test_zlab_agrees_with_reference_on_attention_target(zlab):
    trace = zlab(EngineSpec(pair="attention", budget=None, max_new_tokens=24)).trace(load_prompts()[:3])
    rep = judge(trace, ReferencePool(), "zlab-attention", mode="both", strict_acceptance=True)
    assert rep.failures == [] and rep.stats["mean_tau_engine"] == rep.stats["mean_tau_reference"]
    assert rep.counts["unsupported"] > 0  # z-lab exposes no KV/state: counted, not passed


def test_zlab_is_flagged_on_hybrid_target(zlab):
    trace = zlab(EngineSpec(pair="hybrid", budget=None, max_new_tokens=32)).trace(load_prompts())
    rep = judge(trace, ReferencePool(), "zlab-hybrid", mode="both")
    first = rep.first_divergence()
    assert first, "the Cache.crop recurrent-state bug must be caught"
    assert {f.category for f in first.values()} <= {"logits", "draft", "bonus", "accepted_path"}
    assert all(f.step is not None and f.step >= 1 for f in first.values())  # step 0 starts from a clean prefill


def test_zlab_needs_chain(cli, monkeypatch):
    code, _, err = cli("diff", "--engine", "zlab", "--budget", "15")
    assert code == EXIT_USAGE and "chain" in err


@pytest.mark.parametrize("flag", [["--sglang-mem-fraction", "0.2"], ["--cuda-graphs"]])
def test_sweep_engine_options_need_the_sglang_engine(cli, tmp_path, flag):
    code, _, err = cli("sweep", "--budgets", "4", "--out", str(tmp_path / "o"), *flag)
    assert code == EXIT_USAGE and "needs --engine sglang" in err and "Traceback" not in err
