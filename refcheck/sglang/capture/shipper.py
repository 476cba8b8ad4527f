"""Capture records leave the engine's thread at once: device tensors copied to host asynchronously, files
written by a background thread.

Contract: :meth:`Shipper.ship` takes a record (a kind, plain host fields, and a nest of dicts / lists /
tuples holding tensors) from inside a scheduler hook. Its CUDA tensors are laid end to end in one byte
buffer on the device (one ``cat``, :mod:`refcheck.sglang.capture.packing`) and copied to pinned host memory
(PyTorch's caching host allocator) without blocking, on the current stream; one CUDA event is recorded
after the copy and the record is queued. It never synchronises the device and never waits for the disk. A
daemon thread takes records in order, waits for each record's event (:func:`landed`: the event blocks the thread
in the kernel, neither spinning in the driver beside the engine's launches nor holding the interpreter lock), and
writes the header and the bytes through the :class:`~refcheck.sglang.capture.records.Recorder` (one frame appended
to an open segment file per record, its buffers in one system call, the tensors' bytes as they are). The writer
takes the interpreter lock a fixed few times per record, each for a short stretch: every time it takes it while the
engine's thread wants it, the engine's step waits. CPU tensors are copied at ship time (the engine may reuse their
storage). A record's ``events`` field (two CUDA events recorded around the engine's step on its stream) becomes
``step_s``, their distance in seconds. The queue holds at most ``depth`` records: a record that finds it full is not
queued but counted as lost, never blocking the engine and never silently missing; one the process's byte budget
refuses (:mod:`refcheck.sglang.capture.byte_budget`) is counted ``over_budget``.

Counts live in a memory-mapped file ``queue-rank{r}-pid{pid}.bin`` of :data:`FIELDS` (little-endian u64 each),
updated by plain memory writes, so the engine's parent can wait until the writer is done with every queued record
(:func:`wait_drained`) before it stops SGLang, and the reader can report lost records (:func:`read_counts`): those
that found the queue full and those the writer could not write (``written`` counts them too: done with). It also
counts the batches past the byte budget (``over_budget``: records the writer refused and batches the hooks passed
over once the budget was spent), the error records that could not be written (``unwritten_errors``), the batch
records a rolling budget deleted (``rolled_out``) and the requests the process's step clock met (``requests``: each
request of a traced batch once, recorded or not).
Beside the queue's three counts the file holds the capture's cost ledger (:func:`read_fields`, :func:`ledger_summary`): the writer
thread's CPU time on the records it wrote (its wait for a record's copy left out), and the scheduler's
``run_batch`` wall time over decode batches that ran as if no capture were loaded (``plain``) and over
recorded ones (``recorded``: the whole batch, the hooks' own time within it, and that time by part,
:data:`PARTS`), over the plain batches that come right after a recorded one (``next``: where a recorded batch's
device work and its record's writing land), the hooks' own time before a plain batch (``passed``: deciding to pass
it over), prefill batches recorded (``prefill``: the whole batch and the hooks' share) and run unrecorded
(``plain_prefill``), and the process's garbage collections (``gc``: their count and time, whichever thread ran them;
booked without the ledger's lock, since a collection may start inside :meth:`Counters.add`), in nanoseconds; the
hooks add to it with :meth:`Counters.add`.
"""

from __future__ import annotations

import gc
import mmap
import queue
import struct
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refcheck.sglang.capture import packing
from refcheck.sglang.capture.byte_budget import BudgetSpent
from refcheck.sglang.capture.gc_clock import CollectionClock

QUEUE_DEPTH = 512
#: the counters file's fields, in order: the queue's counts, then the cost ledger (times in nanoseconds)
FIELDS = ("queued", "written", "lost", "writer_ns", "plain_batches", "plain_ns", "recorded_batches", "recorded_ns",
          "hooks_ns", "snapshot_ns", "verify_ns", "taps_ns", "state_ns", "ship_ns", "passed_ns", "gc_ns",
          "gc_collections", "prefills", "prefill_ns", "prefill_hooks_ns", "plain_prefills", "plain_prefill_ns",
          "over_budget", "unwritten_errors", "rolled_out", "requests", "next_batches", "next_ns", "graph_replays",
          "graph_eager", "graph_eager_state", "graph_eager_verify", "graph_eager_draft", "graph_eager_context")
#: the hooks' graph caches whose eager runs the ledger counts apart (``graph_eager_{name}``): the committed-state
#: sketch, the verify step's node reductions, the DFLASH drafter's draft and its context
GRAPH_CACHES = ("state", "verify", "draft", "context")
#: the parts of the hooks' time the ledger books (``{part}_ns``): the batch's snapshot, the verify hooks' reductions,
#: the DFLASH drafter's taps, the committed state's sketch, and packing and queuing the record
PARTS = ("snapshot", "verify", "taps", "state", "ship")
_FMT = "<" + "Q" * len(FIELDS)
_SIZE = struct.calcsize(_FMT)
_FIELD = struct.Struct("<Q")  # one field, written in place at its offset
_OFFSET = {name: _FIELD.size * i for i, name in enumerate(FIELDS)}


@dataclass
class _Item:
    kind: str
    skeleton: Any  # the record, tensors replaced by their index in ``entries``
    entries: list[dict[str, Any]]  # the tensors' dtype, shape and byte range (packing.table)
    device_bytes: torch.Tensor  # [n] uint8 on the host (pinned; valid once ``event`` has completed)
    host_bytes: torch.Tensor  # [m] uint8: the CPU tensors' bytes
    event: Any


def _timed(fields: dict[str, Any]) -> dict[str, Any]:
    """``events`` (two CUDA events around the engine's step, both complete) -> ``step_s``, their distance."""
    events = fields.pop("events", None)
    if events is not None:
        fields["step_s"] = events[0].elapsed_time(events[1]) / 1000.0
    return fields


class Counters:
    """The queue's counts and the cost ledger (:data:`FIELDS`), in a file the parent process can read while the
    engine runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "wb") as f:
            f.write(b"\0" * _SIZE)
        self._file = open(path, "r+b")  # noqa: SIM115 - held for the process's life, as the mapping is
        self._map = mmap.mmap(self._file.fileno(), _SIZE)
        self.values = dict.fromkeys(FIELDS, 0)
        self._lock = threading.Lock()  # the engine's thread (queue, ledger) and the writer's (written) both add

    @property
    def queued(self) -> int:
        return self.values["queued"]

    @property
    def written(self) -> int:
        return self.values["written"]

    @property
    def lost(self) -> int:
        return self.values["lost"]

    def add(self, **amounts: int) -> None:
        """Add to the named fields (integers) and publish them: one aligned 8-byte memory write per field, so a reader
        sees each field whole; the hooks call this at every batch, so only the fields that change are written."""
        with self._lock:
            self._publish(amounts)

    def add_unlocked(self, **amounts: int) -> None:
        """:meth:`add` without the lock, for the garbage collector's callback alone: its fields are written by no one
        else, collections run one at a time, and one may run in a thread that holds the lock (inside :meth:`add`,
        wherever it allocates), which would wait on itself for ever."""
        self._publish(amounts)

    def _publish(self, amounts: dict[str, int]) -> None:
        values, mapped, pack, offset = self.values, self._map, _FIELD.pack_into, _OFFSET
        for name, amount in amounts.items():
            value = values[name] = values[name] + amount
            pack(mapped, offset[name], value)


def read_fields(path: Path) -> dict[str, int]:
    """Every field of one scheduler process's counters file (:data:`FIELDS`). Fields are only ever appended, so a
    file an earlier refcheck wrote (its first fields, at least the queue's three counts) reads with the fields it
    lacks as 0; any other size is a ValueError."""
    data = Path(path).read_bytes()
    n = len(data) // _FIELD.size
    if len(data) % _FIELD.size or not 3 <= n <= len(FIELDS):
        raise ValueError(f"{path.name}: {len(data)} bytes, a capture queue file holds {_SIZE} (or, written by an "
                         f"earlier refcheck, its first fields: a multiple of {_FIELD.size} bytes)")
    return {**dict.fromkeys(FIELDS, 0), **dict(zip(FIELDS, struct.unpack("<" + "Q" * n, data)))}


def read_counts(path: Path) -> tuple[int, int, int]:
    """(queued, written, lost) of one scheduler process's capture queue."""
    v = read_fields(path)
    return v["queued"], v["written"], v["lost"]


def read_ledgers(root: Path) -> dict[str, int]:
    """Every field of :data:`FIELDS` summed over the capture directory's scheduler processes (a file that cannot be
    read counts nothing: the record reader reports it)."""
    total = dict.fromkeys(FIELDS, 0)
    for f in queue_files(root):
        try:
            fields = read_fields(f)
        except (OSError, ValueError):
            continue
        for k, v in fields.items():
            total[k] += v
    return total


def ledger_between(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """:func:`ledger_summary` of what was booked between two :func:`read_ledgers` (one pass of requests)."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in FIELDS}
    return ledger_summary(delta, delta["written"])


def ledger_summary(ledger: dict[str, int], written: int) -> dict[str, Any]:
    """A ledger (summed over processes) in milliseconds per batch: a plain decode batch's ``run_batch``, a
    recorded one's and the hooks' share of it, and the writer's CPU per record (``written`` records); per recorded
    batch, the hooks' device computations replayed from CUDA graphs and run eagerly (``graph_*_per_batch``), the
    eager runs by cache (``graph_eager_by_cache``, :data:`GRAPH_CACHES`)."""
    def per(field: str, n: int, unit: float = 1e6, digits: int = 4) -> float | None:
        """``field`` per one of ``n`` in ``unit`` (nanoseconds -> milliseconds by default); None for no ``n``."""
        return round(ledger.get(field, 0) / unit / n, digits) if n else None

    plain, recorded = ledger.get("plain_batches", 0), ledger.get("recorded_batches", 0)
    prefills, plain_prefills = ledger.get("prefills", 0), ledger.get("plain_prefills", 0)
    return {"plain_batches": plain, "plain_ms_per_batch": per("plain_ns", plain), "recorded_batches": recorded,
            "recorded_ms_per_batch": per("recorded_ns", recorded), "hooks_ms_per_batch": per("hooks_ns", recorded),
            "passed_ms_per_plain_batch": per("passed_ns", plain), "writer_ms_per_record": per("writer_ns", written),
            "gc_collections": ledger.get("gc_collections", 0), "gc_ms_per_batch": per("gc_ns", plain + recorded),
            "prefills": prefills, "prefill_ms_per_batch": per("prefill_ns", prefills),
            "prefill_hooks_ms_per_batch": per("prefill_hooks_ns", prefills),
            "plain_prefills": plain_prefills, "plain_prefill_ms_per_batch": per("plain_prefill_ns", plain_prefills),
            "next_batches": ledger.get("next_batches", 0),
            "next_ms_per_batch": per("next_ns", ledger.get("next_batches", 0)),
            "parts_ms_per_batch": {p: per(f"{p}_ns", recorded) for p in PARTS},
            "graph_replays_per_batch": per("graph_replays", recorded, 1, 3),
            "graph_eager_per_batch": per("graph_eager", recorded, 1, 3),
            "graph_eager_by_cache": _eager_by_cache(ledger, recorded)}


def _eager_by_cache(ledger: dict[str, int], recorded: int) -> dict[str, float] | None:
    """Each cache's eager runs per recorded batch; None without recorded batches, or where the caches' counts do not
    add up to ``graph_eager`` (processes of a refcheck that counted no cache apart beside ones that did)."""
    if not recorded or sum(ledger.get(f"graph_eager_{c}", 0) for c in GRAPH_CACHES) != ledger.get("graph_eager", 0):
        return None
    return {c: round(ledger.get(f"graph_eager_{c}", 0) / recorded, 3) for c in GRAPH_CACHES}


def queue_files(root: Path) -> list[Path]:
    return sorted(Path(root).glob("queue-rank*-pid*.bin"))


def wait_drained(root: Path, timeout_s: float = 60.0, poll_s: float = 0.01) -> dict[str, int]:
    """Wait until every scheduler process of the capture directory has written what it queued (the engine's
    requests are done, so nothing more is queued); returns {file: records still queued} for those that did not
    drain within ``timeout_s`` (empty: all drained)."""
    deadline = time.monotonic() + timeout_s
    while True:
        behind = {}
        for f in queue_files(root):
            try:
                queued, written, _ = read_counts(f)
            except (OSError, ValueError):
                continue
            if written < queued:
                behind[f.name] = queued - written
        if not behind or time.monotonic() >= deadline:
            return behind
        time.sleep(poll_s)


class _CollectionBooks(CollectionClock):
    """The process's garbage collections in the ledger of its latest :class:`Shipper` (one ``gc.callbacks`` entry
    per process, whichever thread collects; booked without the ledger's lock, :meth:`Counters.add_unlocked`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counters | None = None

    def collected(self, ns: int) -> None:
        if self.counts is not None:
            self.counts.add_unlocked(gc_ns=ns, gc_collections=1)


_COLLECTIONS = _CollectionBooks()


class Shipper:
    """The queue and writer thread of one scheduler process (module docstring)."""

    def __init__(self, write: Callable[[str, Any], None], error: Callable[[str, str], None],
                 counts_path: Path, depth: int = QUEUE_DEPTH) -> None:
        self._write, self._error = write, error
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=depth)
        self.counts = Counters(counts_path)
        _COLLECTIONS.counts = self.counts
        if _COLLECTIONS not in gc.callbacks:
            gc.callbacks.append(_COLLECTIONS)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="refcheck-capture-writer", daemon=True)
        self._thread.start()

    def ship(self, kind: str, fields: dict[str, Any], tensors: dict[str, Any]) -> bool:
        """Queue one record; False when the queue was full (the record is counted as lost)."""
        skeleton, ts, n_dev = packing.pack({"type": kind, **fields, **tensors})
        device_bytes = packing.flatten(ts[:n_dev])
        event = None
        if device_bytes.is_cuda:
            device_bytes = device_bytes.to("cpu", non_blocking=True)  # pinned output: overlaps the engine's work
            event = copy_event()
            event.record()
        item = _Item(kind, skeleton, packing.table(ts), device_bytes, packing.flatten(ts[n_dev:]), event)
        with self._lock:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.counts.add(lost=1)
                return False
            self.counts.add(queued=1)
        return True

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait (in this process) until every queued record is written; True when it was."""
        deadline = time.monotonic() + timeout_s
        while self.counts.written < self.counts.queued and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.counts.written >= self.counts.queued

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            cpu0, failed, refused = None, False, False
            try:
                if item.event is not None:
                    landed(item.event)  # the record's copy has landed in host memory
                cpu0 = time.thread_time_ns()
                data = packing.encode_parts(_timed(item.skeleton), item.entries, item.device_bytes.numpy().data,
                                            item.host_bytes.numpy().data)
                self._write(item.kind, data)
            except BudgetSpent:  # past the process's byte budget: counted, not an error
                refused = True
            except Exception as exc:  # a record that cannot be written is reported and counted lost; the rest carry on
                failed = True
                self._error(f"writer:{item.kind}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
            finally:
                spent = time.thread_time_ns() - cpu0 if cpu0 is not None else 0
                self.counts.add(written=1, writer_ns=spent, lost=int(failed), over_budget=int(refused))


def copy_event() -> Any:
    """The CUDA event that marks a record's copy to the host: made with ``cudaEventBlockingSync``, so a thread that
    waits for it sleeps in the kernel until the device reaches it instead of spinning on a core."""
    return torch.cuda.Event(blocking=True)


def landed(event: Any) -> None:
    """Return once ``event`` (a record's copy, :func:`copy_event`) has completed: one ``synchronize``, in which PyTorch
    lets go of the interpreter lock and the blocking-sync event puts the thread to sleep. Asking ``query`` in a loop
    instead would take the interpreter lock at every ask, each time making the engine's thread wait for it."""
    event.synchronize()


def counts_path(root: Path, tp_rank: int, tag: str) -> Path:
    """The counters file of the process whose records are tagged ``tag``."""
    return Path(root) / f"queue-rank{tp_rank}-pid{tag}.bin"
