"""Golden traces and the CI gate on them.

Contract: a golden directory holds one trace per case (``<case>.arrow``) and ``MANIFEST.json`` (sha256,
bytes, provenance summary with the gate's rules, history of replacements with reasons). One module per
noun:

* :mod:`~refcheck.goldens.cases`: the built-in reference cases and the repository's golden directory;
* :mod:`~refcheck.goldens.manifest`: the ``MANIFEST.json`` format, read and checked;
* :mod:`~refcheck.goldens.store`: the locked, crash-safe transactions every writer goes through;
* :mod:`~refcheck.goldens.verify`: the hash check of a directory against its manifest;
* :mod:`~refcheck.goldens.policy`: a manifest entry's gate rules, typed and applied to a report;
* :mod:`~refcheck.goldens.judge`: the one judgement of a golden (stale check, diff, policy);
* :mod:`~refcheck.goldens.gate`: every case judged, over one or more processes;
* :mod:`~refcheck.goldens.schedule`: which cases a gate process takes together, costliest first;
* :mod:`~refcheck.goldens.cache`: the gate's reports cached under a key of all they depend on;
* :mod:`~refcheck.goldens.regen`: the built-in cases re-run, reviewed, and written;
* :mod:`~refcheck.goldens.review` and :mod:`~refcheck.goldens.drift`: what a regeneration changed;
* :mod:`~refcheck.goldens.edits`: an engine's trace added as a case, a case removed.

The goldens stand on the trace format (:mod:`refcheck.trace`), the diff (:mod:`refcheck.diff`) and the
reference; neither the trace format nor the diff imports them (``tests/test_layers.py``). The names below
load on first use (PEP 562): importing the package alone loads no model or Arrow library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refcheck.lazy import lazy_exports

_EXPORTS = {
    "GOLDEN_CASES": "cases",
    "REPO_GOLDEN": "cases",
    "GoldenCase": "cases",
    "default_golden_dir": "cases",
    "MANIFEST_NAME": "manifest",
    "Manifest": "manifest",
    "ManifestEntry": "manifest",
    "load_manifest": "manifest",
    "shown": "manifest",
}


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from refcheck.goldens.cases import GOLDEN_CASES, REPO_GOLDEN, GoldenCase, default_golden_dir
    from refcheck.goldens.manifest import MANIFEST_NAME, Manifest, ManifestEntry, load_manifest, shown

__all__ = [
    "GOLDEN_CASES",
    "MANIFEST_NAME",
    "REPO_GOLDEN",
    "GoldenCase",
    "Manifest",
    "ManifestEntry",
    "default_golden_dir",
    "load_manifest",
    "shown",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
