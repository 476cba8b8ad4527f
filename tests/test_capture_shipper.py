"""The capture's way out of the engine: the shipper's queue and writer thread, its counts, and the sampling rule.

The writer is made to stall (a write that waits on an event) so that the queue fills: a full queue loses the
record and counts it instead of blocking the engine, and a reader sees both the loss and records still queued.
"""

from __future__ import annotations

import threading

import pytest
import torch

from refcheck.sglang.capture import packing
from refcheck.sglang.capture.records import Recorder, read_capture
from refcheck.sglang.capture.sample_rule import CaptureSampleError, SampleRule, parse, rule_for, sampled_rid
from refcheck.sglang.capture.shipper import Shipper, read_counts, wait_drained


def _stalled(tmp_path, depth: int):
    gate, written = threading.Event(), []

    def write(kind, data):
        gate.wait(10.0)
        written.append((kind, packing.decode(data)))

    return Shipper(write, lambda where, msg: None, tmp_path / "queue-rank0-pid1.bin", depth=depth), gate, written


def test_a_full_queue_loses_and_counts_the_record_without_blocking(tmp_path):
    shipper, gate, written = _stalled(tmp_path, depth=1)
    src = torch.arange(4)
    assert shipper.ship("batch", {"n": 0}, {"t": src})
    while shipper.counts.queued == 1 and not shipper._queue.empty():  # the writer takes the first and stalls
        pass
    assert shipper.ship("batch", {"n": 1}, {"t": src})
    assert not shipper.ship("batch", {"n": 2}, {"t": src})  # full: not queued, counted
    assert read_counts(tmp_path / "queue-rank0-pid1.bin") == (2, 0, 1)
    assert wait_drained(tmp_path, timeout_s=0.05) == {"queue-rank0-pid1.bin": 2}
    src += 100  # the engine reuses its buffer: the record holds what it was at ship time
    gate.set()
    assert shipper.drain(10.0) and wait_drained(tmp_path, timeout_s=1.0) == {}
    assert [p["n"] for _, p in written] == [0, 1] and written[1][1]["t"].tolist() == [0, 1, 2, 3]
    assert read_counts(tmp_path / "queue-rank0-pid1.bin") == (2, 2, 1)


def test_the_reader_reports_records_still_queued_and_records_lost(tmp_path):
    rec = Recorder(tmp_path)
    queue_file = rec.shipper.counts.path
    queue_file.write_bytes((3).to_bytes(8, "little") + (1).to_bytes(8, "little") + (2).to_bytes(8, "little"))
    cap = read_capture(tmp_path)
    assert cap.lost == 2 and any("2 of 3 captured batches were still queued" in e for e in cap.errors)
    queue_file.write_bytes(b"short")
    assert any("unreadable capture queue counts" in e for e in read_capture(tmp_path).errors)


def test_the_sampling_rule_records_one_batch_in_n_at_a_seeded_phase():
    rule = SampleRule(16, seed=7)
    assert sum(rule.takes(g) for g in range(160)) == 10
    first = (16 - rule.phase) % 16
    assert [g for g in range(32) if rule.takes(g)] == [first, first + 16]
    assert len({SampleRule(16, seed=s).phase for s in range(40)}) > 8  # seeds choose different phases
    assert SampleRule().full and all(SampleRule().takes(g) for g in range(5))
    assert parse("16:7") == rule and parse("4") == SampleRule(4, 0) and parse(None) == SampleRule()
    marked = sampled_rid(SampleRule(4, 2), "refcheck-1-0-p")
    assert rule_for(marked, rule) == SampleRule(4, 2) and rule_for("refcheck-1-0-p", rule) is rule
    assert rule_for("refcheck-sample-x", rule) is rule


@pytest.mark.parametrize("text", ["0", "-3", "1000001", "16:-1", "x", "16:y", "1.5"])
def test_a_sampling_rule_out_of_range_is_refused(text):
    with pytest.raises(CaptureSampleError):
        parse(text)


def test_a_record_round_trips_through_its_packed_bytes():
    """Nested fields and tensors of every dtype a record holds come back equal; CUDA-first numbering keeps each
    tensor in its place; a torn file is refused."""
    nest = {"type": "batch", "rids": ["a", "b"], "meta": {"x": 1.5, "flag": True, "none": None},
            "t": {"ids": torch.tensor([[1, 2], [3, 4]]), "lp": torch.tensor([0.5, float("nan")]),
                  "empty": torch.zeros(0, 3), "scalar": torch.tensor(7, dtype=torch.int32),
                  "half": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "mask": torch.tensor([True, False])},
            "state": {"kv_k.1": (1, "kv_k", torch.arange(6.0).reshape(1, 2, 3), None)}}
    skeleton, ts = packing.pack(nest)
    back = packing.decode(packing.encode(skeleton, packing.table(ts), packing.flatten(ts).numpy().tobytes()))
    assert back["rids"] == ["a", "b"] and back["meta"] == {"x": 1.5, "flag": True, "none": None}
    for k, v in nest["t"].items():
        assert back["t"][k].dtype == v.dtype and torch.equal(back["t"][k].nan_to_num(), v.nan_to_num()), k
    layer, kind, sketch, full = back["state"]["kv_k.1"]
    assert (layer, kind, full) == (1, "kv_k", None) and torch.equal(sketch, nest["state"]["kv_k.1"][2])
    data = packing.encode(skeleton, packing.table(ts), packing.flatten(ts).numpy().tobytes())
    with pytest.raises(ValueError):
        packing.decode(data[:-3])
    with pytest.raises(ValueError):
        packing.decode(b"PK\x03\x04 a zip")
