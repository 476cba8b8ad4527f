"""The review of one regenerated golden against the stored one.

Contract: :func:`review` compares a case's new trace with its stored golden (None: a new golden) and
returns a :class:`Review`: its status ("new"; "unchanged": same tokens, acceptance, numbers and library
versions; "drifted": same tokens and acceptance, other numbers or recorded library versions, so the
bytes change; "changed": tokens, acceptance or the stale-making provenance differ), the provenance
that changed (:func:`refcheck.provenance.stale_reasons`), the first divergent output index per request,
the mean acceptance length τ old and new, the library version changes and the numeric drift
(:mod:`refcheck.goldens.drift`). The caller sets ``written`` (where the new trace went) and the status
"old unreadable" (a stored file that does not decode). Nothing here reads or writes a file.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from refcheck.goldens.drift import Drift, numeric_drift, version_changes
from refcheck.provenance import stale_reasons
from refcheck.trace.io import Trace


@dataclass(slots=True)
class Review:
    """One case's regeneration against its stored golden. ``status``: "new"; "unchanged" (same tokens,
    acceptance, numbers and library versions); "drifted" (same tokens and acceptance, but numbers or
    recorded library versions differ: the bytes change); "changed" (tokens, acceptance or the stale-
    making provenance differ); "old unreadable"."""

    case: str
    status: str
    provenance_changes: list[str] = field(default_factory=list)
    first_divergence: dict[str, int] = field(default_factory=dict)  # request -> first differing output index
    tau_old: float | None = None
    tau_new: float | None = None
    written: str = ""
    version_changes: list[str] = field(default_factory=list)  # "transformers 5.23.0 → 5.24.0"
    drift: Drift | None = None  # numbers where old and new describe the same step

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "status": self.status, "provenance_changes": self.provenance_changes,
                "first_divergence": self.first_divergence, "tau_old": self.tau_old, "tau_new": self.tau_new,
                "written": self.written, "version_changes": self.version_changes,
                "numeric_drift": self.drift.to_json() if self.drift else None}


def _mean_tau(trace: Trace) -> float | None:
    taus = [s.accept_length for s in trace.steps]
    return statistics.fmean(taus) if taus else None


def _first_divergences(old: Trace, new: Trace) -> dict[str, int]:
    """Request -> the first output index where ``new`` differs from ``old`` (0 for a request ``old`` lacks)."""
    out: dict[str, int] = {}
    old_out = {r.request_id: r.output_ids for r in old.requests}
    for r in new.requests:
        prev = old_out.get(r.request_id)
        if prev is None:
            out[r.request_id] = 0
            continue
        i = next((j for j, (a, b) in enumerate(zip(prev, r.output_ids)) if a != b), None)
        if i is None and len(prev) != len(r.output_ids):
            i = min(len(prev), len(r.output_ids))
        if i is not None:
            out[r.request_id] = i
    return out


def review(case: str, old: Trace | None, new: Trace) -> Review:
    """``new`` against the stored ``old`` (None: a new golden), as the module docstring says."""
    rev = Review(case, "new", tau_new=_mean_tau(new))
    if old is None:
        return rev
    rev.tau_old = _mean_tau(old)
    rev.provenance_changes = stale_reasons(old.provenance, new.provenance)
    rev.first_divergence = _first_divergences(old, new)
    old_steps = [(s.request_id, s.step, s.accept_length, s.accepted) for s in old.steps]
    new_steps = [(s.request_id, s.step, s.accept_length, s.accepted) for s in new.steps]
    rev.version_changes = version_changes(old.provenance, new.provenance)
    rev.drift = numeric_drift(old, new)
    same = not rev.first_divergence and old_steps == new_steps and not rev.provenance_changes
    rev.status = "changed" if not same else ("drifted" if rev.version_changes or rev.drift.any else "unchanged")
    return rev
