"""scripts/bench_capture_ship.py: it ships and writes every record it times, and refuses a --vs that is no checkout."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_capture_ship.py"


def test_measure_times_records_that_were_all_written(tmp_path, monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_capture_ship as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda prefix="": str(tmp_path))
    got = bench.measure(5)
    assert got["ship_ms"] > 0 and got["cpu_ms"] > 0
    from refcheck.sglang.capture.records import read_capture

    cap = read_capture(tmp_path)
    assert not cap.errors and cap.lost == 0 and len(cap.steps[0]) == 5 * 32  # every record, every request


@pytest.mark.parametrize("args", [["--vs", "/nonexistent"], ["--records", "0"]])
def test_bad_arguments_are_refused_before_anything_runs(args):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "error:" in out.stderr


def test_pass_over_times_batches_the_rule_passes_over(tmp_path, monkeypatch):
    """bench_capture_ship.pass_over: every timed batch goes through the hooks' traced path and is passed over (its
    requests' steps counted, nothing recorded, no error)."""
    from capture_kit import fresh_hooks

    from refcheck.sglang.capture import hooks
    from refcheck.sglang.capture.records import read_capture

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_capture_ship as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    fresh_hooks(monkeypatch, tmp_path)  # its environment restored after pass_over sets its own
    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda prefix="": str(tmp_path))
    assert bench.pass_over(3, batches=50) > 0
    assert hooks._clock.batches == 150 and len(hooks._clock) == 3
    cap = read_capture(tmp_path)
    assert not cap.errors and not cap.steps.get(0)


def test_calls_per_batch_counts_the_hooks_torch_calls_on_the_engines_thread():
    """bench_capture_ship.calls_per_batch: the same count every run (the stand-ins are seeded, the writer thread's
    calls are not the engine's); a graph cache's computation counts as its replay (one launch and a copy per input),
    so the eager path, whose every call is counted, makes more. A graph's outputs pack as one buffer (packing.Packed):
    85 calls, where packing each of the record's tensors on its own makes 162."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_capture_ship as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    first, second = bench.calls_per_batch(), bench.calls_per_batch()
    assert first == second and 50 < first < 120, (first, second)
    assert bench.calls_per_batch(graphed=False) > first + 50


def test_writer_drag_times_each_place_of_a_batch_against_the_16th_that_ships(monkeypatch, tmp_path):
    """bench_capture_ship.writer_drag: stand-in batches without capture, then with one record shipped in ``every``;
    every record is written, each place's mean is the stand-in batch's length or more, and the drag per record is a
    finite excess."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_capture_ship as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda prefix="": str(tmp_path))
    got = bench.writer_drag(batches=16, every=4, python_us=100.0, wait_s=0.0005)
    assert set(got) == set(bench.DRAG_KEYS) and all(got[k] >= 0.6 for k in bench.DRAG_KEYS[:4]), got
    # the drag sums the four places' excess over an untraced batch: a record's period cannot lose more than it took
    assert math.isfinite(got["drag_ms"]) and got["drag_ms"] < 4 * got["rest_ms"], got
    from refcheck.sglang.capture.records import read_capture

    cap = read_capture(tmp_path)
    assert not cap.errors and len(cap.steps[0]) == 4 * 32  # four records of 32 requests


def test_calls_per_batch_counts_target_only_steps_too():
    """kind="target": NONE's target-only steps, whose node reductions replay from a graph: fewer calls than eagerly."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_capture_ship as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    graphed = bench.calls_per_batch(kind="target")
    assert 20 < graphed < bench.calls_per_batch(kind="target", graphed=False) - 20, graphed


def test_sites_prints_the_calls_per_batch_by_where_they_are_made(capsys):
    """--sites: the graphed DFLASH total, then one line per call site, summing to it; the graphs' replays named."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_capture_ship as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert bench.main(["--sites"]) == 0
    head, *lines, writer, carry = capsys.readouterr().out.strip().splitlines()
    assert writer.startswith("writer, per DFLASH-sized record: header ") and writer.endswith(" us")
    assert carry.startswith("context pieces: ") and carry.endswith(" us per recorded batch of 32 requests")
    total = float(head.rsplit(":", 1)[1])
    sites = {line.split(None, 1)[1]: float(line.split(None, 1)[0]) for line in lines}
    assert total == bench.calls_per_batch() and abs(sum(sites.values()) - total) < 1e-9
    assert {"graph:chain", "graph:draft", "graph:context", "packing.py:table"} <= set(sites), sites
    assert any(site.startswith("graph:state (bucket ") for site in sites), sites
