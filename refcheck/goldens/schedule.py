"""How the gate spreads golden cases over its processes.

Contract: :func:`gate_jobs` groups the cases that share their free run's reference work
(:func:`shared_work_key`: same model, drafter, budget and output length) into one job, so one process
gates them together, and orders the jobs costliest first by :func:`estimated_cost` (a trace's size, twice
over for an engine in a coarser dtype than fp32). Scheduling only: no order changes a verdict.
"""

from __future__ import annotations

from refcheck.goldens.manifest import Manifest, ManifestEntry


def shared_work_key(entry: ManifestEntry) -> tuple[str, str, str, int]:
    """Cases with equal keys share their free run's reference work (the target-only greedy
    continuations and the reference's own DDTree runs): one process should gate them together."""
    p = entry.provenance
    drafter = "scripted" if p.get("drafter") == "none" else p.get("drafter", "dflash")
    return (str(p.get("model", "")), str(drafter), str(p.get("budget")), int(p.get("max_new_tokens", 64)))


def estimated_cost(entry: ManifestEntry) -> float:
    """A case's cost for scheduling only (longest first): its trace's size, twice over for an engine
    in a coarser dtype than fp32, whose over-bound steps run the rounding ensemble."""
    heavy = str(entry.provenance.get("dtype", "float32")) != "float32"
    return float(entry.bytes) * (2.0 if heavy else 1.0)


def gate_jobs(manifest: Manifest, names: list[str]) -> list[list[str]]:
    """The cases as jobs for the gate's processes: cases that share work in one job, the costliest
    job first."""
    groups: dict[tuple[str, str, str, int], list[str]] = {}
    for n in names:
        groups.setdefault(shared_work_key(manifest.cases[n]), []).append(n)
    return sorted(groups.values(), key=lambda g: -sum(estimated_cost(manifest.cases[n]) for n in g))
