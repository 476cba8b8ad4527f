"""The capture directory: what the plugin writes inside SGLang's scheduler processes, read back in order.

Contract: a :class:`Recorder` (one per scheduler process) appends each record
(:mod:`refcheck.sglang.capture.packing`: a header of JSON values and the tensors' bytes) as a frame of its segments
(:mod:`refcheck.sglang.capture.segments`): batch and prefill records to ``rank{tp}-pid{pid}/records-*.seg``, error
records to ``errors-*.seg`` beside them (a directory of its own, :func:`process_dir`, also when an earlier process
of the same pid left one). A crash loses at most the frame being written, which the reader reports.
Batch records go through the process's :class:`~refcheck.sglang.capture.shipper.Shipper` (:meth:`Recorder.ship`:
asynchronous host copies, written by its thread, counted in ``queue-rank{tp}-pid{pid}.bin``); error records are
written at once. ``status-rank{tp}-pid{pid}.json`` says which hooks are live. A
:class:`~refcheck.sglang.capture.byte_budget.ByteBudget` bounds the bytes of the process's frames; a record past it
is refused and counted, not written. A rolling budget deletes the oldest segment of batch records to make room, in
segments of a sixteenth of the budget (:data:`ROLL_SEGMENTS`), so the directory keeps at least fifteen sixteenths
of the budget's worth of the latest records; error records are never deleted.
:func:`read_capture` returns every complete record of a directory, per rank, in write order, batch records expanded
per request (:mod:`refcheck.sglang.capture.expand`); a segment or frame that cannot be read, a segment's torn end,
record files of the one-file-per-record format (``*.rec``, not read),
records still queued when the engine stopped, records the queue could not take, records past the byte budget and
error records that could not be written are reported (not skipped silently) in :attr:`Capture.errors`,
:attr:`Capture.lost` and :attr:`Capture.over_budget`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes
from refcheck.sglang.capture import packing
from refcheck.sglang.capture.byte_budget import BudgetSpent, ByteBudget
from refcheck.sglang.capture.expand import expand_batch, expand_prefill
from refcheck.sglang.capture.segments import SEGMENT_BYTES, SegmentLog, frame_bytes, payloads, scans
from refcheck.sglang.capture.shipper import Shipper, counts_path, ledger_summary, queue_files, read_fields
from refcheck.sglang.capture.steps import PrefillCapture, StepCapture

RECORDS, ERRORS = "records", "errors"  # the segments' prefixes (:mod:`refcheck.sglang.capture.segments`)
ROLL_SEGMENTS = 16  # segments to a rolling budget


def process_of(d: Path) -> tuple[int, str]:
    """A process directory's rank and tag, from its name ``rank{tp}-pid{tag}``."""
    rank, tag = d.name[4:].split("-pid", 1)
    return int(rank), tag


#: every process's status file in a capture directory (:func:`status_path`)
STATUS_GLOB = "status-rank*-pid*.json"


def status_path(root: Path, tp_rank: int, tag: str) -> Path:
    """The status file of the process whose records are tagged ``tag``."""
    return Path(root) / f"status-rank{tp_rank}-pid{tag}.json"


def old_record_files(d: Path) -> int:
    """How many record files of the one-file-per-record format (``*.rec``) a process directory holds (not read)."""
    return len(list(d.glob("[0-9]*.rec")))


def process_dir(root: Path, tp_rank: int) -> tuple[Path, str]:
    """A new directory for this process's records, ``rank{tp}-pid{tag}``, and its tag: the pid, or ``{pid}.{n}`` when
    an earlier process of the same pid (a restarted container's scheduler) left its records in this capture
    directory. Each keeps its own records, counters and status, and the reader reports the two as processes of one
    rank."""
    root.mkdir(parents=True, exist_ok=True)
    pid, n = os.getpid(), 0
    while True:
        tag = f"{pid}.{n}" if n else str(pid)
        d = root / f"rank{tp_rank}-pid{tag}"
        try:
            d.mkdir()  # atomic: the first process to make it owns it
        except FileExistsError:
            n += 1
            continue
        return d, tag


class Recorder:
    def __init__(self, root: Path, tp_rank: int = 0, max_bytes: int | None = None, roll: bool = False) -> None:
        self.root = Path(root)  # the capture directory (kept: the hooks pass it on at every traced batch)
        self.dir, tag = process_dir(self.root, tp_rank)
        self.status_path = status_path(self.root, tp_rank, tag)
        self.tp_rank = tp_rank
        self._disk_said = False  # a refusal by the disk was said on stderr
        self.budget = ByteBudget(max_bytes, roll)  # the bytes of record frames this process may write
        # a rolling budget deletes whole segments: sixteen of them to a budget keep at least 15/16 of it filled
        per_segment = max(1, max_bytes // ROLL_SEGMENTS) if roll and max_bytes else SEGMENT_BYTES
        self.records = SegmentLog(self.dir, RECORDS, min(per_segment, SEGMENT_BYTES))  # batch and prefill records
        self.errors = SegmentLog(self.dir, ERRORS)  # error records: never rolled out
        self.shipper = Shipper(self.write, self.error, counts_path(root, tp_rank, tag))

    def write(self, kind: str, data: bytes | list[bytes | memoryview]) -> None:
        """One encoded record (``kind`` names it in errors; whole, or as :func:`~refcheck.sglang.capture.packing.
        encode_parts`' buffers), as the next frame of this process's segments (error records in their own);
        :class:`~refcheck.sglang.capture.byte_budget.BudgetSpent` when the process's byte budget cannot take it
        (nothing is written)."""
        parts = data if isinstance(data, list) else [data]
        payload = sum(memoryview(p).nbytes for p in parts)
        if not self.budget.charge(frame_bytes(payload), self._evict):
            raise BudgetSpent(f"{kind}: the capture's byte budget of {self.budget.limit} bytes cannot take it")
        (self.errors if kind == "error" else self.records).append(parts, payload)

    def _evict(self) -> int | None:
        """Delete the oldest segment of batch records (a rolling budget's room), its records counted ``rolled_out``:
        its bytes, or None when none is left."""
        dropped = self.records.drop_oldest()
        if dropped is None:
            return None
        nbytes, frames = dropped
        self.shipper.counts.add(rolled_out=frames)
        return nbytes

    def ship(self, kind: str, fields: dict[str, Any], tensors: dict[str, Any]) -> None:
        """Queue a batch record (its tensors may be on the device); see :mod:`refcheck.sglang.capture.shipper`."""
        self.shipper.ship(kind, fields, tensors)

    def error(self, where: str, message: str) -> None:
        """An error record. One that cannot be written is counted in the counters file (``unwritten_errors``, which
        the reader reports), and one the disk refuses (full, read-only) is also said on stderr, the engine's
        log, the first time: never an exception into the engine."""
        try:
            self.write("error", packing.encode({"type": "error", "where": where, "message": message}, []))
        except BudgetSpent:
            self.shipper.counts.add(unwritten_errors=1)
        except Exception as exc:  # noqa: BLE001 - the engine's step must go on
            self.shipper.counts.add(unwritten_errors=1)
            if not self._disk_said:
                self._disk_said = True
                first = (message.splitlines() or [""])[0]
                print(f"refcheck capture: cannot write to {self.dir} ({type(exc).__name__}: {exc}); "
                      f"unwritten error at {where}: {first}", file=sys.stderr, flush=True)

    @property
    def unwritten_errors(self) -> int:
        """Error records this process could not write (its counters file's count)."""
        return self.shipper.counts.values["unwritten_errors"]

    def status(self, info: dict[str, Any]) -> None:
        atomic_write_bytes(self.status_path, json.dumps(info, indent=1, default=str).encode(), durable=False)


@dataclass
class Capture:
    steps: dict[int, list[StepCapture]] = field(default_factory=dict)  # tp rank -> steps in write order
    prefills: dict[int, list[PrefillCapture]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # hook errors and unreadable files
    status: list[dict[str, Any]] = field(default_factory=list)
    lost: int = 0  # batch records the engine's capture queue could not take (it was full)
    over_budget: int = 0  # batches not recorded because their process's byte budget was spent
    rolled_out: int = 0  # batch records a rolling byte budget deleted, oldest first
    in_flight: int = 0  # batch records queued but not yet written when a running engine's directory was read
    not_read: int = 0  # records left unread (read_capture's ``last``)
    #: requests the schedulers' step clocks met, recorded or not: a tensor-parallel rank's processes summed (data-
    #: parallel replicas and restarts meet other requests), the largest over ranks (each rank meets the same ones)
    requests_met: int = 0
    #: what the capture cost the engine, over every process (:func:`~refcheck.sglang.capture.shipper.ledger_summary`)
    cost: dict[str, Any] = field(default_factory=dict)

    @property
    def first_rank(self) -> int:
        """The lowest tensor-parallel rank that recorded a step or a first token (0 when none did)."""
        return min({*self.steps, *self.prefills}, default=0)


def read_capture(root: Path, running: bool = False, last: int | None = None) -> Capture:
    """Every complete record of the capture directory ``root`` (module docstring). ``running``: the engine may still be
    writing, so records queued but not yet written are in flight (:attr:`Capture.in_flight`), a segment its rolling
    budget deletes while the directory is read is passed over, and so is its current segment's torn end (the frame
    being written), none of them an error. ``last``: only each scheduler process's last ``last`` batch and prefill
    records are read (the others counted in :attr:`Capture.not_read`; error records are always read)."""
    cap = Capture()
    root = Path(root)
    for st in sorted(root.glob(STATUS_GLOB)):
        try:
            cap.status.append(json.loads(st.read_text()))
        except (OSError, ValueError) as exc:
            cap.errors.append(f"{st.name}: unreadable status ({exc})")
    pids: dict[int, list[str]] = {}
    for d in sorted(root.glob("rank*-pid*")):
        rank, tag = process_of(d)
        pids.setdefault(rank, []).append(tag)
        if old := old_record_files(d):
            cap.errors.append(f"{d.name}: {old} record file(s) of the one-file-per-record format (*.rec), which this "
                              "refcheck does not read: capture the run again")
        for place, data in chain(_frames(d, ERRORS, cap, running), _frames(d, RECORDS, cap, running, last)):
            try:
                rec = packing.decode(data)
            except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:  # a frame's bytes spoiled
                cap.errors.append(f"{place}: unreadable record ({type(exc).__name__}: {exc})")
                continue
            kind = rec.pop("type", None)
            if kind == "batch":
                cap.steps.setdefault(rank, []).extend(expand_batch(rec))
            elif kind == "prefill_batch":
                cap.prefills.setdefault(rank, []).extend(expand_prefill(rec))
            elif kind == "error":
                cap.errors.append(f"{d.name}: hook error in {rec.get('where')}: {rec.get('message')}")
            else:
                cap.errors.append(f"{place}: unknown record type {kind!r}")
    _read_queues(root, cap, running)
    replicas = _replicas(cap.status)
    for rank, ps in sorted(pids.items()):
        if len(ps) > replicas:  # two engines' records in one directory, or ranks that do not know who they are
            cap.errors.append(f"{len(ps)} scheduler processes (pids {', '.join(ps)}) recorded as tensor-parallel rank "
                              f"{rank}" + (f" of {replicas} data-parallel replicas" if replicas > 1 else "")
                              + ": their shards cannot be told apart, so the committed state cannot be combined")
    return cap


def _frames(d: Path, prefix: str, cap: Capture, running: bool, last: int | None = None) -> Iterator[tuple[str, bytes]]:
    """The payloads of one process directory's segments of ``prefix``, oldest first, each with its place
    (``dir/segment@offset``). A segment's torn end is an error, save the current segment's while the engine runs
    (``running``: the frame being written); so is a segment deleted while the directory is read, save while the
    engine runs (its rolling budget's). ``last``: only the last ``last`` frames (the others counted
    :attr:`Capture.not_read`)."""
    found_all = scans(d, prefix)
    whole: list[tuple[Path, list[tuple[int, int]]]] = []
    for i, (f, found) in enumerate(found_all):
        if isinstance(found, OSError):
            _unreadable(cap, d, f, found, running)
            continue
        if found.torn is not None and not (running and i == len(found_all) - 1):
            cap.errors.append(f"{d.name}/{f.name}: {found.torn}")
        whole.append((f, found.frames))
    skip = max(0, sum(len(frames) for _, frames in whole) - last) if last is not None else 0
    cap.not_read += skip
    for f, frames in whole:
        take, skip = frames[skip:], max(0, skip - len(frames))
        try:
            for (offset, _), data in zip(take, payloads(f, take)):
                yield f"{d.name}/{f.name}@{offset}", data
        except (OSError, ValueError) as exc:
            _unreadable(cap, d, f, exc, running)


def _unreadable(cap: Capture, d: Path, f: Path, exc: Exception, running: bool) -> None:
    """A segment that could not be read: an error, save one deleted while the engine runs (its rolling budget's)."""
    if isinstance(exc, FileNotFoundError):
        if not running:
            cap.errors.append(f"{d.name}/{f.name}: segment gone while the directory was read")
    else:
        cap.errors.append(f"{d.name}/{f.name}: unreadable segment ({exc})")


def _replicas(status: list[dict[str, Any]]) -> int:
    """How many data-parallel replicas the schedulers' server arguments say the engine runs (each has its own
    tensor-parallel ranks; a request runs on one replica only, so their records join by rid)."""
    sizes = [int(st["server"].get("dp_size") or 1) for st in status
             if isinstance(st.get("server"), dict) and isinstance(st["server"].get("dp_size"), int)]
    return max(sizes, default=1)


def _read_queues(root: Path, cap: Capture, running: bool = False) -> None:
    """Records queued but never written (the engine stopped first; with ``running``, counted in flight) and error
    records that could not be written are errors; records lost to a full queue and batches past the byte budget are
    counted; the processes' cost ledgers are summed into :attr:`Capture.cost`, and the requests they met into
    :attr:`Capture.requests_met`."""
    ledger: dict[str, int] = {}
    met: dict[str, int] = {}  # the file name's rank -> requests its processes met
    for f in queue_files(root):
        try:
            fields = read_fields(f)
        except (OSError, ValueError) as exc:
            cap.errors.append(f"{f.name}: unreadable capture queue counts ({exc})")
            continue
        for k, v in fields.items():
            ledger[k] = ledger.get(k, 0) + v
        queued, written, lost = fields["queued"], fields["written"], fields["lost"]
        if written < queued and running:
            cap.in_flight += queued - written
        elif written < queued:
            cap.errors.append(f"{f.name}: {queued - written} of {queued} captured batches were still queued when the "
                              "engine stopped (not written)")
        if fields["unwritten_errors"]:
            cap.errors.append(f"{f.name}: {fields['unwritten_errors']} hook error record(s) could not be written (the "
                              "capture's byte budget was spent, or the disk refused them: see the engine's log)")
        cap.lost += lost
        cap.over_budget += fields["over_budget"]
        cap.rolled_out += fields["rolled_out"]
        rank = f.name.split("-pid", 1)[0]  # queue-rank{r}
        met[rank] = met.get(rank, 0) + fields["requests"]
    cap.requests_met = max(met.values(), default=0)
    if ledger:
        cap.cost = ledger_summary(ledger, ledger["written"])
