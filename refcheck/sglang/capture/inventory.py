"""What a capture directory holds, for a look while its server runs: per scheduler process, read from its segments'
frame heads, its counters file and its status file alone (no batch record decoded, no model needed).

Contract: :func:`check_capture_dir` raises :class:`CaptureDirError` (exit 2) for a path that is not a directory the
capture plugin wrote into (no ``status-rank*-pid*.json``). :func:`inventory` returns one :class:`ProcessInventory`
per process directory (``rank{tp}-pid{tag}``, :func:`refcheck.sglang.capture.records.process_dir`), in name order:
its batch and prefill records (frames, segments, bytes), its error records (the first one's text), the torn ends of
its segments (a frame cut short or bytes that are not a frame: :func:`~refcheck.sglang.capture.segments.scan`; while
the server runs, the current segment's is the frame being written), record files of the one-file-per-record format
it cannot read, its counters (:data:`~refcheck.sglang.capture.shipper.FIELDS`: queued, written, lost, past the byte
budget, rolled out, requests met; None when its file is missing or unreadable, said in ``problems``) and what its
status file says (SGLang's version, the sampling rule, the byte budget). Nothing is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refcheck.errors import UsageError
from refcheck.sglang.capture import packing
from refcheck.sglang.capture.records import ERRORS, RECORDS, STATUS_GLOB, old_record_files, process_of, status_path
from refcheck.sglang.capture.segments import frame_bytes, payloads, scans
from refcheck.sglang.capture.shipper import counts_path, read_fields


class CaptureDirError(UsageError):
    """A path that is not a capture directory."""


def check_capture_dir(root: Path) -> None:
    if not root.is_dir() or not any(root.glob(STATUS_GLOB)):
        raise CaptureDirError(f"{root} is not a capture directory: no status-rank*-pid*.json in it (SGLang writes one "
                              "per scheduler when it runs with REFCHECK_CAPTURE_DIR set and refcheck installed)")


@dataclass
class ProcessInventory:
    name: str  # rank{tp}-pid{tag}
    rank: int
    tag: str
    records: int = 0  # batch and prefill records (frames)
    segments: int = 0
    record_bytes: int = 0  # their frames' bytes
    error_records: int = 0
    first_error: str | None = None
    torn: list[str] = field(default_factory=list)  # "segment: what follows its last whole frame"
    old_files: int = 0  # *.rec files of the one-file-per-record format (not read)
    counts: dict[str, int] | None = None  # the counters file's fields
    status: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def inventory(root: Path) -> list[ProcessInventory]:
    """Every process directory of the capture directory ``root`` (module docstring)."""
    root = Path(root)
    check_capture_dir(root)
    out = []
    for d in sorted(p for p in root.glob("rank*-pid*") if p.is_dir()):
        rank, tag = process_of(d)
        inv = ProcessInventory(d.name, rank, tag, old_files=old_record_files(d))
        _tally(d, inv)
        _read_side_files(root, inv)
        out.append(inv)
    return out


def _tally(d: Path, inv: ProcessInventory) -> None:
    """The process directory's frames, from their heads; the first error record's text."""
    for prefix in (RECORDS, ERRORS):
        found_all = scans(d, prefix)
        for i, (f, found) in enumerate(found_all):
            if isinstance(found, OSError):  # gone (a rolling budget's) or unreadable
                inv.problems.append(f"{f.name}: {found}")
                continue
            if found.torn is not None:
                newest = i == len(found_all) - 1
                inv.torn.append(f"{f.name}: {found.torn}" + (" (the newest segment: the frame being written, while "
                                                             "the server runs)" if newest else ""))
            if prefix == RECORDS:
                inv.segments += 1
                inv.records += len(found.frames)
                inv.record_bytes += sum(frame_bytes(n) for _, n in found.frames)
                continue
            inv.error_records += len(found.frames)
            if inv.first_error is None and found.frames:
                inv.first_error = _error_text(f, found.frames[0], inv)


def _error_text(f: Path, frame: tuple[int, int], inv: ProcessInventory) -> str | None:
    try:
        rec = packing.decode(next(payloads(f, [frame])))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        inv.problems.append(f"{f.name}: unreadable error record ({type(exc).__name__}: {exc})")
        return None
    return f"{rec.get('where')}: {str(rec.get('message')).splitlines()[0] if rec.get('message') else ''}"


def _read_side_files(root: Path, inv: ProcessInventory) -> None:
    """The process's counters and status files, named by its rank and tag."""
    counts = counts_path(root, inv.rank, inv.tag)
    try:
        inv.counts = read_fields(counts)
    except (OSError, ValueError) as exc:
        inv.problems.append(f"{counts.name}: unreadable counters ({exc})")
    status = status_path(root, inv.rank, inv.tag)
    try:
        inv.status = json.loads(status.read_text())
    except (OSError, ValueError) as exc:
        inv.problems.append(f"{status.name}: unreadable status ({exc})")
