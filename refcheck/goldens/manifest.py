"""The sha256 manifest of a golden directory: ``MANIFEST.json`` beside its traces.

Contract: the file is
``{"version": 1, "cases": {case: {"file", "sha256", "bytes", "provenance", "history": [...]}}}``
where ``file`` is a plain file name inside the directory (no two cases share one), ``sha256`` the
64-digit lowercase hex digest of its bytes, ``bytes`` their count, ``provenance`` a JSON subset of the trace's provenance
(:func:`provenance_summary`; its keys are open: the one extension field; the gate's policy keys in it must have
the shapes :func:`refcheck.goldens.policy.policy_problem` checks), and ``history`` one entry
``{"sha256_old", "sha256_new", "reason", "time", "provenance_old", "provenance_new"}`` per hash
change, oldest first; an optional top-level ``"removed": [{"case", "reason", "time", "entry"}]``
keeps the entries of removed cases (``refcheck golden remove``). Case names are plain case names
(:data:`CASE_NAME_RE`). Any other key, at the top, in a case, a history or a removed entry, is
refused: a later write would drop it. Traces of schema 1.1 carry their own checksums too
(docs/trace-format.md); the manifest's sha256 also covers legacy 1.0 files. Writes go through
:mod:`refcheck.goldens.store` (locked, crash-safe transactions).

* :func:`load_manifest`: missing file -> empty manifest with ``allow_missing=True``, else
  :class:`~refcheck.errors.GoldenError`; a ``MANIFEST.json`` that is a directory, a golden directory
  that is a symbolic link loop, unreadable or malformed JSON, a wrong structure or value (one line
  naming the file, the case and the key) -> :class:`~refcheck.errors.CorruptTraceError`; a newer
  manifest version -> :class:`~refcheck.errors.SchemaVersionError`. :func:`parse_manifest`
  checks bytes the same way.
* :meth:`Manifest.save` writes atomically (as :func:`~refcheck.trace.io.write_trace`).
* :meth:`Manifest.verify` never raises for a bad directory: it returns one message per problem
  (file missing, its message ending in "is missing"; a symbolic link; a directory; unreadable; hash
  mismatch), empty when all is well.
* :meth:`Manifest.record` sets a case and appends a history entry when its hash changes.
* :func:`golden_entry_for` finds the entry of a trace file in the manifest beside it (None when there is
  none, or the manifest cannot be read).
* :func:`shown` is how messages print a name read from a manifest or a directory: as is when
  printable, else escaped (``repr``), so a name never starts a line of its own.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes
from refcheck.errors import CorruptTraceError, GoldenError, RefcheckError, SchemaVersionError, UsageError
from refcheck.goldens.policy import policy_problem

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1
#: a plain case name: letters, digits, ``_``, ``-``, ``+`` and single inner dots (no separator, no
#: ``..``, no leading dot, no control character), at most :data:`MAX_CASE` characters
CASE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]*(?:\.[A-Za-z0-9_+-]+)*")
MAX_CASE = 100
SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_TOP_KEYS = ("version", "cases", "removed")
_ENTRY_KEYS = ("file", "sha256", "bytes", "provenance", "history")
_HISTORY_KEYS = ("sha256_old", "sha256_new", "reason", "time", "provenance_old", "provenance_new")
_REMOVED_KEYS = ("case", "reason", "time", "entry")


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plain_name(name: Any) -> bool:
    """A file name inside the directory: no separators, not '.', '..' or empty, no control character."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\\" in name or not name.isprintable():
        return False
    return Path(name).name == name


_plain_name = plain_name


def plain_case_name(name: Any) -> bool:
    """A case name as :data:`CASE_NAME_RE` defines it."""
    return isinstance(name, str) and len(name) <= MAX_CASE and CASE_NAME_RE.fullmatch(name) is not None


def shown(name: str) -> str:
    """``name`` for a message: as is when every character prints, else escaped as Python's ``repr``."""
    return name if isinstance(name, str) and name.isprintable() else repr(name)


@dataclass(slots=True)
class HistoryEntry:
    sha256_old: str
    sha256_new: str
    reason: str | None
    time: str  # UTC, ISO 8601
    provenance_old: dict[str, Any]
    provenance_new: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ManifestEntry:
    file: str  # a plain file name inside the manifest's directory
    sha256: str  # hex
    bytes: int
    provenance: dict[str, Any]
    history: list[HistoryEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # fields in declaration order; history entries become dicts too


@dataclass(slots=True)
class Manifest:
    cases: dict[str, ManifestEntry] = field(default_factory=dict)
    version: int = MANIFEST_VERSION
    removed: list[dict[str, Any]] = field(default_factory=list)  # entries of removed cases, with reasons

    def record(
        self,
        case: str,
        file: str,
        sha256: str,
        bytes: int,  # noqa: A002 - the manifest's key name
        provenance: dict[str, Any],
        reason: str | None = None,
        previous: ManifestEntry | None = None,
    ) -> ManifestEntry:
        """Set ``case`` to the given file and hash. ``previous`` is the entry being replaced
        (default: the case's current entry); when its hash differs from ``sha256``, or its recorded
        settings from ``provenance`` (a golden's expectation or triage changed), a history entry is
        appended to its history, which the new entry carries on."""
        if not plain_case_name(case):
            raise UsageError(f"manifest case name must be a plain name, got {case!r}")
        if not _plain_name(file):
            raise UsageError(f"manifest file must be a plain file name in the directory, got {file!r}")
        if not isinstance(provenance, dict):
            raise UsageError(f"manifest provenance must be a dict, got {type(provenance).__name__}")
        old = previous if previous is not None else self.cases.get(case)
        history = list(old.history) if old is not None else []
        if old is not None and (old.sha256 != sha256 or old.provenance != provenance):  # new bytes or new gate settings
            history.append(
                HistoryEntry(
                    sha256_old=old.sha256,
                    sha256_new=sha256,
                    reason=reason,
                    time=_now(),
                    provenance_old=old.provenance,
                    provenance_new=provenance,
                )
            )
        entry = ManifestEntry(file=file, sha256=sha256, bytes=bytes, provenance=provenance, history=history)
        self.cases[case] = entry
        return entry

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "cases": {case: self.cases[case].to_json() for case in sorted(self.cases)},
        }
        if self.removed:
            out["removed"] = self.removed
        return out

    def to_bytes(self) -> bytes:
        """The ``MANIFEST.json`` bytes."""
        return (json.dumps(self.to_json(), indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")

    def save(self, directory: Path) -> Path:
        """Write ``directory/MANIFEST.json`` atomically (no lock, no transaction: the golden store,
        :mod:`refcheck.goldens.store`, is the writer for golden directories); returns its path."""
        path = Path(directory) / MANIFEST_NAME
        atomic_write_bytes(path, self.to_bytes())
        return path

    def verify(self, directory: Path) -> list[str]:
        """One message per problem (missing, a link, a directory, unreadable or changed file); [] when all match."""
        problems: list[str] = []
        for case in sorted(self.cases):
            entry = self.cases[case]
            path = Path(directory) / entry.file
            name = f"{shown(case)}: {shown(entry.file)}"
            if path.is_symlink():
                problems.append(f"{name} is a symbolic link (a golden must be a regular file in the directory)")
                continue
            if path.is_dir():
                problems.append(f"{name} is a directory, not a trace file")
                continue
            if not path.is_file():
                problems.append(f"{name} is missing")
                continue
            try:
                digest = sha256_file(path)
            except OSError as exc:
                problems.append(f"{name} is unreadable: {exc.strerror or exc}")
                continue
            if digest != entry.sha256:
                problems.append(f"{name} sha256 mismatch (manifest {entry.sha256[:12]}, file {digest[:12]})")
        return problems


# ------------------------------------------------------------------------------ loading
def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _keys(obj: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(k for k in obj if k not in known)
    if unknown:
        raise CorruptTraceError(f"{where}: unknown key {_brief(unknown[0])} (known: {', '.join(known)}); refcheck "
                                "would drop it on the next write, so it refuses the manifest")


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise CorruptTraceError(f"{where} lacks {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CorruptTraceError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _digest(obj: dict[str, Any], key: str, where: str) -> str:
    value: str = _need(obj, key, str, where)
    if not SHA256_RE.fullmatch(value):
        raise CorruptTraceError(f"{where}: {key!r} is {_brief(value)}, not a hex sha256 (64 lowercase hex digits)")
    return value


def _history_from(obj: Any, where: str) -> HistoryEntry:
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{where} is not an object")
    _keys(obj, _HISTORY_KEYS, where)
    return HistoryEntry(
        sha256_old=_digest(obj, "sha256_old", where),
        sha256_new=_digest(obj, "sha256_new", where),
        reason=_need(obj, "reason", (str, type(None)), where),
        time=_need(obj, "time", str, where),
        provenance_old=_need(obj, "provenance_old", dict, where),
        provenance_new=_need(obj, "provenance_new", dict, where),
    )


def _entry_from(obj: Any, where: str) -> ManifestEntry:
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{where} is not an object")
    _keys(obj, _ENTRY_KEYS, where)
    file = _need(obj, "file", str, where)
    if not _plain_name(file):
        raise CorruptTraceError(f"{where}: file {file!r} is not a plain file name")
    size = _need(obj, "bytes", int, where)
    if size < 0:
        raise CorruptTraceError(f"{where}: 'bytes' is {size}, not a size (a count of bytes, 0 or more)")
    provenance = _need(obj, "provenance", dict, where)
    problem = policy_problem(provenance)
    if problem:
        raise CorruptTraceError(f"{where}: provenance {problem}")
    history = _need(obj, "history", list, where)
    return ManifestEntry(
        file=file,
        sha256=_digest(obj, "sha256", where),
        bytes=size,
        provenance=provenance,
        history=[_history_from(h, f"{where} history[{i}]") for i, h in enumerate(history)],
    )


def _removed_from(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{where} is not an object")
    _keys(obj, _REMOVED_KEYS, where)
    if not plain_case_name(_need(obj, "case", str, where)):
        raise CorruptTraceError(f"{where}: case name {obj['case']!r} is not a plain name")
    _need(obj, "reason", str, where)
    _need(obj, "time", str, where)
    _entry_from(_need(obj, "entry", dict, where), f"{where} entry")
    return obj


def _cases_from(cases: dict[str, Any], where: str) -> dict[str, ManifestEntry]:
    out: dict[str, ManifestEntry] = {}
    owner: dict[str, str] = {}
    for case, obj in cases.items():
        if not plain_case_name(case):
            raise CorruptTraceError(f"{where}: case name {case!r} is not a plain name")
        entry = out[case] = _entry_from(obj, f"{where} case {case!r}")
        if entry.file in owner:
            raise CorruptTraceError(f"{where}: cases {owner[entry.file]!r} and {case!r} both name file {entry.file!r}")
        owner[entry.file] = case
    return out


def parse_manifest(data: bytes, where: str) -> Manifest:
    """The manifest in ``data`` (the bytes of a ``MANIFEST.json``, named ``where`` in errors), checked
    as the module docstring says."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CorruptTraceError(f"cannot read {where}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CorruptTraceError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{where} is not a JSON object")
    version = _need(obj, "version", int, where)
    if version > MANIFEST_VERSION:
        raise SchemaVersionError(f"{where}: manifest version {version} is newer than this refcheck supports ({MANIFEST_VERSION})")
    if version < 1:
        raise CorruptTraceError(f"{where}: 'version' is {version}, not a manifest version (1 to {MANIFEST_VERSION})")
    _keys(obj, _TOP_KEYS, where)
    cases = _cases_from(_need(obj, "cases", dict, where), where)
    removed = obj.get("removed", [])
    if not isinstance(removed, list):
        raise CorruptTraceError(f"{where}: 'removed' is not a list of objects")
    return Manifest(
        cases=cases,
        version=MANIFEST_VERSION,
        removed=[_removed_from(r, f"{where} removed[{i}]") for i, r in enumerate(removed)],
    )


def _loops(path: Path) -> bool:
    try:
        path.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def load_manifest(directory: Path, allow_missing: bool = False) -> Manifest:
    """Read ``directory/MANIFEST.json``; see the module docstring for the errors."""
    path = Path(directory) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if path.is_symlink():
            raise CorruptTraceError(f"{path} is a symbolic link to a missing file") from None
        if allow_missing:
            return Manifest()
        raise GoldenError(f"no {MANIFEST_NAME} in {directory}") from None
    except IsADirectoryError:
        raise CorruptTraceError(f"{path} is a directory, not a manifest file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            what = f"the golden directory {directory}" if _loops(Path(directory)) else str(path)
            raise CorruptTraceError(f"cannot read {path}: {what} is a symbolic link loop") from None
        raise CorruptTraceError(f"cannot read {path}: {exc}") from None
    return parse_manifest(data, str(path))


#: the provenance keys a manifest entry keeps (enough to review a replacement), with the gate's policy keys
SUMMARY_KEYS = ("engine", "model", "model_sha256", "draft_sha256", "tokenizer_sha256", "dtype", "device", "budget",
                "block_size", "max_new_tokens", "drafter", "prompt_set_sha256", "versions", "created", "case", "expect",
                "allow_unsupported", "triaged", "triage_rules", "expect_first")


def provenance_summary(prov: dict[str, Any]) -> dict[str, Any]:
    """The part of a trace's provenance kept in its manifest entry (:data:`SUMMARY_KEYS`, in that order)."""
    return {k: prov[k] for k in SUMMARY_KEYS if k in prov}


def golden_entry_for(path: Path) -> tuple[str, ManifestEntry] | None:
    """(case name, manifest entry) when ``path`` is a golden listed in the MANIFEST.json beside it, else None."""
    path = Path(path)
    if not (path.parent / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = load_manifest(path.parent)
    except (RefcheckError, OSError):
        return None  # a broken manifest beside a trace says nothing about this diff
    for name, entry in manifest.cases.items():
        if entry.file == path.name:
            return name, entry
    return None
