"""The gate's judgement of one golden: stale check, diff, policy.

Contract: :func:`check_trace` is the one judgement of a golden trace under its manifest entry's settings:
a :class:`~refcheck.errors.GoldenError` when the models or prompts it names changed since it was recorded
(:func:`live_provenance_reasons`: a built-in case against the live reference's provenance, an engine
trace against its model and draft directories' hashes), else the diff against the live reference
(strict acceptance for a reference trace) with the entry's :class:`~refcheck.goldens.policy.GatePolicy`
applied. ``refcheck gate``, ``refcheck diff`` on the goldens, ``golden add`` and the pytest plugin all
judge through it, so they cannot disagree. :func:`gate_case` reads a case's golden file and judges it;
:func:`entry_rules` says in words what an entry makes the gate apply beyond a plain diff.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refcheck.diff.findings import Report
from refcheck.diff.judge import judge
from refcheck.errors import GoldenError
from refcheck.goldens.cases import GOLDEN_CASES
from refcheck.goldens.manifest import ManifestEntry
from refcheck.goldens.policy import GatePolicy, describe_expect
from refcheck.pool import ReferencePool, reference_spec_for
from refcheck.profile import phase
from refcheck.prompts import load_prompts
from refcheck.provenance import dir_sha256, stale_reasons
from refcheck.trace.io import Trace, read_trace


def live_provenance_reasons(trace: Trace, pool: ReferencePool) -> list[str]:
    """Why a stored trace does not match the current models and prompts it names (empty = fresh)."""
    prov = trace.prov
    case = GOLDEN_CASES.get(prov.case or "")
    if prov.is_reference and case is not None:
        live = pool.runner(case.spec()).provenance(load_prompts())
        return stale_reasons(trace.provenance, live)
    reasons: list[str] = []
    tdir, ddir = reference_spec_for(trace).resolved_dirs()
    if prov.model_sha256 and dir_sha256(tdir) != prov.model_sha256:
        reasons.append(f"model_sha256: {prov.model} changed since the trace was recorded")
    if prov.draft_sha256 and ddir is not None and dir_sha256(ddir) != prov.draft_sha256:
        reasons.append("draft_sha256: the draft checkpoint changed since the trace was recorded")
    return reasons


def _stale_message(name: str, stale: list[str]) -> str:
    how = (f" (review and regenerate: refcheck golden regen --case {name} --reason ...)" if name in GOLDEN_CASES
           else f" (an engine trace: record it again with its engine, e.g. SGLang's with "
                f"scripts/sglang_suite.py on a GPU, then replace it: refcheck golden add TRACE --case {name} "
                f"--reason ...; the manifest keeps the old entry in its history)")
    return f"stale golden {name}: " + "; ".join(stale) + how


def check_trace(name: str, trace: Trace, settings: dict[str, Any], pool: ReferencePool, mode: str = "both",
                ref_dtype: str = "float32", ref_device: str = "cpu") -> Report:
    """The gate's verdict on one engine trace under a golden entry's settings (``expect``,
    ``allow_unsupported``, ``triaged``): a GoldenError if the trace's models or prompts have changed
    since it was recorded, else the diff with unrecorded categories failed and reviewed findings triaged.
    The one judgement of a golden: the gate and ``refcheck diff`` (on the goldens) both call it."""
    with phase("stale_check"):
        stale = live_provenance_reasons(trace, pool)
    if stale:
        raise GoldenError(_stale_message(name, stale))
    policy = GatePolicy.of(name, settings)
    report = judge(trace, pool, name, mode=mode, strict_acceptance=trace.prov.is_reference, ref_dtype=ref_dtype,
                   ref_device=ref_device)
    return policy.apply(report)


def gate_case(name: str, entry: ManifestEntry, golden_dir: Path, pool: ReferencePool) -> Report:
    """:func:`check_trace` of the golden file of ``entry`` in ``golden_dir`` under its settings."""
    with phase("load_trace"):
        trace = read_trace(Path(golden_dir) / entry.file)
    return check_trace(name, trace, entry.provenance, pool)


def entry_rules(entry: ManifestEntry) -> list[str]:
    """Everything a golden's manifest entry tells the gate, in words (for ``refcheck diff --against``
    a golden file: what the gate will apply that a plain diff does not)."""
    s = entry.provenance
    rules = [describe_expect(s.get("expect", "pass"), s.get("expect_first")) if s.get("expect", "pass") != "pass"
             else "expect pass: any failure fails the case"]
    if s.get("allow_unsupported"):
        rules.append("allow_unsupported " + ",".join(s["allow_unsupported"]) + ": checks the engine did not record in "
                     "these categories do not fail the case (any other unsupported or skipped check does)")
    else:
        rules.append("no allow_unsupported: every unsupported or skipped check fails the case")
    if s.get("triaged"):
        rules.append("triaged (reviewed findings reported as triaged): " + ", ".join(
            f"{t['request_id']} step {t['step']}" + ("" if t.get("node") is None else f" node {t['node']}") + f" {t['category']}"
            for t in s["triaged"]))
    return rules
