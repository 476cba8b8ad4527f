"""Atomic file replacement: how refcheck writes a whole file that a reader or a crash may catch mid-way (the SGLang
capture's records are appended as frames instead: :mod:`refcheck.sglang.capture.segments`).

Contract: :func:`atomic_write_bytes` leaves either the old file or the whole new one at the path,
whatever instant the process dies (temp file in the same directory, fsync, ``os.replace``,
directory fsync); :func:`fsync_dir` makes a directory's renames durable. It replaces only a regular
file: a directory, device (``/dev/null``), FIFO or socket at the path (a symbolic link followed) is a
:class:`NotRegularFileError` and stays as it is. Used by traces, the golden store and manifest, the
SGLang capture's status files and the child-process status files.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path


class NotRegularFileError(OSError):
    """The path to write holds something other than a regular file (a directory, device, FIFO, socket)."""


def refuse_non_regular(path: Path) -> None:
    """Raise :class:`NotRegularFileError` unless ``path`` is a regular file or absent (a link followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or unreachable: the write itself reports that)
        return
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(errno.EEXIST, "not a regular file (a directory, device, FIFO or socket): refusing to "
                                                "replace it", str(path))


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


def process_umask() -> int:
    """The process's umask, read where the kernel reports it (Linux: ``/proc/self/status``) without changing it;
    elsewhere set and restored at once (another thread creating a file in that instant would get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _new_file_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777  # replacing a file: keep its permissions
    except OSError:
        return 0o666 & ~process_umask()


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> int:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync,
    ``os.replace``, directory fsync). On any exception the temp file is removed and an existing
    file at ``path`` is untouched. Something other than a regular file at ``path`` (before the write or at
    the rename) is a :class:`NotRegularFileError`. Returns the bytes written.

    ``durable=False`` skips the two fsyncs: still all-or-nothing for readers, but a power cut may lose
    the write (the capture's per-step records inside a running engine, re-made by re-running)."""
    path = Path(path)
    refuse_non_regular(path)
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
        refuse_non_regular(path)  # made meanwhile
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(directory)
    return len(data)
