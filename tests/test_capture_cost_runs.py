"""scripts/capture_cost_runs.sh on the CPU, with a stand-in python3 on PATH: bad arguments, what it packs, and a
measurement killed at its time limit with what it wrote kept."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "capture_cost_runs.sh"

# a stand-in for `python3 scripts/capture_cost.py --out DIR ...`: writes one cell's files, then sleeps SLEEP seconds
FAKE = """#!/bin/bash
if [ "$1" = scripts/bench_capture_device.py ]; then
  echo "bench: $*"; echo '{"rows": []}' > "$5"; exit 0
fi
out=$3
mkdir -p "$out/dflash-graphs-mixed/records/rank0-pid7"
echo '[]' > "$out/capture_cost.json"
echo '{}' > "$out/dflash-graphs-mixed/job.json"
echo '# profile' > "$out/dflash-graphs-mixed/records/profile-rank0-pid7.txt"
echo 'r' > "$out/dflash-graphs-mixed/records/rank0-pid7/records-000000.seg"
echo "args: $*"
sleep "${SLEEP:-0}"
echo '| table |' > "$out/capture_cost.md"
"""


def _run(tmp_path: Path, *args: str, sleep: str = "0", min_s: str = "30",
         end_s: str | None = "45", bench: str = "") -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(FAKE)
    (bin_dir / "python3").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k != "END_S"}, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GPU_TESTS": "", "SLEEP": sleep, "MIN_S": min_s, "DEVICE_BENCH": bench,
           **({"END_S": end_s} if end_s is not None else {})}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("args", [[], ["OUT"], ["OUT", "ten"]])
def test_bad_arguments_are_exit_2(tmp_path, args):
    got = _run(tmp_path, *args)
    assert got.returncode == 2 and "usage: capture_cost_runs.sh OUT SECONDS" in got.stderr


def test_a_finished_measurement_is_packed_with_its_log(tmp_path):
    """The cells' files, their scheduler's profile window and the log, under the names the results take (not the
    records); the arguments reach capture_cost.py after the rounds' end, --until: the seconds left less END_S."""
    got = _run(tmp_path, str(tmp_path / "o"), "60", "--cells", "DFLASH:on:mixed")
    assert got.returncode == 0, got.stderr
    with tarfile.open(tmp_path / "o" / "capture-cost.tgz") as tar:
        names = sorted(tar.getnames())
        log = tar.extractfile("log.txt").read().decode()
    assert names == ["cost/capture_cost.json", "cost/capture_cost.md", "cost/dflash-graphs-mixed/job.json",
                     "cost/dflash-graphs-mixed/records/profile-rank0-pid7.txt", "log.txt"]
    until = re.search(rf"--out {re.escape(str(tmp_path / 'o' / 'cost'))} --until (\d+) --cells DFLASH:on:mixed$", log,
                      re.M)
    assert until and 13 <= int(until.group(1)) <= 15, log


def test_the_rounds_end_is_the_seconds_left_less_end_s_and_an_until_given_wins(tmp_path):
    """--until is what SECONDS leaves less END_S (placed before the arguments, so one among them is the one
    argparse keeps); with no second left for it, no measurement starts."""
    got = _run(tmp_path, str(tmp_path / "o"), "100", "--until", "7", end_s="20")
    assert got.returncode == 0, got.stderr
    log = (tmp_path / "o" / "log.txt").read_text()
    until = re.search(r"--until (\d+) --until 7$", log, re.M)
    assert until and 78 <= int(until.group(1)) <= 80, log
    none = _run(tmp_path, str(tmp_path / "p"), "40", min_s="30", end_s="45")
    assert none.returncode == 124
    assert "no measurement" in (tmp_path / "p" / "log.txt").read_text()


def test_end_s_defaults_to_45_seconds_and_to_150_for_a_pair_of_ones_own(tmp_path):
    """Without END_S, the rounds end 45 s before SECONDS runs out, or 150 s with --model among the arguments (the
    real-width pair's shutdown and trace reading take longer)."""
    for args, want in (((), 155), (("--model", "/m", "--draft", "/d"), 50)):
        out = tmp_path / str(want)
        got = _run(tmp_path, str(out), "200", *args, end_s=None)
        assert got.returncode == 0, got.stderr
        until = re.search(r"--until (\d+)", (out / "log.txt").read_text())
        assert until and want - 2 <= int(until.group(1)) <= want, (out / "log.txt").read_text()


def test_a_measurement_past_its_seconds_is_killed_and_what_it_wrote_is_kept(tmp_path):
    """Two seconds for a measurement that sleeps a minute after writing its JSON: killed (124), the JSON and the
    cell's job packed; with less than MIN_S left, none starts."""
    got = _run(tmp_path, str(tmp_path / "o"), "2", sleep="60", min_s="1", end_s="0")
    assert got.returncode == 124
    with tarfile.open(tmp_path / "o" / "capture-cost.tgz") as tar:
        assert sorted(tar.getnames()) == ["cost/capture_cost.json", "cost/dflash-graphs-mixed/job.json",
                                          "cost/dflash-graphs-mixed/records/profile-rank0-pid7.txt", "log.txt"]
    none = _run(tmp_path, str(tmp_path / "p"), "5", min_s="30")
    assert none.returncode == 124
    assert "left after the GPU tests: no measurement" in (tmp_path / "p" / "log.txt").read_text()


def test_device_bench_runs_before_the_measurement_and_is_packed(tmp_path):
    """DEVICE_BENCH=real: bench_capture_device.py --widths real writes its table and JSON beside the cells' files."""
    got = _run(tmp_path, str(tmp_path / "o"), "60", "--cells", "DFLASH:on:mixed", bench="real")
    assert got.returncode == 0, got.stderr
    with tarfile.open(tmp_path / "o" / "capture-cost.tgz") as tar:
        names = set(tar.getnames())
        table = tar.extractfile("device-bench.txt").read().decode()
    assert {"device-bench.txt", "device-bench.json", "cost/capture_cost.json", "log.txt"} <= names
    want = f"bench: scripts/bench_capture_device.py --widths real --json {tmp_path / 'o'}/device-bench.json"
    assert table.startswith(want), table
    assert table.rstrip().endswith("exit 0")
