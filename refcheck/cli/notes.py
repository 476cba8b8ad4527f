"""Plain-language notes under a report table: where a finding is, what each count is made of.

Contract: everything here turns a :class:`refcheck.diff.findings.Report` (or a finding as a dict,
as selftest rows carry them) into human text and never prints ``None``:

* :func:`where` (from :mod:`refcheck.diff.place`) — a finding's place: request, prefill / step,
  node, layer; a request-level finding says so (with the output index when it has one);
* :func:`headline` — the one finding the table shows for a report (the earliest first divergence
  over requests), and :func:`explain_target` — the node ``refcheck explain`` should look at: the
  headline when it is a node-level logits finding, else the earliest such first divergence;
* :func:`count_notes` — one line per (verdict, reason) group of non-pass, non-fail findings
  (unsupported, skipped, triaged, benign ties), with its categories, why it has that verdict and which
  steps and nodes it is at (the first few; all of them with ``--steps`` / ``--json``);
* :data:`LEGEND` — what the table's columns count.
"""

from __future__ import annotations

from refcheck.diff.findings import CATEGORIES, Finding, Report, Verdict
from refcheck.diff.place import request_place as _request_place
from refcheck.diff.place import where

__all__ = ["LEGEND", "WHY_NOT_COMPARED", "count_notes", "explain_target", "headline", "manifest_notes", "where"]

#: the column legend printed under every report table
LEGEND = ("columns: checks = comparisons made · pass = checks with no finding · benign = argmax flips at a "
          "reference near-tie · triaged = deviations within what rounding at the engine's dtype moves that node "
          "(calibrated); or findings a person reviewed in a golden's manifest · fail = real mismatches · unsupp. = "
          "quantities the engine did not record, or checks skipped (why: below)")

#: why a check was not made, keyed by the finding's message (refcheck/diff/replay.py, freerun.py)
WHY_NOT_COMPARED: dict[str, str] = {
    "engine recorded no draft top-k": "the engine's trace carries no drafter top-k to hold against the reference "
                                      "drafter (SGLang's capture records the verified tree, not its drafter's "
                                      "distribution)",
    "drafts not comparable: scripted drafter at different numerics": "the engine has no drafter of its own "
                                                                     "(target-only or n-gram trees), so there is no "
                                                                     "draft to compare",
    "engine recorded no state": "the engine's trace carries no KV / conv / recurrent state for these steps "
                                "(its runner could not read the engine's cache: z-lab's dflash exposes none, "
                                "SGLang's capture records it)",
    "request has no output and no steps": "the engine produced nothing for this request",
    "request has no output": "the engine produced no tokens for this request",
    "sampled with the engine's own generator: no token-level oracle": "at temperature > 0 the engine drew with its own "
                                                                     "random numbers and recorded none, so no token can "
                                                                     "be replayed; the distributional test judges its "
                                                                     "output instead (docs/sampling.md)",
}

#: what each non-pass verdict means, for the count lines
VERDICT_WORDS: dict[Verdict, str] = {
    Verdict.UNSUPPORTED: "unsupported",
    Verdict.SKIPPED: "skipped",
    Verdict.TRIAGED: "triaged",
    Verdict.BENIGN_TIE: "benign tie(s)",
}


def _order(f: Finding) -> tuple:
    step = 1 << 30 if f.step is None else f.step
    rank = CATEGORIES.index(f.category) if f.category in CATEGORIES else len(CATEGORIES)
    return (step, rank, f.request_id or "")


def headline(report: Report) -> Finding | None:
    """The finding the table shows: for an expected failure with an ``expect_first``, that request's
    first divergence (what the manifest checks); else the earliest (by step, then category order) of
    the requests' first divergences."""
    fd = report.first_divergence()
    want = (report.expect_first or {}).get("request_id") if report.expect_failure is not None else None
    if want in fd:
        return fd[want]
    firsts = list(fd.values())
    return min(firsts, key=_order) if firsts else None


def _explainable(f: Finding) -> bool:
    return f.category == "logits" and f.node is not None and f.step is not None and f.step >= 0


def explain_target(report: Report) -> Finding | None:
    """The node ``refcheck explain`` should look at: the headline when it is a node-level logits
    finding, else the earliest first divergence that is one (None: nothing to explain per node)."""
    first = headline(report)
    if first is not None and _explainable(first):
        return first
    nodes = [f for f in report.first_divergence().values() if _explainable(f)]
    return min(nodes, key=_order) if nodes else None


def _places(findings: list[Finding], limit: int) -> tuple[str, bool]:
    """The distinct places of ``findings`` (request, step, node), the first ``limit`` of them."""
    seen: dict[tuple, str] = {}
    for f in sorted(findings, key=lambda f: (f.request_id or "", -1 if f.step is None else f.step, f.node or 0)):
        loc = f.request_id + (f" ({_request_place(f)})" if f.step is None else (" prefill" if f.step < 0 else f" step {f.step}"))
        seen.setdefault((f.request_id, f.step, f.node, loc), loc + ("" if f.node is None else f" node {f.node}"))
    places = list(seen.values())
    more = len(places) - limit
    return ", ".join(places[:limit]) + (f" and {more} more" if more > 0 else ""), more > 0


def _reason(f: Finding) -> str:
    if f.verdict in (Verdict.UNSUPPORTED, Verdict.SKIPPED):
        return WHY_NOT_COMPARED.get(f.message, f.message or "no reason recorded")
    if f.verdict == Verdict.TRIAGED:
        by = f.details.get("triaged_by") or f.details.get("rule")
        if by == "manifest":
            return "reviewed by a person and listed in the golden's manifest ('triaged')"
        if by == "rounding":
            return "within what rounding at the engine's dtype moves that node (the calibrated verdict)"
        return f.message.split(":")[0] if f.message else "triaged"
    if f.verdict == Verdict.BENIGN_TIE:
        if f.category == "ar_tokens":
            return ("the output leaves target-only greedy decoding where the target's top two are a near-tie "
                    "(a rounding choice, not a lossless-ness bug)")
        return "the engine picked another token where the reference's top two are a near-tie"
    return f.message


def count_notes(report: Report, limit: int = 4) -> list[str]:
    """One line per (verdict, reason) group of the report's unsupported, skipped, triaged and benign
    findings: how many, in which categories, why, and where (the first ``limit`` places)."""
    groups: dict[tuple, list[Finding]] = {}
    order = (Verdict.UNSUPPORTED, Verdict.SKIPPED, Verdict.TRIAGED, Verdict.BENIGN_TIE)
    for f in report.findings:
        if f.verdict in order:
            groups.setdefault((order.index(f.verdict), _reason(f)), []).append(f)
    lines, cut = [], False
    for (rank, reason), fs in sorted(groups.items()):
        cats: dict[str, int] = {}
        for f in fs:
            cats[f.category] = cats.get(f.category, 0) + 1
        what = ", ".join(cats) if len(cats) > 1 and len(set(cats.values())) == 1 else ", ".join(
            f"{c} {n}" if len(cats) > 1 else c for c, n in cats.items())
        each = f" ({next(iter(cats.values()))} each)" if len(cats) > 1 and len(set(cats.values())) == 1 else ""
        at, more = _places(fs, limit)
        lines.append(f"{report.case}: {len(fs)} {VERDICT_WORDS[order[rank]]} · {what}{each}: {reason}; at {at}")
        cut = cut or more
    if cut:
        lines.append(f"{report.case}: every place: --steps (one row per verify step) or --json (every finding)")
    return lines


def manifest_notes(report: Report) -> list[str]:
    """The golden manifest rules that changed this report's verdict (recorded by the gate's check)."""
    return [f"{report.case}: manifest: {rule}" for rule in report.stats.get("manifest_rules", [])]

