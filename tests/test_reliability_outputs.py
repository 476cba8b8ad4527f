"""Output paths are regular files or nothing (refcheck/outputs.py, refcheck/atomic_file.py): a directory, device,
FIFO or socket at an output path is refused before any work and never replaced, by the pre-check and by the
atomic writer itself (a path that changed after the check); the gate cache's directory is checked on opening,
and a cache write that fails later is a warning, not a failed gate."""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

import pytest

from refcheck import atomic_file
from refcheck.atomic_file import NotRegularFileError, atomic_write_bytes
from refcheck.errors import OutputPathError
from refcheck.outputs import check_output_dir, check_output_file, file_kind


def _socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def _specials(tmp_path: Path) -> dict[str, Path]:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "null").symlink_to("/dev/null")
    (tmp_path / "dir").mkdir()
    return {"a FIFO": tmp_path / "fifo", "a character device": tmp_path / "null", "a socket": _socket(tmp_path / "sock"),
            "a directory": tmp_path / "dir"}


def test_file_kind_names_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert file_kind(tmp_path / "f") == "a regular file"
    assert file_kind(tmp_path / "nope") is None and file_kind(tmp_path / "dangling") is None
    assert file_kind(tmp_path / "f" / "under") is None
    for kind, path in _specials(tmp_path).items():
        assert file_kind(path) == kind


def test_an_output_file_must_be_a_regular_file_or_absent(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    check_output_file(tmp_path / "f", "--save-trace")
    check_output_file(tmp_path / "new.arrow", "--save-trace")
    for kind, path in _specials(tmp_path).items():
        with pytest.raises(OutputPathError, match=f"--save-trace {path} is {kind}, not a"):
            check_output_file(path, "--save-trace")
    assert (tmp_path / "fifo").is_fifo() and (tmp_path / "null").is_symlink()  # checked, nothing changed


def test_files_inside_an_output_directory_are_checked(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    check_output_dir(out, "--out", ["sweep.json", "traces/a.arrow"])  # absent: fine
    os.mkfifo(out / "sweep.json")
    with pytest.raises(OutputPathError, match=r"--out .*sweep\.json is a FIFO"):
        check_output_dir(out, "--out", ["sweep.json"])
    (out / "traces").write_text("x")
    with pytest.raises(OutputPathError, match=r"--out .*: .*traces is a regular file, not a directory"):
        check_output_dir(out, "--out", ["traces/a.arrow"])
    with pytest.raises(OutputPathError, match=r"--cache-dir .*sweep\.json is a FIFO, not a directory"):
        check_output_dir(out / "sweep.json", "--cache-dir")


@pytest.mark.parametrize("kind", ["a FIFO", "a character device", "a socket"])
def test_the_atomic_writer_never_replaces_a_special_file(tmp_path: Path, kind: str) -> None:
    path = _specials(tmp_path)[kind]
    before = os.lstat(path)
    with pytest.raises(NotRegularFileError, match="not a regular file"):
        atomic_write_bytes(path, b"data")
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no temp file left


def test_the_atomic_writer_checks_again_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO made at the path while the data is written (after the first check) is still not replaced."""
    path = tmp_path / "t.arrow"
    chmod = os.chmod

    def chmod_then_fifo(p, mode) -> None:
        chmod(p, mode)
        os.mkfifo(path)

    monkeypatch.setattr(atomic_file.os, "chmod", chmod_then_fifo)
    with pytest.raises(NotRegularFileError):
        atomic_write_bytes(path, b"data")
    assert path.is_fifo() and os.listdir(tmp_path) == ["t.arrow"]


def test_the_atomic_writer_replaces_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"old")
    atomic_write_bytes(tmp_path / "f", b"new")
    assert (tmp_path / "f").read_bytes() == b"new"


def test_a_late_save_trace_into_a_special_file_is_an_output_error(cli, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The path passes the pre-check, then becomes a FIFO during the run: the report prints, then exit 2 (the
    writer's refusal), and the FIFO stays."""
    from bad_input_kit import FAST, ONE_PROMPT, prompts

    from refcheck.outputs import check_output_file as real_check
    path = tmp_path / "t.arrow"

    def check_then_fifo(p, option) -> None:
        real_check(p, option)
        os.mkfifo(path)

    monkeypatch.setattr("refcheck.outputs.check_output_file", check_then_fifo)
    code, _, err = cli("diff", "--engine", "reference", "--save-trace", str(path), "--prompts",
                       str(prompts(tmp_path, ONE_PROMPT)), *FAST)
    assert code == 2 and "Traceback" not in err and path.is_fifo()
    assert "not a regular file" in err and "the report above is complete" in err


def test_a_gate_cache_that_cannot_be_opened_is_refused_and_a_late_write_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from refcheck.diff.findings import Report
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.cache import ReportCache
    from refcheck.goldens.manifest import load_manifest

    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"--cache-dir .*: .*f is not a directory"):
        ReportCache(tmp_path / "f" / "cache", roots=(tmp_path,))
    cache = ReportCache(tmp_path / "cache", roots=(tmp_path,))
    entry = next(e for e in load_manifest(REPO_GOLDEN).cases.values() if str(e.provenance.get("model", "")).startswith("builtin:"))

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("refcheck.goldens.cache.atomic_write_bytes", full)
    with caplog.at_level(logging.WARNING, logger="refcheck"):
        cache.put(entry, Report(case="c", mode="both"))
    assert any("No space left on device" in r.getMessage() and "verdict is unaffected" in r.getMessage()
               for r in caplog.records)


def test_a_new_file_gets_the_umask_without_the_umask_being_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """refcheck/atomic_file.py reads the process's umask where the kernel reports it: another thread of the
    process (the SGLang engine's, beside the capture's writer) never sees it set to 0 for an instant."""
    import os
    import sys

    from refcheck import atomic_file

    old = os.umask(0o027)
    try:
        if sys.platform.startswith("linux"):
            monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was changed to be read"))
        assert atomic_file.process_umask() == 0o027
        atomic_file.atomic_write_bytes(tmp_path / "new.bin", b"x")
        assert (tmp_path / "new.bin").stat().st_mode & 0o777 == 0o640
    finally:
        monkeypatch.undo()
        os.umask(old)
