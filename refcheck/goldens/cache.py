"""The gate's verdict on a golden case, cached under a key of everything the verdict depends on.

Contract: a case's report is a function of

* the golden's bytes (its sha256, which the gate has checked against ``MANIFEST.json`` first),
* its manifest entry (expectation, allowed unsupported categories, reviewed findings, triage rules),
* every file of the ``refcheck`` and ``reference`` packages (code, the built-in models, tokenizer
  and prompt set: :func:`source_digest`), and
* the numerical environment: Python, torch, transformers, numpy and pyarrow versions, torch's CPU
  capability and thread count (:func:`environment`).

:class:`ReportCache` stores a report as JSON under the sha256 of all four (:func:`case_key`), so any
change to the reference's code, the diff's code, a tolerance, a model, a prompt or the golden itself
gives a new key and the case is diffed again; nothing is ever invalidated by time or by hand. Only
cases on the built-in models are cached (a trace that names a model directory outside the package
depends on files the key does not cover). A cached report is exactly the stored one
(:func:`report_from_json` inverts :meth:`Report.to_json`). The cache is opt-in (``refcheck gate
--cache-dir DIR`` or ``REFCHECK_GATE_CACHE``); the library never uses one unless given. A directory that
cannot be written (a file, a read-only directory, under a file) is refused when the cache is opened,
before any case runs (:class:`~refcheck.errors.OutputPathError`, exit 2); a write that fails later (disk
full) is a warning: the verdict does not depend on the cache, and the case is diffed again next time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.goldens.manifest import ManifestEntry
from refcheck.outputs import check_output_dir
from refcheck.provenance import file_sha256

_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")
FORMAT = 1  # bump when the stored form changes
_log = logging.getLogger(__name__)


def package_roots() -> tuple[Path, ...]:
    """The directories of the imported ``refcheck`` and ``reference`` packages."""
    import ddtree_reference as reference
    import refcheck

    return (Path(refcheck.__file__).resolve().parent, Path(reference.__file__).resolve().parent)


def source_digest(roots: tuple[Path, ...] | None = None) -> str:
    """sha256 over every file under ``roots`` (default :func:`package_roots`): relative names and bytes."""
    h = hashlib.sha256()
    for root in roots or package_roots():
        root = Path(root)
        h.update(root.name.encode() + b"\0\0")
        for f in sorted(p for p in root.rglob("*") if p.is_file() and not _SKIP_DIRS & set(p.relative_to(root).parts)
                        and not p.name.endswith(_SKIP_SUFFIXES)):
            h.update(str(f.relative_to(root)).encode() + b"\0")
            h.update(file_sha256(f).digest())
    return h.hexdigest()


def environment() -> dict[str, Any]:
    """What, besides the code, can change the reference's numbers."""
    import numpy
    import pyarrow
    import torch
    import transformers

    return {"python": sys.version, "machine": platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__, "pyarrow": pyarrow.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def cacheable(entry: ManifestEntry) -> bool:
    """Only cases on the built-in models (everything they read is inside the packages)."""
    return str(entry.provenance.get("model", "")).startswith("builtin:")


def case_key(entry: ManifestEntry, digest: str, env: dict[str, Any]) -> str:
    """The key of a case's report: the golden's sha256, its manifest settings, the source digest and
    the environment."""
    blob = json.dumps({"format": FORMAT, "golden_sha256": entry.sha256, "settings": entry.provenance,
                       "source": digest, "environment": env}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def report_from_json(d: dict[str, Any]) -> Report:
    """The :class:`Report` whose ``to_json()`` is ``d``."""
    findings = [Finding(**{**f, "verdict": Verdict(f["verdict"])}) for f in d["findings"]]
    return Report(case=d["case"], mode=d["mode"], findings=findings, checks=Counter(d["checks"]), stats=d["stats"],
                  expect_failure=d["expect_failure"], expect_first=d.get("expect_first"))


class ReportCache:
    """Reports on disk, one JSON file per key, written atomically; the directory is checked on opening."""

    def __init__(self, directory: Path, roots: tuple[Path, ...] | None = None) -> None:
        self.dir = Path(directory)
        check_output_dir(self.dir, "--cache-dir")
        self.digest = source_digest(roots)
        self.env = environment()

    def key(self, entry: ManifestEntry) -> str | None:
        return case_key(entry, self.digest, self.env) if cacheable(entry) else None

    def get(self, entry: ManifestEntry) -> Report | None:
        key = self.key(entry)
        path = self.dir / f"{key}.json"
        if key is None or not path.is_file():
            return None
        try:
            return report_from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # an unreadable entry is a miss; the case is diffed again and the entry rewritten

    def put(self, entry: ManifestEntry, report: Report) -> None:
        key = self.key(entry)
        if key is None:
            return
        path = self.dir / f"{key}.json"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps(report.to_json(), default=str).encode())
        except OSError as exc:
            _log.warning(f"warning: could not store {report.case}'s report in the gate cache ({path}: "
                         f"{exc.strerror or exc}); the verdict is unaffected")

