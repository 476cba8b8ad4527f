"""The crash-safe, locked store behind a golden directory (traces + ``MANIFEST.json``).

Contract:

* **One writer at a time.** Every change runs under an exclusive ``fcntl.flock`` on the golden
  directory itself (its directory file descriptor: no lock file to leave behind). A second writer
  waits up to ``timeout`` seconds (default :data:`DEFAULT_LOCK_TIMEOUT`, env
  ``REFCHECK_GOLDEN_LOCK_TIMEOUT``) and then raises :class:`~refcheck.errors.GoldenLockError`.
  The manifest is (re)loaded under the lock, so concurrent writers of different cases never lose
  each other's update; a :class:`Write` made from a review of the store (``golden regen``) names the
  entry it replaces (``expect_base``, ``base``) and is refused with a
  :class:`~refcheck.errors.GoldenError` when another writer replaced, added or removed that case
  meanwhile (a removed case is never brought back by a write prepared before the removal).
* **All or nothing, whatever instant the process dies.** :func:`commit` applies one change set
  (traces written, cases removed) as a transaction:

  1. each new trace is written to ``.<case>.arrow.<txid>.staged`` and fsynced; the new manifest to
     ``.MANIFEST.json.<txid>.staged``; the directory is fsynced; a failure here (a full disk
     included) deletes every staged file it created;
  2. **commit point**: the journal :data:`JOURNAL_NAME` (version :data:`JOURNAL_VERSION`: the txid,
     the renames, the deletions, the staged manifest and the sha256 of every staged file) is written
     atomically (temp, fsync, rename, directory fsync);
  3. the staged traces are renamed onto their final names, the staged manifest onto
     ``MANIFEST.json``, the files of removed cases and stale ``*.pending`` files are deleted, the
     directory is fsynced, and the journal is deleted.

  A crash before the commit point leaves the old store (plus staged leftovers, reported by
  :func:`leftovers`); a crash after it is rolled forward by :func:`recover`, which every writer
  and :func:`~refcheck.goldens.verify.verify` run first (idempotent). Readers take a shared lock
  (:func:`reading`), so a reader sees every case at its old or its new version, never a mix of
  manifest and bytes.
* **A journal is obeyed only when it is its transaction's.** Before anything is renamed or deleted,
  :func:`recover` checks that every name follows from the journal's txid (staged names it created,
  ``<case>.arrow`` finals, ``MANIFEST.json`` only through its staged replacement), that each staged
  file (or, once renamed, its final name) holds the sha256 the journal records, that the manifest it
  commits lists each final with that sha256, and that it deletes only ``*.pending`` files of its own
  finals and files of cases that manifest records as removed and no case owns. Any other journal
  (unreadable, another version, a name or hash that does not check out) is a
  :class:`~refcheck.errors.CorruptTraceError` naming it, and is left alone with every file it names.
* **Fault injection**: with ``REFCHECK_CRASH_AT=k`` the process ``os._exit(CRASH_EXIT)``-s right
  after its k-th durable write step (``REFCHECK_CRASH_LOG=1`` prints each step's label to stderr).
* **Case names** are plain names (:data:`CASE_NAME_RE`: letters, digits, ``_``, ``-``, ``+``, and
  single dots between them; no path separator, no ``..``, no leading dot, no control character, at
  most 100 characters): anything else is a :class:`~refcheck.errors.UsageError` (exit 2), its name
  printed escaped. Messages print names read from a directory through
  :func:`~refcheck.goldens.manifest.shown`.
* A writer's directory is checked by :func:`check_writable` before any work (callers run it before a
  long computation): it must exist, or be missing under an existing parent (it is then created); it
  must be a directory (not a file, a dangling link or a symbolic link loop), writable, and (before a
  long computation) on a file system with :data:`MIN_FREE_BYTES` free; else an
  :class:`~refcheck.errors.OutputPathError` (exit 2). :func:`commit` checks, under the lock, that
  the bytes it stages fit; a disk that fills up while staging is a :class:`~refcheck.errors.UsageError`
  with nothing changed.
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
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes, fsync_dir
from refcheck.errors import CorruptTraceError, GoldenError, GoldenLockError, OutputPathError, UsageError
from refcheck.goldens.manifest import CASE_NAME_RE as CASE_NAME_RE  # the store's rule for case names
from refcheck.goldens.manifest import (
    MANIFEST_NAME,
    MAX_CASE,
    SHA256_RE,
    Manifest,
    load_manifest,
    parse_manifest,
    plain_case_name,
    plain_name,
    sha256_bytes,
    sha256_file,
    shown,
)

JOURNAL_NAME = ".refcheck-golden.journal"
JOURNAL_VERSION = 2
STAGED_SUFFIX = ".staged"
PENDING_SUFFIX = ".pending"
CRASH_ENV = "REFCHECK_CRASH_AT"
CRASH_LOG_ENV = "REFCHECK_CRASH_LOG"
CRASH_EXIT = 86
LOCK_TIMEOUT_ENV = "REFCHECK_GOLDEN_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 60.0
#: the free space a writer's file system must have before any work (a golden is a few 100 KB)
MIN_FREE_BYTES = 1 << 20
_TXID_RE = re.compile(r"[0-9a-f]{12}")
_JOURNAL_KEYS = ("version", "txid", "renames", "manifest", "deletes", "sha256")
_POLL_S = 0.05


# ------------------------------------------------------------------------------ case names
def check_case_name(name: str) -> str:
    """``name`` if it is a plain case name (module docstring), else :class:`UsageError`."""
    if not plain_case_name(name):
        raise UsageError(f"case name {name!r} is not a plain name (letters, digits, '_', '-', '+' and single "
                         f"inner dots; no path separators, no '..', no leading dot; at most {MAX_CASE} characters)")
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
def _is_dir(path: Path, directory: Path) -> bool:
    """True for a directory at ``path``, False for nothing there; OutputPathError for anything else."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise OutputPathError(f"golden directory {directory}: {path} is a symbolic link to a missing directory; "
                                  "nothing was changed") from None
        return False
    except NotADirectoryError:
        bad = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), path.parent)
        raise OutputPathError(f"golden directory {directory}: {bad} is not a directory") from None
    except OSError as exc:
        what = "is a symbolic link loop" if exc.errno == errno.ELOOP else f"cannot be reached ({exc.strerror})"
        raise OutputPathError(f"golden directory {directory}: {path} {what}; nothing was changed") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"golden directory {directory}: {path} is not a directory")
    return True


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_writable(directory: Path, min_free: int = MIN_FREE_BYTES) -> None:
    """A writer's pre-flight (module docstring): OutputPathError unless the golden directory exists, or
    can be made in its existing parent, and is writable with ``min_free`` bytes free (the default before
    a long computation; ``commit`` checks the exact need itself, and ``clean`` frees space)."""
    directory = Path(directory)
    exists = _is_dir(directory, directory)
    probe = directory if exists else directory.parent
    if not exists and not _is_dir(probe, directory):
        raise OutputPathError(f"golden directory {directory} does not exist, nor does its parent {probe}; nothing "
                              "was changed")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputPathError(f"golden directory {directory} is not writable ({probe} is read-only); nothing was "
                              "changed")
    free = free_bytes(probe)
    if free < min_free:
        raise OutputPathError(f"golden directory {directory}: its file system is full ({free} bytes free, at least "
                              f"{min_free} needed); nothing was changed")


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
    sha256: dict[str, str] = field(default_factory=dict)  # staged name -> sha256 of its bytes

    def to_bytes(self) -> bytes:
        return json.dumps({"version": JOURNAL_VERSION, "txid": self.txid, "renames": self.renames,
                           "manifest": self.manifest, "deletes": self.deletes, "sha256": self.sha256}, indent=1).encode()


def staged_name(final: str, txid: str) -> str:
    """The staged file of transaction ``txid`` that becomes ``final``."""
    return f".{final}.{txid}{STAGED_SUFFIX}"


def _left_alone(path: Path, why: str) -> CorruptTraceError:
    return CorruptTraceError(f"golden journal {path} {why}; it was left alone (nothing was renamed or deleted): "
                             "inspect it and the files it names, then delete it by hand")


def _journal_from(obj: Any, path: Path) -> Journal:
    """The journal in ``obj`` if its fields have their shapes and its names follow from its txid."""
    if not isinstance(obj, dict) or sorted(obj) != sorted(_JOURNAL_KEYS) or obj["version"] != JOURNAL_VERSION:
        raise _left_alone(path, f"is malformed (not a version {JOURNAL_VERSION} journal of {', '.join(_JOURNAL_KEYS)})")
    txid, renames, digests = obj["txid"], obj["renames"], obj["sha256"]
    if not isinstance(txid, str) or not _TXID_RE.fullmatch(txid):
        raise _left_alone(path, f"is malformed (txid {shown(str(txid))})")
    if not isinstance(renames, list) or not all(isinstance(r, list) and len(r) == 2 for r in renames):
        raise _left_alone(path, "is malformed (renames: not a list of (staged, final) pairs)")
    for staged, final in renames:
        if not (isinstance(final, str) and final.endswith(".arrow") and plain_case_name(final[:-6])
                and staged == staged_name(final, txid)):
            raise _left_alone(path, f"renames {_quoted(staged)} onto {_quoted(final)}, not a staged trace of its "
                                    f"transaction onto a case's .arrow file")
    if len({final for _, final in renames}) != len(renames):
        raise _left_alone(path, "is malformed (renames name one final file twice)")
    if obj["manifest"] != staged_name(MANIFEST_NAME, txid):
        raise _left_alone(path, f"switches {MANIFEST_NAME} to {_quoted(obj['manifest'])}, not its own staged manifest")
    deletes = obj["deletes"]
    if not isinstance(deletes, list) or not all(plain_name(n) for n in deletes):
        raise _left_alone(path, "is malformed (deletes: not a list of plain file names)")
    staged = {obj["manifest"], *(s for s, _ in renames)}
    if (not isinstance(digests, dict) or set(digests) != staged
            or not all(isinstance(d, str) and SHA256_RE.fullmatch(d) for d in digests.values())):
        raise _left_alone(path, "is malformed (sha256: not one hex digest per staged file)")
    return Journal(txid, [(s, f) for s, f in renames], obj["manifest"], deletes, digests)


def _quoted(value: Any) -> str:
    return shown(value) if isinstance(value, str) else repr(value)


def read_journal(directory: Path) -> Journal | None:
    """The directory's journal (None if there is none), its shape checked (:func:`_journal_from`)."""
    path = Path(directory) / JOURNAL_NAME
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _left_alone(path, f"is unreadable ({exc})") from None
    return _journal_from(obj, path)


def _holder(directory: Path, staged: str, final: str, digest: str) -> Path | None:
    """Where a staged file's bytes are: the staged file while it exists, else its final name once
    renamed; None when that file is not a regular file holding ``digest``."""
    path = directory / staged
    if not os.path.lexists(path):
        path = directory / final
    try:
        ok = path.is_file() and not path.is_symlink() and sha256_file(path) == digest
    except OSError:
        ok = False
    return path if ok else None


def _checked_manifest(directory: Path, journal: Journal) -> Manifest:
    """The manifest the journal commits, its bytes matched against the journal's sha256."""
    path = directory / JOURNAL_NAME
    held = _holder(directory, journal.manifest, MANIFEST_NAME, journal.sha256[journal.manifest])
    if held is None:
        raise _left_alone(path, f"cannot be verified: neither {journal.manifest} nor {MANIFEST_NAME} holds the "
                                "manifest whose sha256 it records")
    try:
        return parse_manifest(held.read_bytes(), str(held))
    except (OSError, CorruptTraceError) as exc:
        raise _left_alone(path, f"cannot be verified: the manifest it commits is unreadable ({exc})") from None


def verify_journal(directory: Path, journal: Journal) -> None:
    """CorruptTraceError (the journal left alone) unless the journal is its transaction's (module docstring)."""
    path = directory / JOURNAL_NAME
    manifest = _checked_manifest(directory, journal)
    owned = {e.file: e.sha256 for e in manifest.cases.values()}
    for staged, final in journal.renames:
        digest = journal.sha256[staged]
        if _holder(directory, staged, final, digest) is None:
            raise _left_alone(path, f"cannot be verified: neither {staged} nor {final} holds the bytes whose sha256 "
                                    "it records")
        if owned.get(final) != digest:
            raise _left_alone(path, f"renames {staged} onto {final}, but the manifest it commits does not list "
                                    f"{final} with that sha256")
    removed = {r["entry"]["file"] for r in manifest.removed} - set(owned)
    pending = {final + PENDING_SUFFIX for _, final in journal.renames}
    for name in journal.deletes:
        if name not in removed | pending:
            raise _left_alone(path, f"deletes {shown(name)}, which is neither a case its manifest records as removed "
                                    f"nor a {PENDING_SUFFIX} file of a trace it writes")


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
    """Roll forward a transaction that passed its commit point (caller holds the lock), once its
    journal is verified (:func:`verify_journal`). True if there was one. A read-only directory with
    a pending journal is a :class:`GoldenError`."""
    directory = Path(directory)
    journal = read_journal(directory)
    if journal is None:
        return False
    verify_journal(directory, journal)
    if not os.access(directory, os.W_OK):
        raise GoldenError(f"{directory} holds an interrupted golden change ({JOURNAL_NAME}); run refcheck golden "
                          "verify with write access to complete it")
    _apply(directory, journal, hook or _CrashHook())
    return True


def recover_locked(directory: Path, timeout: float | None = None) -> bool:
    """:func:`recover` under the writer lock; a no-op (without locking) when there is no journal."""
    directory = Path(directory)
    if not os.path.lexists(directory / JOURNAL_NAME):
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
    """A trace to store as ``case`` (new or replacing), with its manifest summary and reason. With
    ``expect_base`` the write holds only while the case is as its caller saw it: live with sha256
    ``base``, or (``base`` None) not live; anything else is refused under the lock (module docstring)."""

    case: str
    data: bytes
    summary: dict[str, Any]
    reason: str | None = None
    expect_base: bool = False
    base: str | None = None


@dataclass(slots=True)
class Remove:
    case: str
    reason: str


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _stage(directory: Path, name: str, data: bytes, txid: str, hook: _CrashHook) -> str:
    """Write ``data`` durably to ``name``'s staged file; on any failure that file is gone again."""
    staged = staged_name(name, txid)
    f = open(directory / staged, "xb")
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        (directory / staged).unlink(missing_ok=True)
        raise
    hook.step(f"stage {staged}")
    return staged


def _check_base(manifest: Manifest, w: Write) -> None:
    now = manifest.cases.get(w.case)
    if not w.expect_base or (now.sha256 if now else None) == w.base:
        return
    if now is None:
        gone = [r for r in manifest.removed if r["case"] == w.case]
        why = f"was removed (reason: {shown(gone[-1]['reason'])})" if gone else "was removed"
    else:
        why = "was added" if w.base is None else "was replaced"
    raise GoldenError(f"golden case {w.case!r} {why} by another writer while this change was being prepared; nothing "
                      "was written (run the command again to review against the store as it is now)")


def _plan(manifest: Manifest, writes: list[Write], removes: list[Remove]) -> list[str]:
    """Apply the change set to ``manifest`` in memory; returns the files to delete afterwards."""
    deletes: list[str] = []
    for w in writes:
        _check_base(manifest, w)
        name = trace_file_name(w.case)
        manifest.record(w.case, name, sha256_bytes(w.data), len(w.data), w.summary, reason=w.reason)
        deletes.append(name + PENDING_SUFFIX)
    for r in removes:
        check_case_name(r.case)
        if r.case not in manifest.cases:
            raise GoldenError(f"no golden case {r.case!r} to remove (cases: {', '.join(sorted(manifest.cases)) or 'none'})")
        entry = manifest.cases.pop(r.case)
        manifest.removed.append({"case": r.case, "reason": r.reason, "time": _now(), "entry": entry.to_json()})
        deletes.append(entry.file)
    owned = {e.file for e in manifest.cases.values()}
    return [n for n in deletes if n not in owned]


def _check_space(directory: Path, need: int) -> None:
    free = free_bytes(directory)
    if free < need:
        raise OutputPathError(f"golden directory {directory}: the change needs {need} bytes, its file system has "
                              f"{free} free; nothing was changed")


def _drop_own_journal(directory: Path, txid: str) -> None:
    """Delete the journal if it is transaction ``txid``'s (a failure right after writing it)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if json.loads((directory / JOURNAL_NAME).read_text(encoding="utf-8"))["txid"] == txid:
            (directory / JOURNAL_NAME).unlink()


def _prepare(directory: Path, manifest: Manifest, writes: list[Write], deletes: list[str], hook: _CrashHook) -> Journal:
    """Steps 1 and 2 of the transaction (module docstring): staged files, then the journal. On any
    failure every file it created is deleted again, and an OSError becomes a UsageError."""
    txid = secrets.token_hex(6)
    staged: list[str] = []
    data = manifest.to_bytes()
    _check_space(directory, sum(len(w.data) for w in writes) + len(data))
    try:
        renames, digests = [], {}
        for w in writes:
            staged.append(_stage(directory, trace_file_name(w.case), w.data, txid, hook))
            renames.append((staged[-1], trace_file_name(w.case)))
            digests[staged[-1]] = sha256_bytes(w.data)
        staged.append(_stage(directory, MANIFEST_NAME, data, txid, hook))
        digests[staged[-1]] = sha256_bytes(data)
        fsync_dir(directory)
        journal = Journal(txid, renames, staged[-1], deletes, digests)
        atomic_write_bytes(directory / JOURNAL_NAME, journal.to_bytes())
    except BaseException as exc:
        _drop_own_journal(directory, txid)
        for name in staged:
            (directory / name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise UsageError(f"cannot write golden directory {directory}: {exc.strerror or exc}; nothing was "
                             "changed") from None
        raise
    return journal


def commit(directory: Path, writes: list[Write] = (), removes: list[Remove] = (),  # type: ignore[assignment]
           timeout: float | None = None) -> Manifest:
    """Apply ``writes`` and ``removes`` to the store as one transaction (module docstring); returns
    the new manifest. Nothing changes on an error raised before the commit point."""
    directory = Path(directory)
    writes, removes = list(writes), list(removes)
    for case in [w.case for w in writes] + [r.case for r in removes]:
        check_case_name(case)
    check_writable(directory, min_free=0)  # the space the change needs is checked under the lock
    directory.mkdir(exist_ok=True)
    hook = _CrashHook()
    with locked(directory, timeout):
        recover(directory, hook)
        manifest = load_manifest(directory, allow_missing=True)
        deletes = _plan(manifest, writes, removes)
        journal = _prepare(directory, manifest, writes, deletes, hook)
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
        out = [f"orphan trace {shown(n)} is not in {MANIFEST_NAME} (golden add it, or clean it with --clean-orphans)"
               for n in self.orphans]
        out += [f"leftover temporary file {shown(n)} from an interrupted write (clean it with --clean)"
                for n in self.temporary]
        out += [f"pending golden {shown(n)} awaits review (regen --accept, or clean it with --clean)" for n in self.pending]
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
    check_writable(directory, min_free=0)
    with locked(directory, timeout):
        recover(directory)
        left = leftovers(directory, load_manifest(directory))
        names = left.temporary + left.pending + (left.orphans if orphans else [])
        for name in names:
            (directory / name).unlink(missing_ok=True)
        fsync_dir(directory)
    return names
