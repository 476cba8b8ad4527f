"""The crash-safe, locked store behind a golden directory (traces + ``MANIFEST.json``).

Contract:

* **One writer at a time.** Every change runs under an exclusive ``fcntl.flock`` on the golden
  directory itself (its directory file descriptor: no lock file to leave behind). A second writer
  waits up to ``timeout`` seconds (default :data:`DEFAULT_LOCK_TIMEOUT`, env
  ``REFCHECK_GOLDEN_LOCK_TIMEOUT``) and then raises :class:`~refcheck.errors.GoldenLockError`.
  The manifest is (re)loaded under the lock, so concurrent writers of different cases never lose
  each other's update.
* **All or nothing, whatever instant the process dies.** :func:`commit` applies one change set
  (traces written, cases removed) as a transaction:

  1. each new trace is written to ``.<case>.arrow.<txid>.staged`` and fsynced; the new manifest to
     ``.MANIFEST.json.<txid>.staged``; the directory is fsynced;
  2. **commit point**: the journal :data:`JOURNAL_NAME` (renames, deletions, the staged manifest)
     is written atomically (temp, fsync, rename, directory fsync);
  3. the staged traces are renamed onto their final names, the staged manifest onto
     ``MANIFEST.json``, the files of removed cases and stale ``*.pending`` files are deleted, the
     directory is fsynced, and the journal is deleted.

  A crash before the commit point leaves the old store (plus staged leftovers, reported by
  :func:`leftovers`); a crash after it is rolled forward by :func:`recover`, which every writer
  and :func:`~refcheck.golden.verify` run first (idempotent). Readers take a shared lock
  (:func:`reading`), so a reader sees every case at its old or its new version, never a mix of
  manifest and bytes.
* **Fault injection**: with ``REFCHECK_CRASH_AT=k`` the process ``os._exit(CRASH_EXIT)``-s right
  after its k-th durable write step (``REFCHECK_CRASH_LOG=1`` prints each step's label to stderr).
* **Case names** are plain names (:data:`CASE_NAME_RE`: letters, digits, ``_``, ``-``, ``+``, and
  single dots between them; no path separator, no ``..``, no leading dot, at most 100 characters):
  anything else is a :class:`~refcheck.errors.UsageError` (exit 2).
* A read-only or missing directory for a writer is a :class:`~refcheck.errors.UsageError` raised
  by :func:`check_writable` before any work (callers run it before a long computation).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes, fsync_dir
from refcheck.errors import CorruptTraceError, GoldenError, GoldenLockError, UsageError
from refcheck.trace.manifest import MANIFEST_NAME, Manifest, load_manifest, plain_name, sha256_bytes

JOURNAL_NAME = ".refcheck-golden.journal"
STAGED_SUFFIX = ".staged"
PENDING_SUFFIX = ".pending"
CRASH_ENV = "REFCHECK_CRASH_AT"
CRASH_LOG_ENV = "REFCHECK_CRASH_LOG"
CRASH_EXIT = 86
LOCK_TIMEOUT_ENV = "REFCHECK_GOLDEN_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 60.0
CASE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]*(?:\.[A-Za-z0-9_+-]+)*")
_MAX_CASE = 100
_POLL_S = 0.05


# ------------------------------------------------------------------------------ case names
def check_case_name(name: str) -> str:
    """``name`` if it is a plain case name (module docstring), else :class:`UsageError`."""
    if not isinstance(name, str) or len(name) > _MAX_CASE or not CASE_NAME_RE.fullmatch(name):
        raise UsageError(f"case name {name!r} is not a plain name (letters, digits, '_', '-', '+' and single "
                         f"inner dots; no path separators, no '..', no leading dot; at most {_MAX_CASE} characters)")
    return name


def trace_file_name(case: str) -> str:
    return f"{check_case_name(case)}.arrow"


# ------------------------------------------------------------------------------ crash hook
class _CrashHook:
    """Counts durable write steps; ``os._exit`` after step ``REFCHECK_CRASH_AT`` (test hook)."""

    def __init__(self) -> None:
        self.count = 0

    def step(self, label: str) -> None:
        self.count += 1
        if os.environ.get(CRASH_LOG_ENV):
            logging.getLogger(__name__).warning("refcheck store step %d: %s", self.count, label)
        target = os.environ.get(CRASH_ENV, "")
        if target.isdigit() and int(target) == self.count:
            os._exit(CRASH_EXIT)


# ---------------------------------------------------------------------------------- lock
def check_writable(directory: Path) -> None:
    """A writer's pre-flight: the directory (or its nearest existing parent) must be writable."""
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"golden directory {directory}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"golden directory {directory} is not writable ({probe} is read-only); nothing was changed")


def _lock_timeout(timeout: float | None) -> float:
    if timeout is not None:
        return timeout
    text = os.environ.get(LOCK_TIMEOUT_ENV)
    try:
        return DEFAULT_LOCK_TIMEOUT if text is None else float(text)
    except ValueError:
        raise UsageError(f"{LOCK_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


@contextlib.contextmanager
def locked(directory: Path, timeout: float | None = None, shared: bool = False) -> Iterator[None]:
    """Hold the golden directory's exclusive writer lock, or with ``shared`` a reader's lock (many
    readers at once, none while a writer applies a change); waits up to ``timeout`` seconds."""
    wait = _lock_timeout(timeout)
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise GoldenLockError(f"golden directory {directory} is locked by {'a' if shared else 'another'} writer (waited "
                                          f"{wait:g} s; set {LOCK_TIMEOUT_ENV} to wait longer); nothing was changed") from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ------------------------------------------------------------------------------- journal
@dataclass(slots=True)
class Journal:
    """A committed transaction still being applied: what :func:`recover` rolls forward."""

    txid: str
    renames: list[tuple[str, str]]  # (staged name, final name)
    manifest: str  # staged manifest name
    deletes: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return json.dumps({"version": 1, "txid": self.txid, "renames": self.renames, "manifest": self.manifest,
                           "deletes": self.deletes}, indent=1).encode()


def _names(obj: Any, where: str) -> list[str]:
    if not isinstance(obj, list) or not all(isinstance(n, str) and plain_name(n) for n in obj):
        raise CorruptTraceError(f"{where}: not a list of plain file names")
    return obj


def read_journal(directory: Path) -> Journal | None:
    path = Path(directory) / JOURNAL_NAME
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptTraceError(f"golden journal {path} is unreadable: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("txid"), str) or not isinstance(obj.get("renames"), list):
        raise CorruptTraceError(f"golden journal {path} is malformed")
    renames = [tuple(_names(pair, f"{path} renames")) for pair in obj["renames"]]
    if any(len(pair) != 2 for pair in renames):
        raise CorruptTraceError(f"golden journal {path}: a rename is not a (staged, final) pair")
    manifest = _names([obj.get("manifest")], f"{path} manifest")[0]
    return Journal(obj["txid"], [(a, b) for a, b in renames], manifest, _names(obj.get("deletes", []), f"{path} deletes"))


def _apply(directory: Path, journal: Journal, hook: _CrashHook) -> None:
    """Roll a committed journal forward (idempotent: a step already done is skipped)."""
    for staged, final in journal.renames:
        if (directory / staged).exists():
            os.replace(directory / staged, directory / final)
            hook.step(f"rename {staged} -> {final}")
    if (directory / journal.manifest).exists():
        os.replace(directory / journal.manifest, directory / MANIFEST_NAME)
        hook.step(f"switch {MANIFEST_NAME}")
    fsync_dir(directory)
    for name in journal.deletes:
        if (directory / name).exists() or (directory / name).is_symlink():
            (directory / name).unlink()
            hook.step(f"delete {name}")
    fsync_dir(directory)
    (directory / JOURNAL_NAME).unlink(missing_ok=True)
    fsync_dir(directory)
    hook.step("journal done")


def recover(directory: Path, hook: _CrashHook | None = None) -> bool:
    """Roll forward a transaction that passed its commit point (caller holds the lock). True if
    there was one. A read-only directory with a pending journal is a :class:`GoldenError`."""
    directory = Path(directory)
    journal = read_journal(directory)
    if journal is None:
        return False
    if not os.access(directory, os.W_OK):
        raise GoldenError(f"{directory} holds an interrupted golden change ({JOURNAL_NAME}); run refcheck golden "
                          "verify with write access to complete it")
    _apply(directory, journal, hook or _CrashHook())
    return True


def recover_locked(directory: Path, timeout: float | None = None) -> bool:
    """:func:`recover` under the writer lock; a no-op (without locking) when there is no journal."""
    directory = Path(directory)
    if not (directory / JOURNAL_NAME).exists():
        return False
    with locked(directory, timeout):
        return recover(directory)


@contextlib.contextmanager
def reading(directory: Path, timeout: float | None = None) -> Iterator[None]:
    """A consistent view for a reader (manifest + files): a committed change is completed first,
    then a shared lock is held. A missing directory yields without a lock (the manifest loader
    reports it)."""
    directory = Path(directory)
    if not directory.is_dir():
        yield
        return
    recover_locked(directory, timeout)
    with locked(directory, timeout, shared=True):
        yield


# ---------------------------------------------------------------------------- transaction
@dataclass(slots=True)
class Write:
    """A trace to store as ``case`` (new or replacing), with its manifest summary and reason."""

    case: str
    data: bytes
    summary: dict[str, Any]
    reason: str | None = None


@dataclass(slots=True)
class Remove:
    case: str
    reason: str


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _stage(directory: Path, name: str, data: bytes, txid: str, hook: _CrashHook) -> str:
    staged = f".{name}.{txid}{STAGED_SUFFIX}"
    with open(directory / staged, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    hook.step(f"stage {staged}")
    return staged


def _plan(manifest: Manifest, writes: list[Write], removes: list[Remove]) -> list[str]:
    """Apply the change set to ``manifest`` in memory; returns the files to delete afterwards."""
    deletes: list[str] = []
    for w in writes:
        name = trace_file_name(w.case)
        manifest.record(w.case, name, sha256_bytes(w.data), len(w.data), w.summary, reason=w.reason)
        deletes.append(name + PENDING_SUFFIX)
    for r in removes:
        check_case_name(r.case)
        if r.case not in manifest.cases:
            raise GoldenError(f"no golden case {r.case!r} to remove (cases: {', '.join(sorted(manifest.cases)) or 'none'})")
        entry = manifest.cases.pop(r.case)
        manifest.removed.append({"case": r.case, "reason": r.reason, "time": _now(), "entry": entry.to_json()})
        if entry.file not in {trace_file_name(w.case) for w in writes}:
            deletes.append(entry.file)
    return deletes


def commit(directory: Path, writes: list[Write] = (), removes: list[Remove] = (),  # type: ignore[assignment]
           timeout: float | None = None) -> Manifest:
    """Apply ``writes`` and ``removes`` to the store as one transaction (module docstring); returns
    the new manifest. Nothing changes on an error raised before the commit point."""
    directory = Path(directory)
    writes, removes = list(writes), list(removes)
    check_writable(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hook = _CrashHook()
    with locked(directory, timeout):
        recover(directory, hook)
        manifest = load_manifest(directory, allow_missing=True)
        deletes = _plan(manifest, writes, removes)
        txid = secrets.token_hex(6)
        staged: list[str] = []
        try:
            renames = []
            for w in writes:
                staged.append(_stage(directory, trace_file_name(w.case), w.data, txid, hook))
                renames.append((staged[-1], trace_file_name(w.case)))
            staged.append(_stage(directory, MANIFEST_NAME, manifest.to_bytes(), txid, hook))
            fsync_dir(directory)
            journal = Journal(txid, renames, staged[-1], deletes)
            atomic_write_bytes(directory / JOURNAL_NAME, journal.to_bytes())
        except BaseException as exc:
            for name in staged:
                (directory / name).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise UsageError(f"cannot write golden directory {directory}: {exc.strerror or exc}; nothing was "
                                 "changed") from None
            raise
        hook.step("commit journal")
        try:
            _apply(directory, journal, hook)
        except OSError as exc:
            raise GoldenError(f"golden change committed but not fully applied in {directory} ({exc.strerror or exc}); "
                              "refcheck golden verify completes it") from None
    return manifest


# ------------------------------------------------------------------------------ leftovers
@dataclass(slots=True)
class Leftovers:
    """Files in a golden directory that the manifest does not own."""

    orphans: list[str]  # *.arrow not named by any manifest entry
    temporary: list[str]  # staged files of aborted transactions, atomic-write temp files
    pending: list[str]  # *.pending review outputs of `golden regen` without --accept

    def messages(self) -> list[str]:
        out = [f"orphan trace {n} is not in {MANIFEST_NAME} (golden add it, or clean it with --clean-orphans)"
               for n in self.orphans]
        out += [f"leftover temporary file {n} from an interrupted write (clean it with --clean)" for n in self.temporary]
        out += [f"pending golden {n} awaits review (regen --accept, or clean it with --clean)" for n in self.pending]
        return out


def leftovers(directory: Path, manifest: Manifest) -> Leftovers:
    owned = {e.file for e in manifest.cases.values()}
    orphans, temporary, pending = [], [], []
    for p in sorted(Path(directory).iterdir()):
        name = p.name
        if name in (MANIFEST_NAME, JOURNAL_NAME) or name in owned:
            continue
        if name.startswith(".") and (name.endswith(STAGED_SUFFIX) or name.endswith(".tmp")):
            temporary.append(name)
        elif name.endswith(PENDING_SUFFIX):
            pending.append(name)
        elif name.endswith(".arrow"):
            orphans.append(name)
    return Leftovers(orphans, temporary, pending)


def clean(directory: Path, orphans: bool = False, timeout: float | None = None) -> list[str]:
    """Delete leftover temporary and pending files (and orphan traces with ``orphans``) under the
    lock, after rolling forward any committed transaction; returns the names deleted."""
    directory = Path(directory)
    check_writable(directory)
    with locked(directory, timeout):
        recover(directory)
        left = leftovers(directory, load_manifest(directory))
        names = left.temporary + left.pending + (left.orphans if orphans else [])
        for name in names:
            (directory / name).unlink(missing_ok=True)
        fsync_dir(directory)
    return names
