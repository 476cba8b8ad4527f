"""refcheck/sglang/capture/segments.py: frames appended whole, segments rolled over by size, a failed write cut back,
and a reader that says exactly which frames a cut file still holds."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang.capture.segments import FRAME_HEAD, SegmentLog, frame_bytes, payloads, scan, segment_files


def _read(directory, prefix="records") -> list[bytes]:
    out = []
    for f in segment_files(directory, prefix):
        found = scan(f)
        assert found.torn is None, found.torn
        out += list(payloads(f, found.frames))
    return out


def test_frames_read_back_in_order_and_a_segment_rolls_over_before_a_frame_would_pass_its_size(tmp_path):
    """Frames of 10, 20, 30 and 200 bytes under segments of 64: a frame never splits, the next segment opens when the
    frame would take the current one past 64, and a frame larger than that gets a segment of its own."""
    log = SegmentLog(tmp_path, "records", segment_bytes=64)
    sizes = [10, 20, 30, 200, 5]
    for i, n in enumerate(sizes):
        assert log.append([bytes([i]) * (n // 2), memoryview(bytes([i]) * (n - n // 2))]) == frame_bytes(n)
    assert _read(tmp_path) == [bytes([i]) * n for i, n in enumerate(sizes)]
    files = segment_files(tmp_path, "records")
    assert [f.name for f in files] == [f"records-{i:06d}.seg" for i in range(4)]
    assert [[n for _, n in scan(f).frames] for f in files] == [[10, 20], [30], [200], [5]]
    assert all(f.stat().st_size <= 64 for f in files if len(scan(f).frames) > 1)


def test_the_frames_buffers_go_out_in_one_writev_resumed_where_a_short_write_stopped(tmp_path, monkeypatch):
    """One ``writev`` a frame (its head and the record's buffers; an empty one left out); a write the kernel cuts short
    (5 bytes at a time: inside a buffer and across two) is resumed where it stopped, and the frame is whole."""
    calls: list[int] = []
    real = os.writev

    def short(fd, views):
        calls.append(len(views))
        head, left = [], 5
        for v in views:
            head.append(v[:left])
            left -= len(head[-1])
            if not left:
                break
        return real(fd, head)

    monkeypatch.setattr(os, "writev", short)
    log = SegmentLog(tmp_path, "records")
    parts = [b"abcdefg", b"", memoryview(b"hij"), b"klmnopqrstu"]
    assert log.append(parts) == FRAME_HEAD + 21
    assert calls[0] == 4 and len(calls) == -(-(FRAME_HEAD + 21) // 5)
    assert _read(tmp_path) == [b"abcdefghijklmnopqrstu"]


def test_a_write_the_disk_refuses_midway_is_cut_back_to_the_last_whole_frame(tmp_path, monkeypatch):
    """The disk takes 7 bytes of a frame, then is full: the append raises, the segment ends on its last whole frame,
    and once there is room the next frame follows it in the same segment."""
    log = SegmentLog(tmp_path, "records")
    log.append([b"first"])
    real, state = os.writev, {"left": 7}

    def filling(fd, views):
        if state["left"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, [bytes(views[0][:state["left"]])])
        state["left"] -= n
        return n

    monkeypatch.setattr(os, "writev", filling)
    with pytest.raises(OSError, match="No space"):
        log.append([b"second, never whole"])
    monkeypatch.setattr(os, "writev", real)
    f, = segment_files(tmp_path, "records")
    assert f.stat().st_size == frame_bytes(5) and scan(f).torn is None
    log.append([b"third"])
    assert _read(tmp_path) == [b"first", b"third"] and len(segment_files(tmp_path, "records")) == 1


def test_a_segment_that_cannot_be_cut_back_is_closed_and_its_torn_end_reported(tmp_path, monkeypatch):
    log = SegmentLog(tmp_path, "records")
    log.append([b"first"])
    real = os.writev

    def half(fd, views):
        real(fd, [bytes(views[0][:3])])
        raise OSError(errno.EIO, "Input/output error")

    def no_truncate(fd, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "writev", half)
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError, match="Input/output"):
        log.append([b"second"])
    monkeypatch.undo()
    log.append([b"third"])
    first, second = segment_files(tmp_path, "records")
    torn = scan(first)
    assert [n for _, n in torn.frames] == [5] and "cut short at byte 17" in torn.torn
    assert list(payloads(second, scan(second).frames)) == [b"third"]


def test_dropping_the_oldest_segment_frees_its_bytes_and_frames_the_current_one_last(tmp_path):
    log = SegmentLog(tmp_path, "records", segment_bytes=1)  # one frame a segment
    for payload in (b"a", b"bb", b"ccc"):
        log.append([payload])
    assert log.drop_oldest() == (frame_bytes(1), 1)
    assert _read(tmp_path) == [b"bb", b"ccc"]
    assert log.drop_oldest() == (frame_bytes(2), 1) and log.drop_oldest() == (frame_bytes(3), 1)
    assert log.drop_oldest() is None and segment_files(tmp_path, "records") == []
    log.append([b"dddd"])  # the current segment went: the next frame opens a new one
    assert _read(tmp_path) == [b"dddd"]
    log.close()


def test_bytes_that_are_not_a_frame_end_the_scan_and_say_where(tmp_path):
    log = SegmentLog(tmp_path, "records")
    log.append([b"whole"])
    f, = segment_files(tmp_path, "records")
    with open(f, "ab") as out:
        out.write(b"not a frame at all")
    found = scan(f)
    assert [n for _, n in found.frames] == [5]
    assert found.torn == f"bytes that are not a frame at byte {frame_bytes(5)} (18 bytes unread)"


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8), cut=st.floats(0.0, 1.0))
def test_a_segment_cut_anywhere_holds_exactly_the_frames_before_the_cut(tmp_path_factory, sizes, cut):
    """A segment cut at any byte (a crash mid-write, a lost tail) reads as the frames wholly before the cut, and says
    it is torn unless the cut falls on a frame's end."""
    d = tmp_path_factory.mktemp("seg")
    log = SegmentLog(d, "records")
    for i, n in enumerate(sizes):
        log.append([bytes([i % 256]) * n])
    log.close()
    f, = segment_files(d, "records")
    whole = f.read_bytes()
    at = round(cut * len(whole))
    f.write_bytes(whole[:at])
    ends = [sum(frame_bytes(n) for n in sizes[:k + 1]) for k in range(len(sizes))]
    kept = sum(1 for e in ends if e <= at)
    found = scan(f)
    assert list(payloads(f, found.frames)) == [bytes([i % 256]) * n for i, n in enumerate(sizes[:kept])]
    assert (found.torn is None) == (at == 0 or at in ends)


def test_a_segment_size_below_one_byte_is_refused(tmp_path):
    with pytest.raises(ValueError, match="segment_bytes must be >= 1"):
        SegmentLog(tmp_path, "records", segment_bytes=0)


def test_a_frame_whose_bytes_went_between_scan_and_read_is_an_error(tmp_path):
    log = SegmentLog(tmp_path, "records")
    log.append([b"0123456789"])
    f, = segment_files(tmp_path, "records")
    frames = scan(f).frames
    os.truncate(f, FRAME_HEAD + 4)
    with pytest.raises(ValueError, match="cut short"):
        list(payloads(f, frames))
