"""A capture's byte budget (refcheck/sglang/capture/byte_budget.py): each scheduler process writes at most
REFCHECK_CAPTURE_MAX_BYTES of records, holding a prefix of its records; every batch past the budget is counted and
runs unrecorded, and the diff judges the steps before it with the gap declared."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from capture_kit import V, fresh_hooks, make_batch, make_scheduler, read_capture, run_prefill  # tests/capture_kit.py
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang.capture import hooks, packing
from refcheck.sglang.capture.byte_budget import (
    ENV_MAX_BYTES,
    MAX_BYTES,
    ByteBudget,
    CaptureBudgetError,
    from_megabytes,
    parse,
)
from refcheck.sglang.capture.records import ROLL_SEGMENTS, Recorder
from refcheck.sglang.capture.segments import frame_bytes, payloads, scan, segment_files
from refcheck.sglang.capture.shipper import queue_files, read_fields


@settings(max_examples=80, deadline=None)
@given(limit=st.integers(1, 400), sizes=st.lists(st.integers(0, 120), max_size=20))
def test_a_budget_admits_the_longest_prefix_that_fits_and_nothing_after(limit, sizes):
    budget = ByteBudget(limit)
    admitted = [budget.charge(n) for n in sizes]
    fits, total = 0, 0
    for n in sizes:
        if total + n > limit:
            break
        total, fits = total + n, fits + 1
    assert admitted == [True] * fits + [False] * (len(sizes) - fits)
    assert budget.used == total <= limit and budget.spent == (fits < len(sizes))


def test_an_unbounded_budget_admits_everything_and_counts_it():
    budget = ByteBudget(None)
    assert all(budget.charge(10**9) for _ in range(5)) and budget.used == 5 * 10**9 and not budget.spent


@pytest.mark.parametrize("text, message", [
    ("0", r"1\.\.\d+ bytes, got 0"), ("-5", r"got -5"), ("12x", r"whole number of bytes, got '12x'"),
    ("1.5", r"got '1.5'"), (str(MAX_BYTES + 1), r"got 1125899906842625"),
])
def test_a_budget_out_of_range_or_not_a_number_is_refused(text, message):
    with pytest.raises(CaptureBudgetError, match=message):
        parse(text)


def test_budget_texts_and_megabytes_read_as_bytes():
    assert parse(None) is None and parse("") is None and parse(" 4096 ") == 4096
    assert from_megabytes(None) is None and from_megabytes(3) == 3 << 20
    with pytest.raises(CaptureBudgetError, match=r"--capture-max-mb takes 1\.\.\d+ MiB, got 0"):
        from_megabytes(0)


def _frame_bytes(directory: Path) -> list[int]:
    """The bytes of each batch or prefill record's frame in a process directory, in order."""
    return [frame_bytes(n) for f in segment_files(directory, "records") for _, n in scan(f).frames]


def _record_bytes(rec: Recorder) -> list[int]:
    return _frame_bytes(rec.dir)


def test_the_writer_writes_records_until_one_would_cross_the_budget_and_counts_the_rest(tmp_path):
    """Records of 64 int64s each (a few hundred bytes with their headers) under a budget of three and a half: three
    are written, whole and in order, and the other five are counted past the budget, not lost and not errors."""
    probe = Recorder(tmp_path / "probe")
    probe.ship("batch", {"n": 0}, {"t": torch.arange(64)})
    assert probe.shipper.drain(10.0)
    one, = _record_bytes(probe)
    rec = Recorder(tmp_path / "capture", max_bytes=3 * one + one // 2)
    for n in range(8):
        rec.ship("batch", {"n": n}, {"t": torch.arange(64) + n})
    assert rec.shipper.drain(10.0)
    assert _record_bytes(rec) == [one] * 3 and rec.budget.spent
    fields = read_fields(queue_files(tmp_path / "capture")[0])
    assert (fields["queued"], fields["written"], fields["lost"], fields["over_budget"]) == (8, 8, 0, 5)
    rec.error("run_batch", "an error past the budget")
    assert read_fields(queue_files(tmp_path / "capture")[0])["unwritten_errors"] == 1 and rec.unwritten_errors == 1


def _decode_batches(root, monkeypatch, max_bytes: str | None, batches: int = 5):
    """A prefill of two requests, then ``batches`` target-only decode batches of both, each drained before the next
    (so the hooks see the budget as the writer left it); returns the capture read back."""
    fresh_hooks(monkeypatch, root)
    if max_bytes is None:
        monkeypatch.delenv(ENV_MAX_BYTES, raising=False)
    else:
        monkeypatch.setenv(ENV_MAX_BYTES, max_bytes)
    gen = torch.Generator().manual_seed(3)
    sched, *_ = make_scheduler()
    run_prefill(sched)
    assert hooks.drain(10.0)
    for k in range(batches):
        logits = torch.randn(2, V, generator=gen)
        hooks._run_batch(lambda self, b, lg=logits: NS(logits_output=NS(next_token_logits=lg),
                                                       next_token_ids=lg.argmax(-1)),
                         sched, make_batch("decode", False, [[7] * (k + 1), [9] * (k + 1)]))
        assert hooks.drain(10.0)
    return read_capture(root)


def test_past_its_budget_a_process_records_no_more_batches_and_counts_them(tmp_path, monkeypatch):
    """Unbounded, the prefill and five decode batches are six records. With a budget that holds the first three, the
    capture holds the prefill and both requests' steps 0 and 1; the third batch's record is refused, the fourth and
    fifth batches run unrecorded (booked plain), and all three are counted past the budget."""
    full = _decode_batches(tmp_path / "full", monkeypatch, None)
    assert not full.errors and full.over_budget == 0
    sizes = _frame_bytes(next((tmp_path / "full").glob("rank0-pid*")))
    assert len(sizes) == 6
    limit = sum(sizes[:3]) + min(sizes[3:]) // 2
    cap = _decode_batches(tmp_path / "bounded", monkeypatch, str(limit))
    assert not cap.errors, cap.errors
    assert [(s.rid, s.meta["step_index"]) for s in cap.steps[0]] == [("r0", 0), ("r1", 0), ("r0", 1), ("r1", 1)]
    assert len(cap.prefills[0]) == 2 and cap.over_budget == 3
    written = _frame_bytes(next((tmp_path / "bounded").glob("rank0-pid*")))
    assert len(written) == 3 and sum(written) <= limit
    assert cap.cost["recorded_batches"] == 3 and cap.cost["plain_batches"] == 2, cap.cost
    assert cap.status[0]["max_bytes"] == limit
    hooks._error("run_batch", "a hook error past the budget")
    assert any("1 hook error record(s) could not be written" in e for e in read_capture(tmp_path / "bounded").errors)


def test_a_bad_budget_in_the_engine_is_an_error_record_and_the_capture_runs_unbounded(tmp_path, monkeypatch):
    cap = _decode_batches(tmp_path, monkeypatch, "12x", batches=2)
    assert [e for e in cap.errors if "REFCHECK_CAPTURE_MAX_BYTES" in e and "'12x'" in e], cap.errors
    assert len(cap.steps[0]) == 4 and cap.over_budget == 0 and cap.status[0]["max_bytes"] is None


def test_trace_show_says_which_steps_a_capture_holds_and_what_it_cost(tmp_path):
    """``refcheck trace show``'s capture lines: the sampling rule, batches lost and past the byte budget, and the
    ledger per batch; a full capture with no budget says it holds every batch."""
    from dataclasses import replace

    from click.testing import CliRunner

    from refcheck.cli.app import main
    from refcheck.trace.io import write_trace

    from trace_helpers import make_trace  # tests/trace_helpers.py

    trace = make_trace(n_requests=1, n_steps=2)
    cost = {"recorded_batches": 4, "recorded_ms_per_batch": 5.5, "hooks_ms_per_batch": 1.25, "plain_batches": 60,
            "plain_ms_per_batch": 3.9, "passed_ms_per_plain_batch": 0.041, "writer_ms_per_record": 0.4}
    capture = {"sample": {"every": 16, "seed": 3}, "max_bytes": 64 << 20,
               "stats": {"lost_batches": 2, "over_budget_batches": 12, "capture_cost": cost}}
    write_trace(replace(trace, provenance={**trace.provenance, "capture": capture}), tmp_path / "t.arrow")
    out = CliRunner().invoke(main, ["trace", "show", str(tmp_path / "t.arrow")])
    assert out.exit_code == 0, out.output
    assert ("capture: 1 batch in 16 (seed 3) · 2 batch record(s) lost to a full queue · a budget of 64 MiB per "
            "process, 12 batch(es) past it") in out.output
    assert ("capture cost: 4 recorded batch(es) of 5.500 ms (hooks 1.250 ms), 60 plain of 3.900 ms (passing over "
            "0.041 ms) · writer 0.400 ms per record\n") in out.output
    graphed = {**cost, "graph_replays_per_batch": 3.25, "graph_eager_per_batch": 0.75,
               "graph_eager_by_cache": {"state": 0.0, "verify": 0.75, "draft": 0.0, "context": 0.0}}
    write_trace(replace(trace, provenance={**trace.provenance, "capture": {**capture, "stats": {"capture_cost": graphed}}}),
                tmp_path / "graphed.arrow")
    out = CliRunner().invoke(main, ["trace", "show", str(tmp_path / "graphed.arrow")])
    assert ("writer 0.400 ms per record · per recorded batch 3.25 graph replay(s), 0.75 eager run(s) (verify 0.75)\n"
            in out.output), out.output
    write_trace(replace(trace, provenance={**trace.provenance, "capture": {"sample": {"every": 1, "seed": 0}}}),
                tmp_path / "full.arrow")
    out = CliRunner().invoke(main, ["trace", "show", str(tmp_path / "full.arrow")])
    assert "capture: every batch\n" in out.output and "capture cost" not in out.output


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(50, 400), sizes=st.lists(st.integers(1, 120), max_size=20))
def test_a_rolling_budget_keeps_the_latest_records_that_fit(limit, sizes):
    """Each record first has the oldest ones deleted until it fits: the records kept are the latest run of them
    that fits, a record larger than the bound is refused alone, and the budget is never spent."""
    budget, kept = ByteBudget(limit, roll=True), []

    def evict():
        return kept.pop(0) if kept else None

    for n in sizes:
        if budget.charge(n, evict):
            kept.append(n)
        else:
            assert n > limit
    assert not budget.spent and budget.used == sum(kept) <= limit
    fits = [n for n in sizes if n <= limit]
    tail: list[int] = []
    for n in reversed(fits):
        if sum(tail) + n > limit:
            break
        tail.insert(0, n)
    assert kept[-len(tail):] == tail if tail else not kept


def test_a_rolling_budget_needs_a_bound():
    with pytest.raises(CaptureBudgetError, match="needs REFCHECK_CAPTURE_MAX_BYTES"):
        ByteBudget(None, roll=True)


def _kept(rec: Recorder, prefix: str = "records") -> list[object]:
    """The records a process directory holds, in order: each batch record's ``n``, each error record's message."""
    out = []
    for f in segment_files(rec.dir, prefix):
        for data in payloads(f, scan(f).frames):
            record = packing.decode(data)
            out.append(record.get("n", record.get("message")))
    return out


def test_a_rolling_recorder_deletes_its_oldest_batch_records_and_never_an_error_record(tmp_path):
    """Eight records under a rolling budget of three and a half, each in a segment of its own (a sixteenth of the
    budget is less than one): the last three batch records are left, and the error record written before them; the
    five oldest deleted and counted, none refused."""
    probe = Recorder(tmp_path / "probe")
    probe.ship("batch", {"n": 0}, {"t": torch.arange(64)})
    assert probe.shipper.drain(10.0)
    one, = _record_bytes(probe)
    rec = Recorder(tmp_path / "capture", max_bytes=3 * one + one // 2, roll=True)
    rec.error("run_batch", "an early error")
    for n in range(8):
        rec.ship("batch", {"n": n}, {"t": torch.arange(64) + n})
        assert rec.shipper.drain(10.0)
    assert _kept(rec) == [5, 6, 7] and _kept(rec, "errors") == ["an early error"]
    fields = read_fields(queue_files(tmp_path / "capture")[0])
    assert (fields["rolled_out"], fields["over_budget"], fields["lost"]) == (5, 0, 0) and not rec.budget.spent


@settings(max_examples=15, deadline=None)
@given(records=st.integers(1, 120), budget_in_records=st.integers(2, 48))
def test_a_rolling_recorder_keeps_the_latest_records_filling_all_but_a_segment_of_its_budget(
        tmp_path_factory, records, budget_in_records):
    """Records of one size under a rolling budget of a whole number of them, written in segments of a sixteenth of
    it: the records kept are the latest ones, within the budget, and fill it but for less than a segment and a
    record; every record written is kept or counted deleted."""
    root = tmp_path_factory.mktemp("roll")
    probe = Recorder(root / "probe")
    probe.write("batch", packing.encode({"n": 1000}, []))  # every n of four digits: records of one size
    one, = _record_bytes(probe)
    limit = budget_in_records * one
    rec = Recorder(root / "capture", max_bytes=limit, roll=True)
    for n in range(records):
        rec.write("batch", packing.encode({"n": 1000 + n}, []))
    kept = _kept(rec)
    assert kept == list(range(1000 + records - len(kept), 1000 + records))
    assert len(kept) * one <= limit
    assert len(kept) == records or len(kept) * one > limit - max(1, limit // ROLL_SEGMENTS) - one
    assert rec.shipper.counts.values["rolled_out"] == records - len(kept)


def test_past_a_rolling_budget_the_hooks_keep_recording_the_latest_batches(tmp_path, monkeypatch):
    """REFCHECK_CAPTURE_ROLL=1 with the budget that held three records: every batch is recorded, the directory holds
    the latest records, and the oldest are counted deleted; a served trace of it leaves out the requests whose first
    records went and says so."""
    full = _decode_batches(tmp_path / "full", monkeypatch, None)
    sizes = _frame_bytes(next((tmp_path / "full").glob("rank0-pid*")))
    limit = sum(sizes[:3]) + min(sizes[3:]) // 2
    monkeypatch.setenv("REFCHECK_CAPTURE_ROLL", "1")
    cap = _decode_batches(tmp_path / "rolled", monkeypatch, str(limit))
    assert not cap.errors and full.over_budget == 0, cap.errors
    assert cap.over_budget == 0 and cap.rolled_out >= 2 and cap.cost["recorded_batches"] == 5
    assert cap.status[0]["roll"] is True
    kept = {s.meta["step_index"] for s in cap.steps[0]}
    assert 4 in kept and 0 not in kept  # the latest batch is there, the first one went


def test_a_roll_without_a_budget_is_said_and_nothing_rolls(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCHECK_CAPTURE_ROLL", "1")
    cap = _decode_batches(tmp_path, monkeypatch, None, batches=2)
    assert [e for e in cap.errors if "REFCHECK_CAPTURE_ROLL" in e and "not set" in e], cap.errors
    assert len(cap.steps[0]) == 4 and cap.rolled_out == 0 and cap.status[0]["roll"] is False
