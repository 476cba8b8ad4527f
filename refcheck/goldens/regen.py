"""Regenerating the built-in goldens: re-run the reference for each case, review, then write.

Contract: :func:`regenerate` re-runs the reference for each built-in case (:mod:`refcheck.goldens.cases`)
and reviews it against the stored golden (:func:`refcheck.goldens.review.review`). Before any decoding it
refuses (:class:`~refcheck.errors.UsageError`, exit 2) a case named twice, an unknown case (one that holds
another engine's trace is named as such), a blank reason and a golden directory a writer cannot use
(:func:`refcheck.goldens.store.check_writable`). Without ``accept`` it writes ``<case>.arrow.pending``
beside each golden and the goldens stay untouched. With ``accept`` (and a reason, when a golden changes)
it replaces every case in one locked, crash-safe transaction of :mod:`refcheck.goldens.store` (all cases
or none), recording old -> new provenance and the reason; a case another writer replaced, added or
removed while it decoded is refused (:class:`~refcheck.errors.GoldenError`, nothing written).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from refcheck.errors import CorruptTraceError, UsageError
from refcheck.goldens import store
from refcheck.goldens.cases import GOLDEN_CASES
from refcheck.goldens.manifest import load_manifest, provenance_summary, shown
from refcheck.goldens.review import Review, review
from refcheck.progress import Progress, tell
from refcheck.prompts import load_prompts
from refcheck.trace.io import Trace, atomic_write_bytes, read_trace, trace_bytes

if TYPE_CHECKING:
    from refcheck.pool import ReferencePool

PENDING_SUFFIX = store.PENDING_SUFFIX


def _regen_names(golden_dir: Path, case_names: list[str] | None, reason: str | None) -> list[str]:
    """The cases to regenerate, refused up front (UsageError) when one is named twice, is not a built-in
    reference case, or the reason given is blank."""
    names = case_names or list(GOLDEN_CASES)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--case {shown(twice[0])} is given more than once; name each case once")
    if reason is not None and not reason.strip():
        raise UsageError("--reason is empty: say why the goldens change (recorded in MANIFEST.json)")
    unknown = [n for n in names if n not in GOLDEN_CASES]
    if unknown:
        stored = set(load_manifest(golden_dir, allow_missing=True).cases)
        engine = [n for n in unknown if n in stored]
        if engine:
            raise UsageError(f"golden case(s) {engine} hold another engine's trace (or one of your own model), which regen "
                             "cannot re-run: regen re-runs only the built-in reference cases. Record them again with "
                             "their engine (SGLang: scripts/sglang_suite.py on a GPU; your model: refcheck diff --engine "
                             "reference --model DIR --draft DIR --prompts FILE --save-trace TRACE) and replace them with "
                             "refcheck golden add TRACE --case NAME --reason ...")
        raise UsageError(f"unknown golden case(s) {unknown} (known: {', '.join(GOLDEN_CASES)})")
    return names


def _stored_golden(path: Path) -> tuple[Trace | None, bool]:
    """(the golden at ``path`` or None, whether a file is there at all)."""
    if not path.is_file():
        return None, False
    try:
        return read_trace(path), True
    except CorruptTraceError:
        return None, True


def _write_pending(path: Path, data: bytes) -> Path:
    pending = path.with_name(path.name + PENDING_SUFFIX)
    try:
        path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(pending, data)
    except OSError as exc:
        raise UsageError(f"cannot write {pending}: {exc.strerror or exc}; the goldens are unchanged") from None
    return pending


def regenerate(
    golden_dir: Path,
    case_names: list[str] | None,
    reason: str | None,
    accept: bool,
    pool: ReferencePool,
    progress: Progress | None = None,
) -> list[Review]:
    """Re-run the reference for each case and review it against the stored golden (module docstring).
    The cases, the reason and the golden directory are checked before any decoding; with ``accept`` each
    case is written only if no other writer changed or removed it since this regeneration read the store."""
    golden_dir = Path(golden_dir)
    names = _regen_names(golden_dir, case_names, reason)
    store.check_writable(golden_dir)  # before minutes of decoding, not after
    with store.reading(golden_dir):
        seen = load_manifest(golden_dir, allow_missing=True).cases
    prompts = load_prompts()
    reviews: list[Review] = []
    writes: list[store.Write] = []
    for name in names:
        tell(progress, f"regen: {name}")
        trace, _ = pool.runner(GOLDEN_CASES[name].spec()).trace(prompts)
        trace.provenance["case"] = name
        data = trace_bytes(trace)
        path = golden_dir / f"{name}.arrow"
        old, present = _stored_golden(path)
        rev = review(name, old, trace)
        if present and old is None:
            rev.status = "old unreadable"
        if accept:
            if old is not None and rev.status != "unchanged" and not reason:
                raise UsageError(f"golden {name} changes: give --reason for the record (nothing was written)")
            base = seen[name].sha256 if name in seen else None
            writes.append(store.Write(name, data, provenance_summary(trace.provenance), reason, expect_base=True,
                                      base=base))
            rev.written = str(path)
        else:
            rev.written = str(_write_pending(path, data))
        reviews.append(rev)
    if writes:
        store.commit(golden_dir, writes)  # every case or none, whatever instant the process dies
    return reviews
