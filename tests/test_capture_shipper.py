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
from refcheck.sglang.capture.shipper import FIELDS, Shipper, ledger_summary, read_counts, read_fields, wait_drained


def _stalled(tmp_path, depth: int):
    gate, written = threading.Event(), []

    def write(kind, data):
        gate.wait(10.0)
        written.append((kind, packing.decode(b"".join(data))))

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
    """The counts go through the recorder's own Counters: the file is its memory map, which the process's garbage
    collection callback republishes at any time (bytes written to the file behind it would be overwritten)."""
    rec = Recorder(tmp_path)
    rec.shipper.counts.add(queued=3, written=1, lost=2)
    cap = read_capture(tmp_path)
    assert cap.lost == 2 and any("2 of 3 captured batches were still queued" in e for e in cap.errors)
    (tmp_path / "queue-rank1-pid1.bin").write_bytes(b"short")  # another process's counts, cut short
    assert any("unreadable capture queue counts" in e for e in read_capture(tmp_path).errors)


def test_a_counters_file_an_earlier_refcheck_wrote_reads_with_the_fields_it_lacks_as_zero(tmp_path):
    """Counters are only appended to FIELDS: a file holding the first ones (an earlier release's directory, read by
    ``trace import``) reads with the rest 0; a size that is no run of whole fields, or fewer than the queue's three
    counts, is refused."""
    import struct

    older = FIELDS[:FIELDS.index("requests")]  # a release that counted no requests met
    f = tmp_path / "queue-rank0-pid1.bin"
    f.write_bytes(struct.pack("<" + "Q" * len(older), *range(1, len(older) + 1)))
    fields = read_fields(f)
    assert [fields[k] for k in older] == list(range(1, len(older) + 1))
    assert all(fields[k] == 0 for k in FIELDS[len(older):])
    assert read_capture(tmp_path).requests_met == 0
    for size in (8 * len(older) + 3, 16, 8 * (len(FIELDS) + 1)):
        f.write_bytes(bytes(size))
        with pytest.raises(ValueError):
            read_fields(f)


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
    skeleton, ts, n_dev = packing.pack(nest)
    assert n_dev == 0  # CPU tensors only: the CUDA-first numbering is the GPU tests'
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


def test_a_nest_packed_ahead_comes_back_as_if_packed_with_its_record():
    """A record holding Packed nests (as a graph's outputs are: tensors of every dtype, a scalar, an empty one, tuples,
    plain values) beside loose tensors decodes to the record packed whole; the pack's views are its tensors; a
    pack's table entry bounds its bytes (a torn pack is refused)."""
    inner = {"ids": torch.tensor([[1, 2], [3, 4]]), "lp": torch.tensor([0.5, float("nan")]), "k": torch.tensor(8),
             "empty": torch.zeros(0, 3), "half": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
             "kv": {"kv_k.1": (1, "kv_k", torch.arange(6.0).reshape(1, 2, 3), None)}, "layers": [0, 2]}
    flat = {"type": "batch", "rids": ["a", "b"], "t": {"nodes": inner, "cand": torch.tensor([7, 9])},
            "draft": {"mask": torch.tensor([True, False])}}
    packed = {**flat, "t": {**flat["t"], "nodes": packing.prepack(inner)}, "draft": packing.prepack(flat["draft"])}

    def round_trip(nest):
        skeleton, ts, _ = packing.pack(nest)
        return packing.decode(packing.encode(skeleton, packing.table(ts), packing.flatten(ts).numpy().tobytes()))

    want, got = round_trip(flat), round_trip(packed)
    assert len(packing.pack(packed)[1]) == 3  # two packs and one loose tensor

    def same(a, b):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
        elif isinstance(a, dict):
            assert set(a) == set(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, list):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    same(want, got)
    same(round_trip({"x": inner})["x"], round_trip({"x": packing.prepack(inner).unpacked()})["x"])
    skeleton, ts, _ = packing.pack(packed)
    entries = packing.table(ts)
    entries[0]["packed"]["tensors"][0]["bytes"] += 10**6  # a pack whose table reaches past its bytes
    with pytest.raises(ValueError, match="cut short"):
        packing.decode(packing.encode(skeleton, entries, packing.flatten(ts).numpy().tobytes()))


def test_the_writer_and_the_hooks_book_their_cost_in_the_ledger(tmp_path):
    """The writer's CPU per record and the hooks' batch times land in the counters file; the summary gives
    milliseconds per batch and per record, and None where nothing was counted."""
    shipper = Shipper(lambda kind, data: sum(range(20000)), lambda where, msg: None, tmp_path / "queue-rank0-pid1.bin")
    for n in range(3):
        shipper.ship("batch", {"n": n}, {"t": torch.arange(4)})
    assert shipper.drain(10.0)
    shipper.counts.add(plain_batches=2, plain_ns=6_000_000, recorded_batches=1, recorded_ns=5_000_000,
                       hooks_ns=1_500_000, graph_replays=3, graph_eager=1, graph_eager_state=1)
    fields = read_fields(tmp_path / "queue-rank0-pid1.bin")
    assert (fields["queued"], fields["written"], fields["lost"]) == (3, 3, 0) and fields["writer_ns"] > 0
    cost = ledger_summary(fields, fields["written"])
    assert cost["plain_ms_per_batch"] == 3.0 and cost["recorded_ms_per_batch"] == 5.0
    assert cost["hooks_ms_per_batch"] == 1.5 and 0 < cost["writer_ms_per_record"] == round(fields["writer_ns"] / 3e6, 4)
    assert (cost["graph_replays_per_batch"], cost["graph_eager_per_batch"]) == (3.0, 1.0)
    assert cost["graph_eager_by_cache"] == {"state": 1.0, "verify": 0.0, "draft": 0.0, "context": 0.0}
    # counts by cache that do not add up to the total (a process that counted no cache apart): none said
    assert ledger_summary({**fields, "graph_eager": 2}, fields["written"])["graph_eager_by_cache"] is None
    assert ledger_summary(dict.fromkeys(FIELDS, 0), 0)["recorded_ms_per_batch"] is None


def test_the_ledger_books_the_hooks_time_before_a_plain_batch_and_the_process_garbage_collections(tmp_path):
    """A plain batch's ``passed`` time (the hooks deciding to pass it over) per plain batch, and every garbage
    collection of the process, whichever thread runs it, with its time, per decode batch."""
    import gc
    import threading

    shipper = Shipper(lambda kind, data: None, lambda where, msg: None, tmp_path / "queue-rank0-pid1.bin")
    before = read_fields(tmp_path / "queue-rank0-pid1.bin")
    gc.collect()
    t = threading.Thread(target=gc.collect)
    t.start()
    t.join()
    shipper.counts.add(plain_batches=4, plain_ns=8_000_000, passed_ns=200_000)
    fields = read_fields(tmp_path / "queue-rank0-pid1.bin")
    assert fields["gc_collections"] - before["gc_collections"] >= 2 and fields["gc_ns"] > before["gc_ns"]
    cost = ledger_summary(fields, 0)
    assert cost["passed_ms_per_plain_batch"] == 0.05 and cost["gc_collections"] == fields["gc_collections"]
    assert cost["gc_ms_per_batch"] == round(fields["gc_ns"] / 1e6 / 4, 4)


def test_off_cuda_a_graph_cache_runs_the_computation_as_it_is():
    """Off CUDA the capture's graph cache (refcheck/sglang/capture/graphs.py) captures nothing: each call is
    the computation itself, with the call's own inputs (its replay on the GPU: tests/test_gpu.py)."""
    from refcheck.sglang.capture.graphs import GraphCache

    cache = GraphCache(lambda key, exc: pytest.fail(f"no capture off CUDA ({exc})"))
    for n in (1, 2, 3):
        x = torch.arange(n)
        assert torch.equal(cache.run(("k", 1), lambda t: t * 2 + 1, x), x * 2 + 1)
    assert len(cache) == 0


def test_each_pass_gets_what_it_booked_in_the_ledger(tmp_path, monkeypatch):
    """The engine process reads the ledger around its passes (refcheck/sglang/child.py): the captured pass's summary
    is the difference of two reads summed over the scheduler processes, so a one-off cost of an earlier pass (a
    graph's capture, a kernel's first load) is not spread over the timed one."""
    from refcheck.sglang import child
    from refcheck.sglang.capture.shipper import Counters

    monkeypatch.setenv("REFCHECK_CAPTURE_DIR", str(tmp_path))
    ranks = [Counters(tmp_path / f"queue-rank{r}-pid{r + 1}.bin") for r in range(2)]
    for c in ranks:
        c.add(recorded_batches=5, recorded_ns=500_000_000, hooks_ns=400_000_000)  # a warm-up with one-off costs
    start = child._ledger()
    for c in ranks:
        c.add(recorded_batches=10, recorded_ns=40_000_000, hooks_ns=10_000_000, state_ns=5_000_000, written=10,
              writer_ns=3_000_000)
    costs = child._pass_costs(start, child._ledger(), {})
    assert costs["captured"]["recorded_ms_per_batch"] == 4.0 and costs["captured"]["hooks_ms_per_batch"] == 1.0
    assert costs["captured"]["parts_ms_per_batch"]["state"] == 0.5 and costs["captured"]["writer_ms_per_record"] == 0.3
    monkeypatch.delenv("REFCHECK_CAPTURE_DIR")
    assert child._pass_costs(child._ledger(), child._ledger(), {}) == {}


class _Engine:
    """A stand-in engine: each pass books in a scheduler's ledger what its kind costs (a full pass records 4
    batches, a sampled one 1 of 4, an untraced one none) and answers the captured outputs, except at the untraced
    pass named in ``differ``."""

    def __init__(self, counters, outputs, differ=None):
        self.counters, self.outputs, self.differ, self.order = counters, outputs, differ, []

    def generate(self, input_ids, sampling_params, rid):
        self.order.append(rid[0])
        if rid[0].startswith("full"):
            self.counters.add(recorded_batches=4, recorded_ns=4 * 3_000_000, written=4, writer_ns=4 * 500_000)
        elif rid[0].startswith("sampled"):
            self.counters.add(plain_batches=3, plain_ns=3 * 2_000_000, recorded_batches=1, recorded_ns=3_000_000,
                              written=1, writer_ns=500_000)
        else:
            self.counters.add(plain_batches=4, plain_ns=4 * 2_000_000)
        out = [list(o) for o in self.outputs]
        if rid[0] == self.differ:
            out[0][1] += 1
        if rid[0] == "sampled1":  # a garbage collection in the client's process during this pass
            import gc

            gc.collect()
        return [{"output_ids": o} for o in out]


def test_timing_passes_run_interleaved_in_rotating_order_each_kind_with_its_own_books(tmp_path, monkeypatch):
    """refcheck/sglang/child.py's interleaved: round r runs pass r of each kind, the order rotated by r, so every
    kind runs first, second and third alike; each kind's books sum its own passes' ledger differences (the
    sampled pass's plain and recorded batches apart from the untraced passes'); an untraced pass that leaves the
    captured outputs is named with its first difference, and a kind with fewer passes drops out of later rounds;
    each traced kind is also held against the untraced pass of each round it ran in; each pass's seconds in
    run_batch, and in the client process's garbage collections, are kept per pass."""
    from refcheck.sglang import child
    from refcheck.sglang.capture.shipper import Counters, ledger_summary

    monkeypatch.setenv("REFCHECK_CAPTURE_DIR", str(tmp_path))
    outputs = [[5, 6, 7], [8, 9]]
    engine = _Engine(Counters(tmp_path / "queue-rank0-pid1.bin"), outputs, differ="untraced2")
    job = {"input_ids": [[1], [2]], "sampling_params": [{}, {}],
           "timing_rids": [[f"untraced{k}", "b"] for k in range(3)], "sampled_rids": [[f"sampled{k}", "b"] for k in range(3)],
           "full_rids": [[f"full{k}", "b"] for k in range(2)]}
    diffs: dict = {}
    got = child.interleaved(engine, job, outputs, diffs)
    assert engine.order == ["untraced0", "sampled0", "full0", "sampled1", "full1", "untraced1", "untraced2", "sampled2"]
    assert [len(got[k]["times"]) for k in ("untraced", "sampled", "full")] == [3, 3, 2]
    assert got["untraced"]["match"] is False and got["sampled"]["match"] is True and got["full"]["match"] is True
    assert diffs == {"repeat0": [], "repeat1": [], "repeat2": [[0, 1, 6, 7]]}
    # against the untraced pass of their own round: sampled2 ran beside the differing untraced2, full passes did not
    assert child._timing_result(got)["round_match"] == {"sampled": False, "full": True}
    assert child._timing_result(got)["round_mismatch"] == {"sampled": [2], "full": []}
    untraced = ledger_summary(got["untraced"]["books"], got["untraced"]["books"]["written"])
    sampled = ledger_summary(got["sampled"]["books"], got["sampled"]["books"]["written"])
    full = ledger_summary(got["full"]["books"], got["full"]["books"]["written"])
    assert (untraced["plain_batches"], untraced["plain_ms_per_batch"], untraced["recorded_batches"]) == (12, 2.0, 0)
    assert (sampled["plain_batches"], sampled["recorded_batches"], sampled["recorded_ms_per_batch"]) == (9, 3, 3.0)
    assert (full["recorded_batches"], full["writer_ms_per_record"], full["plain_batches"]) == (8, 0.5, 0)
    # per pass, the seconds booked to run_batch: 4 plain batches of 2 ms; 3 of 2 and one recorded of 3; 4 of 3
    assert [got[k]["run_batch_s"] for k in ("untraced", "sampled", "full")] == \
        [[0.008] * 3, [0.009] * 3, [0.012] * 2]
    # per pass, the client process's collections: only the second sampled pass collected
    gcs = got["sampled"]["client_gc_s"]
    assert len(gcs) == 3 and gcs[1] > 0, gcs
    import gc

    assert not any(isinstance(c, child._Collections) for c in gc.callbacks)  # installed for the passes only
    costs = child._pass_costs(child._ledger(), child._ledger(), got)
    assert costs["sampled"] == {**sampled, "run_batch_s": [0.009] * 3, "client_gc_s": [round(t, 6) for t in gcs]}
    assert costs["untraced"]["recorded_ms_per_batch"] is None


def _timed_rounds(tmp_path, clock: list[float], seconds_per_pass: float, **job_settings) -> list[int]:
    """How many rounds of each timing kind ``child.interleaved`` runs for a job with ``job_settings`` (20 planned),
    each pass adding ``seconds_per_pass`` to ``clock`` (which the caller has the child's clocks read)."""
    from refcheck.sglang import child
    from refcheck.sglang.capture.shipper import Counters

    outputs = [[5, 6, 7], [8, 9]]
    engine = _Engine(Counters(tmp_path / f"queue-rank0-pid{len(list(tmp_path.glob('queue-*')))}.bin"), outputs)
    generate = engine.generate

    def timed(*a, **kw):
        clock[0] += seconds_per_pass
        return generate(*a, **kw)

    engine.generate = timed
    job = {"input_ids": [[1], [2]], "sampling_params": [{}, {}], **job_settings,
           **{key: [[f"{kind}{k}", "b"] for k in range(20)] for kind, (key, _, _) in child.TIMING_KINDS.items()}}
    return [len(t["times"]) for t in child.interleaved(engine, job, outputs, {}).values()]


def test_a_timing_budget_stops_starting_rounds_once_spent_after_the_minimum(tmp_path, monkeypatch):
    """With ``timing_budget_s`` the child starts no timing round once the budget is spent, but runs
    MIN_TIMED_ROUNDS whatever they cost; a round once started runs whole (every kind's pass)."""
    from refcheck.sglang import child

    monkeypatch.setenv("REFCHECK_CAPTURE_DIR", str(tmp_path))
    clock = [0.0]
    monkeypatch.setattr(child.time, "perf_counter", lambda: clock[0])

    def run(budget, seconds_per_pass):
        return _timed_rounds(tmp_path, clock, seconds_per_pass, timing_budget_s=budget)

    assert run(10.0, 1.0) == [4, 4, 4]  # 3 s a round: the fourth starts at 9 s, the fifth would at 12 s
    assert run(1.0, 5.0) == [child.MIN_TIMED_ROUNDS] * 3  # past the budget after one round: the minimum runs
    assert run(None, 5.0) == [20, 20, 20]


def test_a_timing_end_starts_no_round_that_would_end_past_it_even_before_the_minimum(tmp_path, monkeypatch):
    """With ``timing_until`` (wall clock) the child starts no round that would end past it, judged by the longest
    round so far (round 0 starts if the end has not passed), MIN_TIMED_ROUNDS or not; with a budget too, the
    earlier of the two stops the rounds."""
    from refcheck.sglang import child

    monkeypatch.setenv("REFCHECK_CAPTURE_DIR", str(tmp_path))
    clock = [1000.0]
    monkeypatch.setattr(child.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(child.time, "time", lambda: clock[0])

    def run(until, seconds_per_pass, budget=None):
        clock[0] = 1000.0
        return _timed_rounds(tmp_path, clock, seconds_per_pass, timing_until=until, timing_budget_s=budget)

    assert run(1010.0, 1.0) == [3, 3, 3]  # 3 s a round: the third ends at 1009, a fourth would at 1012
    assert run(1009.0, 1.0) == [3, 3, 3]  # ending exactly at the end is in time
    assert run(1004.0, 1.0) == [1, 1, 1]  # under the minimum: the end wins over MIN_TIMED_ROUNDS
    assert run(999.0, 1.0) == [0, 0, 0]  # already past: no round
    assert run(1100.0, 1.0, budget=4.0) == [child.MIN_TIMED_ROUNDS] * 3  # the budget, the earlier, stops them
    assert run(None, 1.0) == [20, 20, 20]


def test_pack_numbers_the_device_tensors_first_and_counts_them():
    """A nest mixing device and host tensors: the device ones get the first numbers, in the nest's order, and their
    count comes back (the shipper copies that many out of the device in one buffer). A tensor subclass stands in
    for a CUDA tensor on a CPU-only machine."""

    class OnDevice(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    def dev(t: torch.Tensor) -> torch.Tensor:
        return torch.Tensor._make_subclass(OnDevice, t)

    a, b, c = torch.tensor([1]), dev(torch.tensor([2])), dev(torch.tensor([3.0]))
    skeleton, ts, n_dev = packing.pack({"h": a, "d": [b, {"x": c}], "n": [1, 2]})
    assert n_dev == 2 and [t is x for t, x in zip(ts, (b, c, a))] == [True] * 3
    assert skeleton == {"h": {"__tensor__": 2}, "d": [{"__tensor__": 0}, {"x": {"__tensor__": 1}}], "n": [1, 2]}


def test_shipping_a_record_costs_the_engines_thread_two_tensor_calls_per_tensor(tmp_path):
    """The engine's thread pays for every call into a record's tensors: packing lays each out in two (ravel, view)
    plus one ``cat`` per device, and its table reads only shapes and dtypes. Counted with a torch function mode over
    :meth:`Shipper.ship` of a 21-tensor record (attribute reads such as ``dtype`` are not calls)."""
    import sys

    from script_loader import load_script
    from torch.overrides import TorchFunctionMode

    bench = load_script("bench_capture_ship")
    calls: list[str] = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__qualname__", str(func))
            if sys._getframe(1).f_code.co_filename.endswith("packing.py") and not name.startswith("getset_descriptor"):
                calls.append(name)
            return func(*args, **(kwargs or {}))

    fields, tensors = bench._record()
    rec = Recorder(tmp_path)
    with Count():
        rec.ship("batch", fields, tensors)
    assert rec.shipper.drain(10.0)
    n = len(packing.pack({**fields, **tensors})[1])
    # on the CPU every tensor is a host tensor: the device part is an empty buffer (one call)
    assert n == 21 and sorted(set(calls)) == ["TensorBase.ravel", "TensorBase.view", "_VariableFunctionsClass.cat",
                                              "_VariableFunctionsClass.empty"]
    assert len(calls) == 2 * n + 2, calls


def test_a_collection_inside_the_ledgers_lock_books_itself_without_waiting_for_that_lock(tmp_path):
    """The garbage collector runs in whichever thread allocates, the ledger's own ``add`` included (its lock held):
    the collection's booking must not wait for that lock, or the thread deadlocks on itself (seen: the writer
    thread, and the engine's thread after it, hung in ``add``). A thread holds the lock and collects; it finishes,
    and the collection is booked."""
    import gc

    from refcheck.sglang.capture.shipper import read_fields

    shipper = Shipper(lambda kind, data: None, lambda where, msg: None, tmp_path / "queue-rank0-pid1.bin")
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with shipper.counts._lock:
            gc.collect()
        done.set()

    threading.Thread(target=collect_holding_the_lock, daemon=True).start()
    assert done.wait(10.0), "a collection inside Counters.add's lock deadlocked its thread"
    fields = read_fields(tmp_path / "queue-rank0-pid1.bin")
    assert fields["gc_collections"] >= 1 and fields["gc_ns"] > 0


def test_the_writer_waits_for_a_copy_in_one_synchronize_of_a_blocking_sync_event(monkeypatch):
    """A record's copy event is made with ``blocking=True`` (``cudaEventBlockingSync``: a thread waiting on it sleeps,
    no core spins in the driver), and the writer waits for it in one ``synchronize`` (PyTorch lets go of the
    interpreter lock inside), never asking ``query`` in a loop, which would take that lock at each ask."""
    from refcheck.sglang.capture import shipper

    made: list[dict[str, object]] = []
    monkeypatch.setattr(shipper.torch.cuda, "Event", lambda **kw: made.append(kw) or "event")
    assert shipper.copy_event() == "event" and made == [{"blocking": True}]

    class Event:
        def __init__(self) -> None:
            self.synced = 0

        def query(self) -> bool:
            raise AssertionError("the writer asked query, taking the interpreter lock at each ask")

        def synchronize(self) -> None:
            self.synced += 1

    event = Event()
    shipper.landed(event)
    assert event.synced == 1


def test_a_plain_part_is_packed_as_it_is_unwalked_and_reads_back_the_same():
    """packing.Plain (a record's context tokens, its sampling parameters): pack puts the very object in the skeleton,
    not a walked copy (a walk would type-check each of thousands of tokens on the engine's thread), and the record
    decodes with it as it was."""
    contexts = [[0, list(range(400)), 300], [17, [5, 6], 3]]
    t = torch.arange(3, dtype=torch.int32)
    skeleton, ts, _ = packing.pack({"contexts": packing.Plain(contexts), "t": t, "params": packing.Plain([None])})
    assert skeleton["contexts"] is contexts and skeleton["params"] == [None] and len(ts) == 1
    back = packing.decode(packing.encode(skeleton, packing.table(ts), packing.flatten(ts).numpy().tobytes()))
    assert back["contexts"] == contexts and torch.equal(back["t"], t)
