"""`refcheck run`: JSON output, the AR check, and bad input -> clear message + distinct exit code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from refcheck.errors import EXIT_MODEL, EXIT_PASS, EXIT_USAGE
from refcheck.models import builtin_pair


@pytest.fixture
def small_prompts(tmp_path: Path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt_ids": [5, 6, 7, 8, 9]}\n{"id": "b", "prompt_ids": [100, 3, 250], "kind": "code"}\n')
    return p


@pytest.mark.parametrize("budget", ["15", "chain"])
def test_run_json_check_ar(cli, monkeypatch, small_prompts, budget):
    code, out, _ = cli("run", "--budget", budget, "--check-ar", "--json",
                           "--prompts", str(small_prompts), "--max-new-tokens", "12")
    assert code == EXIT_PASS
    report = json.loads(out)  # stdout is only JSON
    assert [p["ar"] for p in report["prompts"]] == ["pass", "pass"]
    assert all(len(p["output_ids"]) == 12 for p in report["prompts"])
    assert report["mean_tau"] >= 1.0


def test_run_builtin_scripted_shows_deep_acceptance(cli, monkeypatch):
    code, out, _ = cli("run", "--drafter", "scripted", "--json", "--check-ar",
                           "--max-new-tokens", "16")
    assert code == EXIT_PASS
    report = json.loads(out)
    assert len(report["prompts"]) == 6 and all(p["ar"] == "pass" for p in report["prompts"])
    assert report["mean_tau"] > 2.0


def _copy_pair(tmp_path: Path) -> tuple[Path, Path]:
    tdir, ddir = builtin_pair("hybrid")
    t, d = tmp_path / "t", tmp_path / "d"
    shutil.copytree(tdir, t)
    shutil.copytree(ddir, d)
    return t, d


def _edit(path: Path, **changes) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "case, expect_code, expect_msg",
    [
        ("missing_model", EXIT_MODEL, "not found"),
        ("malformed_config", EXIT_MODEL, "malformed config.json"),
        ("no_weights", EXIT_MODEL, "safetensors"),
        ("unknown_type", EXIT_MODEL, "not supported"),
        ("vocab_mismatch", EXIT_MODEL, "vocab"),
        ("hidden_mismatch", EXIT_MODEL, "hidden size"),
        ("draft_missing", EXIT_MODEL, "not found"),
        ("budget_negative", EXIT_USAGE, "budget"),
        ("prompt_too_long", EXIT_USAGE, "context"),
        ("prompt_oov", EXIT_USAGE, "out of range"),
        ("prompts_malformed", EXIT_USAGE, "not JSON"),
        ("prompts_missing", EXIT_USAGE, "not found"),
        ("unknown_engine", EXIT_USAGE, "engine"),
    ],
)
def test_bad_input(cli, monkeypatch, tmp_path, case, expect_code, expect_msg):
    t, d = _copy_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [5, 6, 7]}\n')
    args = ["run", "--model", str(t), "--draft", str(d), "--prompts", str(prompts), "--max-new-tokens", "4"]
    if case == "missing_model":
        args[2] = str(tmp_path / "nope")
    elif case == "malformed_config":
        (t / "config.json").write_text("{not json")
    elif case == "no_weights":
        (t / "model.safetensors").unlink()
    elif case == "unknown_type":
        _edit(t / "config.json", model_type="llama4_text")
    elif case == "vocab_mismatch":
        _edit(d / "config.json", vocab_size=999)
    elif case == "hidden_mismatch":
        _edit(d / "config.json", hidden_size=64)
    elif case == "draft_missing":
        shutil.rmtree(d)
    elif case == "budget_negative":
        args += ["--budget", "-1"]
    elif case == "prompt_too_long":
        prompts.write_text(json.dumps({"id": "a", "prompt_ids": [5] * 2047}) + "\n")
    elif case == "prompt_oov":
        prompts.write_text('{"id": "a", "prompt_ids": [5, 100000]}\n')
    elif case == "prompts_malformed":
        prompts.write_text('{"id": "a", "prompt_ids": [5, 6]}\n{oops\n')
    elif case == "prompts_missing":
        prompts.unlink()
    elif case == "unknown_engine":
        args += ["--engine", "vllm"]
    code, out, err = cli(*args)
    assert code == expect_code, err
    assert expect_msg in err
    assert "Traceback" not in err and out == ""
