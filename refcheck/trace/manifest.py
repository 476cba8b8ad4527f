"""The sha256 manifest kept beside stored traces: ``MANIFEST.json`` in a directory.

Contract: the file is
``{"version": 1, "cases": {case: {"file", "sha256", "bytes", "provenance", "history": [...]}}}``
where ``file`` is a plain file name inside the directory, ``sha256`` the hex digest of its bytes,
``provenance`` a JSON subset of the trace's provenance, and ``history`` one entry
``{"sha256_old", "sha256_new", "reason", "time", "provenance_old", "provenance_new"}`` per hash
change, oldest first; an optional top-level ``"removed": [{"case", "reason", "time", "entry"}]``
keeps the entries of removed cases (``refcheck golden remove``). Traces of schema 1.1 carry their
own checksums too (docs/trace-format.md); the manifest's sha256 also covers legacy 1.0 files.
Writes go through :mod:`refcheck.trace.store` (locked, crash-safe transactions).

* :func:`load_manifest`: missing file -> empty manifest with ``allow_missing=True``, else
  :class:`~refcheck.errors.GoldenError`; unreadable or malformed JSON, or a wrong structure ->
  :class:`~refcheck.errors.CorruptTraceError`; a newer manifest version ->
  :class:`~refcheck.trace.schema.SchemaVersionError`.
* :meth:`Manifest.save` writes atomically (as :func:`~refcheck.trace.io.write_trace`).
* :meth:`Manifest.verify` never raises for a bad directory: it returns one message per problem
  (file missing, unreadable, or hash mismatch), empty when all is well.
* :meth:`Manifest.record` sets a case and appends a history entry when its hash changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes
from refcheck.errors import CorruptTraceError, GoldenError, UsageError
from refcheck.trace.schema import SchemaVersionError

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20


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
    """A file name inside the directory: no separators, not '.', '..' or empty."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\\" in name or "\0" in name:
        return False
    return Path(name).name == name


_plain_name = plain_name


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
        if not isinstance(case, str) or not case or not plain_name(case) or case.startswith("."):
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
        :mod:`refcheck.trace.store`, is the writer for golden directories); returns its path."""
        path = Path(directory) / MANIFEST_NAME
        atomic_write_bytes(path, self.to_bytes())
        return path

    def verify(self, directory: Path) -> list[str]:
        """One message per problem (missing, unreadable or changed file); [] when all match."""
        problems: list[str] = []
        for case in sorted(self.cases):
            entry = self.cases[case]
            path = Path(directory) / entry.file
            if path.is_symlink():
                problems.append(f"{case}: {entry.file} is a symbolic link (a golden must be a regular file in the directory)")
                continue
            if not path.is_file():
                problems.append(f"{case}: {entry.file} is missing")
                continue
            try:
                digest = sha256_file(path)
            except OSError as exc:
                problems.append(f"{case}: {entry.file} is unreadable: {exc.strerror or exc}")
                continue
            if digest != entry.sha256:
                problems.append(
                    f"{case}: {entry.file} sha256 mismatch (manifest {entry.sha256[:12]}, file {digest[:12]})"
                )
        return problems


# ------------------------------------------------------------------------------ loading
def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise CorruptTraceError(f"{where} lacks {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CorruptTraceError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _history_from(obj: Any, where: str) -> HistoryEntry:
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{where} is not an object")
    return HistoryEntry(
        sha256_old=_need(obj, "sha256_old", str, where),
        sha256_new=_need(obj, "sha256_new", str, where),
        reason=_need(obj, "reason", (str, type(None)), where),
        time=_need(obj, "time", str, where),
        provenance_old=_need(obj, "provenance_old", dict, where),
        provenance_new=_need(obj, "provenance_new", dict, where),
    )


def _entry_from(obj: Any, where: str) -> ManifestEntry:
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{where} is not an object")
    file = _need(obj, "file", str, where)
    if not _plain_name(file):
        raise CorruptTraceError(f"{where}: file {file!r} is not a plain file name")
    history = _need(obj, "history", list, where)
    return ManifestEntry(
        file=file,
        sha256=_need(obj, "sha256", str, where),
        bytes=_need(obj, "bytes", int, where),
        provenance=_need(obj, "provenance", dict, where),
        history=[_history_from(h, f"{where} history[{i}]") for i, h in enumerate(history)],
    )


def load_manifest(directory: Path, allow_missing: bool = False) -> Manifest:
    """Read ``directory/MANIFEST.json``; see the module docstring for the errors."""
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if allow_missing:
            return Manifest()
        raise GoldenError(f"no {MANIFEST_NAME} in {directory}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptTraceError(f"cannot read {path}: {exc}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptTraceError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{path} is not a JSON object")
    version = _need(obj, "version", int, str(path))
    if version > MANIFEST_VERSION:
        raise SchemaVersionError(
            f"{path}: manifest version {version} is newer than this refcheck supports ({MANIFEST_VERSION})"
        )
    cases = _need(obj, "cases", dict, str(path))
    bad = [c for c in cases if not plain_name(c) or c.startswith(".")]
    if bad:
        raise CorruptTraceError(f"{path}: case name {bad[0]!r} is not a plain name")
    removed = obj.get("removed", [])
    if not isinstance(removed, list) or not all(isinstance(r, dict) for r in removed):
        raise CorruptTraceError(f"{path}: 'removed' is not a list of objects")
    return Manifest(
        cases={case: _entry_from(e, f"{path} case {case!r}") for case, e in cases.items()},
        version=MANIFEST_VERSION,
        removed=removed,
    )
