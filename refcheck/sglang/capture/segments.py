"""Segment files: a scheduler process's capture records appended one after another to few open files.

Contract: a :class:`SegmentLog` appends each record (its encoded buffers,
:func:`refcheck.sglang.capture.packing.encode_parts`) to the current segment of its directory,
``{prefix}-{index:06d}.seg``, as one *frame*: :data:`FRAME_MAGIC` (4 bytes), the payload's length (u64,
little-endian) and the payload. The frame goes out in one ``writev`` to a file held open (again for what a short
write left): the writer thread makes one system call a record, where a file per record costs an exclusive create,
a write, a close and a rename (each a handover of the interpreter lock the engine's thread pays for), and the
directory holds one file per ``segment_bytes`` of records, not one per record. A frame that would take its segment
past ``segment_bytes`` opens the next segment first (a frame is never split; a segment holds at least one).

A write that fails (a full disk) truncates the segment back to where its frame began and raises, so a segment holds
whole frames only; when even that fails, the segment is closed and the next frame opens a new one (the reader
reports the torn end). Nothing is fsynced: a crash loses at most the frame being written, and a power cut the
segments' tails, both reported by the reader. :meth:`SegmentLog.drop_oldest` deletes the oldest segment, the
current one too when it is the only one (a rolling byte budget's room).

:func:`scan` lists a segment's frames (offset and length of each payload, read from the frames' heads alone) and
says what follows the last whole frame when the file does not end there: a frame cut short (the one being
written, or a tail a power cut lost) or bytes that are not a frame; :func:`scans` does so for every segment of a
directory, oldest first. :func:`payloads` reads chosen frames' payloads.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

FRAME_MAGIC = b"RCF1"
_HEAD = struct.Struct("<4sQ")  # magic, payload length
FRAME_HEAD = _HEAD.size  # bytes a frame adds to its payload
SEGMENT_BYTES = 64 << 20  # a segment's size before the next one opens


def frame_bytes(payload: int) -> int:
    """The bytes a frame of ``payload`` bytes takes in its segment."""
    return FRAME_HEAD + payload


def segment_files(directory: Path, prefix: str) -> list[Path]:
    """The directory's segments of ``prefix``, oldest first."""
    return sorted(Path(directory).glob(f"{prefix}-[0-9]*.seg"))


def write_all(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """Write ``parts`` end to end at ``fd``'s position in one ``writev``, again for what a short write left (empty
    buffers left out); returns the bytes written."""
    views = [v for v in (memoryview(part).cast("B") for part in parts) if v]
    written = 0
    while views:
        n = os.writev(fd, views)
        written += n
        while views and n >= len(views[0]):  # the buffers written whole
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]  # the rest of one written in part
    return written


@dataclass
class _Segment:
    path: Path
    fd: int | None  # open while it is the current segment
    size: int = 0
    frames: int = 0


class SegmentLog:
    """The segments of one writer (module docstring): appended by any thread, one frame at a time."""

    def __init__(self, directory: Path, prefix: str, segment_bytes: int = SEGMENT_BYTES) -> None:
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        self.directory, self.prefix, self.segment_bytes = Path(directory), prefix, segment_bytes
        self._segments: list[_Segment] = []  # oldest first; the last is current while its fd is open
        self._next = 0  # the next segment's index
        self._lock = threading.Lock()

    def append(self, parts: Sequence[bytes | memoryview], payload: int | None = None) -> int:
        """Append one frame holding ``parts`` end to end (``payload``: their bytes, when the caller has counted them);
        returns the frame's bytes."""
        if payload is None:
            payload = sum(memoryview(p).nbytes for p in parts)
        size = frame_bytes(payload)
        with self._lock:
            seg = self._current(size)
            assert seg.fd is not None
            try:
                write_all(seg.fd, [_HEAD.pack(FRAME_MAGIC, payload), *parts])
            except BaseException:
                self._cut_back(seg)
                raise
            seg.size += size
            seg.frames += 1
        return size

    def drop_oldest(self) -> tuple[int, int] | None:
        """Delete the oldest segment: (its bytes, its frames), or None when there is none."""
        with self._lock:
            if not self._segments:
                return None
            seg = self._segments.pop(0)
            if seg.fd is not None:
                os.close(seg.fd)
            seg.path.unlink(missing_ok=True)
            return seg.size, seg.frames

    def close(self) -> None:
        with self._lock:
            for seg in self._segments:
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None

    def _current(self, size: int) -> _Segment:
        """The segment the next frame of ``size`` bytes goes to, opening a new one when the current is closed or
        the frame would take it past ``segment_bytes``."""
        seg = self._segments[-1] if self._segments else None
        if seg is not None and seg.fd is not None and (seg.frames == 0 or seg.size + size <= self.segment_bytes):
            return seg
        if seg is not None and seg.fd is not None:
            os.close(seg.fd)
            seg.fd = None
        path = self.directory / f"{self.prefix}-{self._next:06d}.seg"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the process's umask applied
        self._next += 1
        seg = _Segment(path, fd)
        self._segments.append(seg)
        return seg

    def _cut_back(self, seg: _Segment) -> None:
        """After a failed write: the segment back to its last whole frame, or closed when that fails too."""
        assert seg.fd is not None
        try:
            os.ftruncate(seg.fd, seg.size)
            os.lseek(seg.fd, seg.size, os.SEEK_SET)
        except OSError:
            os.close(seg.fd)
            seg.fd = None


@dataclass(frozen=True)
class Scan:
    frames: list[tuple[int, int]]  # each whole frame's payload: (offset in the file, length)
    torn: str | None  # what follows the last whole frame, when the file does not end there


def scan(path: Path) -> Scan:
    """The frames of one segment, from their heads alone (module docstring)."""
    frames: list[tuple[int, int]] = []
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        offset = 0
        while offset < end:
            head = f.read(FRAME_HEAD)
            if len(head) < FRAME_HEAD:
                return Scan(frames, f"a frame cut short at byte {offset} ({end - offset} of its head's "
                                    f"{FRAME_HEAD} bytes)")
            magic, length = _HEAD.unpack(head)
            if magic != FRAME_MAGIC:
                return Scan(frames, f"bytes that are not a frame at byte {offset} ({end - offset} bytes unread)")
            if offset + FRAME_HEAD + length > end:
                return Scan(frames, f"a frame cut short at byte {offset} ({end - offset - FRAME_HEAD} of its "
                                    f"{length} bytes)")
            frames.append((offset + FRAME_HEAD, length))
            offset += FRAME_HEAD + length
            f.seek(offset)
    return Scan(frames, None)


def scans(directory: Path, prefix: str) -> list[tuple[Path, Scan | OSError]]:
    """Every segment of ``prefix`` in ``directory``, oldest first, with its :func:`scan`, or the ``OSError`` reading
    it raised (``FileNotFoundError``: deleted meanwhile, by a rolling budget say); the last is the newest, the one a
    running writer appends to."""
    out: list[tuple[Path, Scan | OSError]] = []
    for f in segment_files(directory, prefix):
        try:
            out.append((f, scan(f)))
        except OSError as exc:
            out.append((f, exc))
    return out


def payloads(path: Path, frames: Sequence[tuple[int, int]]) -> Iterator[bytes]:
    """The payloads of ``frames`` (:attr:`Scan.frames` entries) of the segment at ``path``, in order."""
    with open(path, "rb") as f:
        for offset, length in frames:
            f.seek(offset)
            data = f.read(length)
            if len(data) != length:
                raise ValueError(f"frame at byte {offset} cut short ({len(data)} of {length} bytes)")
            yield data
