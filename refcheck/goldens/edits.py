"""Adding an engine's trace as a golden case, and removing a case.

Contract: :func:`add_trace` stores an engine trace (SGLang, z-lab, your own model) as a golden case with its
gate settings (``expect``, ``allow_unsupported``, reviewed findings ``triaged``, ``expect_first``) in one
store transaction (:mod:`refcheck.goldens.store`); an existing case is replaced with a history entry. It
refuses (:class:`~refcheck.errors.UsageError`, exit 2) a blank reason, a case name that is not plain, the
name of a built-in reference case, settings of the wrong form or naming an unknown category, and a golden
directory a writer cannot use; a trace that would fail the gate the moment it lands (judged by
:func:`refcheck.goldens.judge.check_trace` under those settings) is a :class:`~refcheck.errors.GoldenError`
with its first failing findings. The bytes judged are the bytes stored. :func:`remove_case` moves a case's
entry to the manifest's ``removed`` list with its reason and deletes its file, in one transaction.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from refcheck.errors import GoldenError, UsageError
from refcheck.goldens import store
from refcheck.goldens.cases import GOLDEN_CASES
from refcheck.goldens.manifest import Manifest, load_manifest, provenance_summary
from refcheck.goldens.policy import parse_expect_first, parse_triage

if TYPE_CHECKING:  # the judge, torch and the trace format load where a trace is added: removing a case needs none
    from refcheck.pool import ReferencePool


def _need_reason(command: str, reason: str | None) -> None:
    if not reason or not reason.strip():
        raise UsageError(f"golden {command} needs --reason (recorded in MANIFEST.json)")


def _settings(case: str, expect: str, allow_unsupported: list[str], triage: list[str] | None,
              expect_first: str | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The gate settings of ``golden add``, checked: (triaged findings, expect_first); UsageError when one is
    malformed, names an unknown category, or ``case`` is a built-in reference case."""
    from refcheck.diff.findings import check_category

    if expect != "pass" and not expect.startswith("fail"):
        raise UsageError(f"--expect must be 'pass', 'fail' or 'fail:CATEGORY', got {expect!r}")
    if expect.startswith("fail:"):
        check_category(expect.split(":", 1)[1], f"--expect {expect}")
    for cat in allow_unsupported:
        check_category(cat, "--allow-unsupported")
    triaged = parse_triage(triage or [])
    first = parse_expect_first(expect_first)
    if first is not None and expect == "pass":
        raise UsageError("--expect-first is where an expected failure must first show: it needs --expect fail[:CATEGORY]")
    if case in GOLDEN_CASES:
        raise UsageError(f"{case!r} is a built-in reference case; choose another name")
    return triaged, first


def _read_bytes(trace_path: Path) -> bytes:
    """The trace file's bytes; the trace reader's typed error for a missing or unreadable file."""
    from refcheck.trace.io import read_trace

    try:
        return Path(trace_path).read_bytes()
    except OSError:
        read_trace(Path(trace_path))  # raises the typed error for a missing or unreadable trace
        raise


def add_trace(golden_dir: Path, trace_path: Path, case: str, expect: str, allow_unsupported: list[str],
              reason: str, triage: list[str] | None = None, pool: ReferencePool | None = None,
              expect_first: str | None = None) -> Path:
    """Store an engine trace as a golden case (atomic; an existing case is replaced only with history).
    ``triage``: findings a person reviewed (REQUEST:STEP:NODE:CATEGORY), reported as TRIAGED by the gate.
    The trace is first put through the gate's own check with these settings: a trace that would fail
    the gate the moment it lands (``--expect pass`` with failures, an expected failure not caught, or
    stale models) is refused with the first failing findings, and nothing is written."""
    from refcheck.diff.place import where
    from refcheck.goldens.judge import check_trace
    from refcheck.pool import ReferencePool
    from refcheck.trace.io import trace_from_bytes

    _need_reason("add", reason)
    store.check_case_name(case)
    triaged, first = _settings(case, expect, allow_unsupported, triage, expect_first)
    store.check_writable(Path(golden_dir))
    with store.reading(Path(golden_dir)):
        load_manifest(Path(golden_dir), allow_missing=True)  # a broken store is refused before the gate's check
    data = _read_bytes(trace_path)  # the bytes checked are the bytes stored
    trace = trace_from_bytes(data, str(trace_path))
    summary = {**provenance_summary(trace.provenance), "expect": expect, "allow_unsupported": allow_unsupported,
               "triaged": triaged, **({"expect_first": first} if first else {})}
    report = check_trace(case, trace, summary, pool or ReferencePool())
    if report.verdict not in ("pass", "expected failure caught"):
        fails = [f for f in report.failures][:3]
        raise GoldenError(
            f"{trace_path} would fail the gate as {case!r} ({report.verdict}: {report.counts.get('fail', 0)} failing "
            f"checks; first: " + "; ".join(f"{where(f)}: {f.message[:120]}"
                                          for f in fails)
            + "). Review them, then add --triage REQUEST:STEP:NODE:CATEGORY for reviewed findings, "
              "--allow-unsupported CATEGORY for what the engine cannot record, or --expect fail:CATEGORY for a "
              "known-buggy engine; nothing was written")
    store.commit(Path(golden_dir), [store.Write(case, data, summary, reason)])
    return Path(golden_dir) / store.trace_file_name(case)


def remove_case(golden_dir: Path, case: str, reason: str) -> Manifest:
    """Remove a golden case (its entry moves to the manifest's ``removed`` list with the reason;
    its file is deleted), in one store transaction."""
    _need_reason("remove", reason)
    return store.commit(Path(golden_dir), removes=[store.Remove(store.check_case_name(case), reason)])
