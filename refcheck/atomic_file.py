"""Atomic file replacement: the one way refcheck writes a file a reader or a crash may catch mid-way.

Contract: :func:`atomic_write_bytes` leaves either the old file or the whole new one at the path,
whatever instant the process dies (temp file in the same directory, fsync, ``os.replace``,
directory fsync); :func:`fsync_dir` makes a directory's renames durable. Used by traces, the golden
store and manifest, the SGLang capture's records and the child-process status files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """fsync a directory (its entries' renames become durable); a no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory handles (Windows): nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_file_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777  # replacing a file: keep its permissions
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> int:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync,
    ``os.replace``, directory fsync). On any exception the temp file is removed and an existing
    file at ``path`` is untouched. Returns the bytes written.

    ``durable=False`` skips the two fsyncs: still all-or-nothing for readers, but a power cut may lose
    the write (the capture's per-step records inside a running engine, re-made by re-running)."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    mode = _new_file_mode(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(directory)
    return len(data)
