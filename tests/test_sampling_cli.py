"""Sampling on the command line: run / diff / sweep / baseline at temperature > 0, bad sampling input
(exit 2, one line, no traceback) and engines that cannot sample (a clear refusal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_reference.sampling import Sampling
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, EXIT_USAGE
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec, ReferenceRunner
from refcheck.trace.io import write_trace


@pytest.fixture
def one_prompt(tmp_path: Path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt_ids": [5, 6, 7, 8, 9, 10, 11]}\n')
    return p


@pytest.mark.parametrize("args, says", [
    (("--temperature", "-0.5"), "temperature"),
    (("--temperature", "nan"), "temperature"),
    (("--temperature", "1", "--top-p", "0"), "top-p"),
    (("--temperature", "1", "--top-p", "1.5"), "top-p"),
    (("--temperature", "1", "--top-k", "-2"), "top-k"),
])
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_bad_sampling_input_is_exit_2_one_line(cli, tmp_path, args, says, command):
    extra = ("--out", str(tmp_path / "o"), "--no-plots") if command == "sweep" else ()
    code, out, err = cli(command, *args, *extra)
    assert code == EXIT_USAGE
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [("diff", "--engine", "zlab", "--budget", "chain"),
                                  ("diff", "--engine", "sglang:DFLASH")])
def test_engines_that_cannot_sample_are_refused(cli, args):
    code, _, err = cli(*args, "--temperature", "1.0")
    assert code == EXIT_USAGE and "cannot sample" in err and "Traceback" not in err


def test_run_sampled_check_ar_json(cli, one_prompt):
    code, out, _ = cli("run", "--temperature", "1.0", "--top-k", "20", "--seed", "3", "--check-ar", "--json",
                       "--prompts", str(one_prompt), "--max-new-tokens", "8", "--budget", "4")
    assert code == EXIT_PASS
    rep = json.loads(out)
    assert rep["sampling"] == {"temperature": 1.0, "top_k": 20, "top_p": 1.0, "seed": 3, "keying": "position"}
    assert rep["prompts"][0]["ar"] == "pass" and len(rep["prompts"][0]["output_ids"]) == 8


def test_diff_sampled_fault_fails(cli, one_prompt):
    """(The clean sampled reference passing the same diff: tests/test_sampling_diff.py.)"""
    code, out, _ = cli("diff", "--engine", "fault:bonus-greedy", "--temperature", "0.7", "--top-p", "0.9", "--prompts",
                       str(one_prompt), "--max-new-tokens", "5", "--pair", "attention", "--budget", "4", "--mode",
                       "replay", "--json")
    assert code == EXIT_MISMATCH
    assert "bonus" in json.loads(out)["reports"][0]["fail_categories"]


def test_baseline_takes_the_traces_temperature(cli, tmp_path):
    runner = ReferenceRunner(EngineSpec(pair="attention", budget=None, max_new_tokens=8,
                                        sampling=Sampling(1.0, 0, 1.0, 1)))
    trace, _ = runner.trace([Prompt("a", (5, 6, 7, 8, 9), "chat"), Prompt("b", (100, 3, 250, 4), "chat")])
    path = tmp_path / "t1.arrow"
    write_trace(trace, path)
    code, out, _ = cli("baseline", str(path), "--model", "Qwen3-8B", "--dataset", "MATH-500", "--json")
    assert code in (EXIT_PASS, EXIT_MISMATCH, 5)
    rep = json.loads(out)
    assert "temperature=1 " in rep["baseline"]["conditions"] and rep["baseline"]["tau"] == 6.46  # Table 1, T=1 DFlash
    code, _, err = cli("baseline", str(path), "--model", "Qwen3-8B", "--dataset", "MATH-500", "--temperature", "0")
    assert code == EXIT_USAGE and "not comparable" in err


def test_sweep_at_temperature_is_lossless_against_sampled_target_only(cli, one_prompt, tmp_path):
    code, out, _ = cli("sweep", "--temperature", "1.0", "--seed", "5", "--budgets", "chain,4", "--no-plots", "--json",
                       "--prompts", str(one_prompt), "--max-new-tokens", "8", "--pair", "attention",
                       "--out", str(tmp_path / "sw"))
    assert code == EXIT_PASS
    rep = json.loads(out)
    assert rep["sampling"]["temperature"] == 1.0 and all(r["lossless"] for r in rep["budgets"])
