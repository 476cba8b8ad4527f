"""``refcheck capture show`` (refcheck/cli/capture.py over refcheck/sglang/capture/inventory.py): what a capture
directory holds, per scheduler process, from frame heads, counters and status alone."""

from __future__ import annotations

import json
import os

import torch

from refcheck.errors import EXIT_PASS, EXIT_USAGE
from refcheck.sglang.capture.inventory import inventory
from refcheck.sglang.capture.records import Recorder
from refcheck.sglang.capture.segments import segment_files


def _recorded(root, records: int = 3, **budget) -> Recorder:
    """A process that wrote ``records`` batch records of 32 int64s, one error record and its status."""
    rec = Recorder(root, **budget)
    for n in range(records):
        rec.ship("batch", {"n": n}, {"t": torch.arange(32) + n})
    assert rec.shipper.drain(10.0)
    rec.error("run_batch", "boom\nTraceback: the rest")
    rec.status({"sglang": "0.5.17", "sample": {"every": 16, "seed": 3}, "max_bytes": budget.get("max_bytes"),
                "roll": budget.get("roll", False)})
    return rec


def test_the_inventory_counts_records_bytes_and_errors_from_heads_and_counters(tmp_path):
    rec = _recorded(tmp_path)
    p, = inventory(tmp_path)
    assert (p.name, p.rank, p.tag) == (rec.dir.name, 0, str(os.getpid()))
    assert (p.records, p.segments, p.error_records) == (3, 1, 1)
    assert p.record_bytes == sum(f.stat().st_size for f in segment_files(rec.dir, "records")) > 3 * 32 * 8
    assert p.first_error == "run_batch: boom" and not p.torn and not p.problems and not p.old_files
    assert {k: p.counts[k] for k in ("queued", "written", "lost", "over_budget", "rolled_out")} == \
        {"queued": 3, "written": 3, "lost": 0, "over_budget": 0, "rolled_out": 0}
    assert p.status["sample"] == {"every": 16, "seed": 3}


def test_capture_show_prints_each_process_and_what_to_run_next(tmp_path, cli):
    rec = _recorded(tmp_path, records=5, max_bytes=4 << 20, roll=True)
    code, out, err = cli("capture", "show", str(tmp_path))
    assert code == EXIT_PASS, err
    assert f"{tmp_path}: capture directory, 1 scheduler process(es), SGLang 0.5.17" in err
    assert f"{rec.dir.name}: 5 record(s) in " in err and "1 error record(s)" in err
    assert "  queue: 5 queued, 5 written · lost 0 · past the budget 0 · rolled out 0 · 0 request(s) met" in err
    assert "  capture: 1 batch in 16 (seed 3) · a budget of 4 MiB, rolling" in err
    assert "  first error: run_batch: boom" in err and "Traceback" not in err
    assert f"next: refcheck trace import {tmp_path} --out served.arrow" in err
    code, out, _ = cli("capture", "show", str(tmp_path), "--json")
    assert code == EXIT_PASS
    p, = json.loads(out)["processes"]
    assert (p["records"], p["error_records"], p["counts"]["written"]) == (5, 1, 5)


def test_torn_ends_old_record_files_and_missing_counters_are_said(tmp_path, cli):
    rec = _recorded(tmp_path)
    seg, = segment_files(rec.dir, "records")
    with open(seg, "ab") as f:
        f.write(b"RCF1\x10")  # the head of a frame being written
    (rec.dir / "00000000.rec").write_bytes(b"RCAP1\n")
    next(tmp_path.glob("queue-rank0-pid*.bin")).unlink()
    code, _, err = cli("capture", "show", str(tmp_path))
    assert code == EXIT_PASS, err
    assert "  torn: records-000000.seg: a frame cut short at byte" in err and "the frame being written" in err
    assert "  1 record file(s) of the one-file-per-record format (*.rec): not read" in err
    assert "  unreadable: queue-rank0-pid" in err and "queue:" not in err


def test_a_path_that_is_not_a_capture_directory_is_exit_2_in_one_line(tmp_path, cli):
    for path in (tmp_path / "nowhere", tmp_path):
        code, out, err = cli("capture", "show", str(path))
        lines = [line for line in err.splitlines() if line.startswith("refcheck: error:")]
        assert code == EXIT_USAGE and "Traceback" not in err and len(lines) == 1, err
        assert "is not a capture directory: no status-rank*-pid*.json in it" in lines[0]
