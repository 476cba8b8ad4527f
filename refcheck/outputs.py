"""Output paths checked before any work starts, and late write failures that keep the report.

Contract: :func:`check_output_file` (``--save-trace FILE``) and :func:`check_output_dir`
(``--out DIR``, ``--cache-dir DIR``) raise :class:`~refcheck.errors.OutputPathError` (exit 2) when the
path cannot be written: its directory is missing, is not a directory, or is read-only; the path is a
directory where a file belongs, or anything but a directory where a directory belongs. An output file
is a regular file or absent: a directory, character or block device (``/dev/null``), FIFO or socket at
the path is refused, never replaced (a symbolic link is judged by what it points to). The same holds
for the files a command writes inside its output directory (``files``). They write nothing. Commands
call them before loading a model, so a bad path costs no run; the atomic writer
(:func:`refcheck.atomic_file.atomic_write_bytes`) refuses to replace a non-regular file too, for a path
that changed meanwhile. :func:`late_write_error` turns an ``OSError`` of a write after the run (disk
full, a directory removed meanwhile) into the same error, which the command raises only after printing
its report.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from refcheck.errors import OutputPathError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))


def file_kind(path: Path) -> str | None:
    """What is at ``path`` ("a regular file", "a directory", "a FIFO", ...; a symbolic link followed), or
    None when nothing is (a dangling link included)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing, under a file, or not reachable: nothing there to replace
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "a special file")


def _writable_dir(directory: Path, option: str, target: Path) -> None:
    if not directory.exists():
        raise OutputPathError(f"{option} {target}: directory {directory} does not exist (nothing was run)")
    if not directory.is_dir():
        raise OutputPathError(f"{option} {target}: {directory} is not a directory (nothing was run)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {target}: directory {directory} is not writable (nothing was run)")


def _regular_or_absent(path: Path, option: str, shown: Path) -> None:
    kind = file_kind(path)
    if kind == "a directory":
        raise OutputPathError(f"{option} {shown} is a directory, not a file (nothing was run)")
    if kind not in (None, "a regular file"):
        raise OutputPathError(f"{option} {shown} is {kind}, not a regular file (refcheck replaces only regular "
                              "files; nothing was run)")
    if kind is not None and not os.access(path, os.W_OK):
        raise OutputPathError(f"{option} {shown} exists and is read-only (nothing was run)")


def check_output_file(path: Path | None, option: str) -> None:
    """``path`` can be created or replaced as a regular file (module docstring); None passes."""
    if path is None:
        return
    path = Path(path)
    _regular_or_absent(path, option, path)
    _writable_dir(path.parent if str(path.parent) else Path("."), option, path)


def check_output_dir(path: Path | None, option: str, files: Iterable[str] = ()) -> None:
    """``path`` is a writable directory, or can be created as one (its nearest existing ancestor is a
    writable directory); each of ``files`` (paths relative to it, which the command writes) is a regular
    file or absent, and their folders directories or absent. None passes."""
    if path is None:
        return
    path = Path(path)
    kind = file_kind(path)
    if kind is not None:
        if kind != "a directory":
            shown = "a file" if kind == "a regular file" else kind
            raise OutputPathError(f"{option} {path} is {shown}, not a directory (nothing was run)")
        _writable_dir(path, option, path)
        for name in files:
            _inner_path(path, Path(name), option)
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    _writable_dir(ancestor, option, path)


def _inner_path(directory: Path, name: Path, option: str) -> None:
    """``directory / name`` can be written as a file: its folders under ``directory`` are directories or
    absent, and it is a regular file or absent."""
    folder = directory
    for part in name.parent.parts:
        folder = folder / part
        kind = file_kind(folder)
        if kind is None:
            return
        if kind != "a directory":
            raise OutputPathError(f"{option} {directory}: {folder} is {kind}, not a directory (nothing was run)")
    _regular_or_absent(directory / name, option, directory / name)


def late_write_error(path: Path, exc: OSError, what: str) -> OutputPathError:
    """The error for a write that failed after the run (the report is already printed)."""
    return OutputPathError(f"could not write {what} to {path}: {exc.strerror or exc} (the report above is complete)")
