"""The hash check of a golden directory against its ``MANIFEST.json``.

Contract: :func:`verify` reads the manifest under the store's reader lock (a change interrupted after its
commit point is completed first: :func:`refcheck.goldens.store.reading`) and checks every golden's sha256,
or ``case``'s alone (returning a manifest of that one entry). A manifest that lists no case, an unknown
``case`` or a missing file is a :class:`~refcheck.errors.GoldenError` (exit 3); a file that does not match
(changed bytes, a link, a directory, unreadable) is a :class:`~refcheck.errors.CorruptTraceError` (exit 4).
"""

from __future__ import annotations

from pathlib import Path

from refcheck.errors import CorruptTraceError, GoldenError
from refcheck.goldens import store
from refcheck.goldens.manifest import Manifest, load_manifest


def verify(golden_dir: Path, case: str | None = None) -> Manifest:
    """Hash check of every golden (or of ``case`` alone, as a manifest of that one entry): GoldenError for missing
    files, CorruptTraceError for mismatches. A golden change interrupted after its commit point is completed first
    (``store.recover``)."""
    with store.reading(Path(golden_dir)):
        manifest = load_manifest(Path(golden_dir))
        if case is not None:
            if case not in manifest.cases:
                raise GoldenError(f"no golden trace for case(s) {[case]} in {golden_dir}")
            manifest = Manifest(cases={case: manifest.cases[case]})
        problems = manifest.verify(Path(golden_dir))
    if not manifest.cases:
        raise GoldenError(f"{golden_dir}: the manifest lists no golden traces (run: refcheck golden regen --accept)")
    missing = [p for p in problems if p.endswith(" is missing")]
    if missing:
        raise GoldenError("missing golden trace(s): " + "; ".join(missing))
    if problems:
        raise CorruptTraceError("golden trace(s) do not match MANIFEST.json: " + "; ".join(problems))
    return manifest
