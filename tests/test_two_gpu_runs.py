"""scripts/two_gpu_runs.sh's CPU parts: its stages, their commands, and what it refuses before anything runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "two_gpu_runs.sh"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_the_stages_cover_the_matrix_the_full_depth_runs_and_the_fault():
    listed = dict(line.split(None, 1) for line in _run("--list").stdout.strip().splitlines())
    assert list(listed) == ["matrix", "build64", "ddtree64", "dflash64", "ngram64", "fault64"]
    assert "--settings tp2,tp2-graphs --parallel 2" in listed["matrix"]
    assert "--layers 64" in listed["build64"]
    for stage, alg in (("ddtree64", "REFCHECK_DDTREE"), ("dflash64", "DFLASH"), ("ngram64", "NGRAM")):
        assert f"--algorithms {alg} --tp 2" in listed[stage] and "--no-bf16-replay" not in listed[stage]
    assert "--algorithms REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX --tp 2" in listed["fault64"]
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("real_width", SCRIPT.parent / "real_width.py")
    real_width = module_from_spec(spec)
    spec.loader.exec_module(real_width)
    spec = spec_from_file_location("sglang_suite", SCRIPT.parent / "sglang_suite.py")
    suite = module_from_spec(spec)
    spec.loader.exec_module(suite)
    for alg in ("REFCHECK_DDTREE", "DFLASH", "NGRAM", "REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX"):
        assert suite.CONFIGS[real_width.ALGORITHMS[alg] + "-tp2"][1] == alg  # the stage's run exists at TP 2


def test_the_matrix_knows_the_tp2_settings_the_script_names():
    from refcheck.sglang.matrix import SETTINGS

    assert SETTINGS["tp2"].gpus == SETTINGS["tp2-graphs"].gpus == 2 and SETTINGS["tp2-graphs"].serving == "graphs"


def test_an_unknown_stage_or_a_machine_without_two_gpus_is_refused_before_anything_runs(tmp_path):
    bad = _run(str(tmp_path / "o"), "nope")
    assert bad.returncode == 2 and "unknown stage 'nope'" in bad.stderr
    assert _run(str(tmp_path / "o")).returncode == 2  # no stage named
    none = _run(str(tmp_path / "o"), "matrix", env={"PATH": "/usr/bin:/bin"})  # no nvidia-smi here
    assert none.returncode == 3 and "need two GPUs" in none.stderr and not (tmp_path / "o").exists()
