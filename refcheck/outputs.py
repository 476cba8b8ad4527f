"""Output paths checked before any work starts, and late write failures that keep the report.

Contract: :func:`check_output_file` (``--save-trace FILE``) and :func:`check_output_dir`
(``--out DIR``) raise :class:`~refcheck.errors.OutputPathError` (exit 2) when the path cannot be
written: its directory is missing, is not a directory, or is read-only; the path is a directory
where a file belongs (or a file where a directory belongs). They write nothing. Commands call them
before loading a model, so a bad path costs no run. :func:`late_write_error` turns an ``OSError``
of a write after the run (disk full, a directory removed meanwhile) into the same error, which
the command raises only after printing its report.
"""

from __future__ import annotations

import os
from pathlib import Path

from refcheck.errors import OutputPathError


def _writable_dir(directory: Path, option: str, target: Path) -> None:
    if not directory.exists():
        raise OutputPathError(f"{option} {target}: directory {directory} does not exist (nothing was run)")
    if not directory.is_dir():
        raise OutputPathError(f"{option} {target}: {directory} is not a directory (nothing was run)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {target}: directory {directory} is not writable (nothing was run)")


def check_output_file(path: Path | None, option: str) -> None:
    """``path`` can be created or replaced as a file (module docstring); None passes."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{option} {path} is a directory, not a file (nothing was run)")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{option} {path} exists and is read-only (nothing was run)")
    _writable_dir(path.parent if str(path.parent) else Path("."), option, path)


def check_output_dir(path: Path | None, option: str) -> None:
    """``path`` is a writable directory, or can be created as one (its nearest existing ancestor
    is a writable directory); None passes."""
    if path is None:
        return
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise OutputPathError(f"{option} {path} is a file, not a directory (nothing was run)")
        _writable_dir(path, option, path)
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    _writable_dir(ancestor, option, path)


def late_write_error(path: Path, exc: OSError, what: str) -> OutputPathError:
    """The error for a write that failed after the run (the report is already printed)."""
    return OutputPathError(f"could not write {what} to {path}: {exc.strerror or exc} (the report above is complete)")
