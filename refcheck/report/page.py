"""The whole report page: summary, a section per request (strip and step details), the findings.

Contract: :func:`render_page` returns one self-contained HTML document (inline CSS, SVG and script;
no ``src`` or ``href`` leaves the page). Each request has ``<section id="q<i>">`` with its step strip
(:mod:`.strip`) and an element per verify step (:mod:`.step_detail`). A tree is wanted for each
request's first step and for every step with a non-pass finding; :func:`trees_to_draw` picks at most
:data:`TREE_CAP` (200) of them for the page, in this order: each request's first divergence (the step
of its first failing finding), each request's first step, then the other wanted steps in request and
step order. Every other wanted step gets one line, which says the cap left its tree out. The findings
list is capped at :data:`~refcheck.report.findings_list.FINDINGS_CAP` (500) rows. :func:`report_body`
is the same content under a :class:`Caps` of its own, for a page of several cases (:mod:`.cases`);
:func:`document` wraps a body in the page's head (title, stylesheet, script).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from refcheck.report.anchors import Anchors
from refcheck.report.findings_list import FINDINGS_CAP, findings_list
from refcheck.report.step_detail import step_brief, step_detail
from refcheck.report.strip import step_strip
from refcheck.report.style import COLOURS, SCRIPT, stylesheet
from refcheck.report.summary import summary
from refcheck.report.text import esc
from refcheck.report.verdicts import LABELS, FindingIndex

if TYPE_CHECKING:
    from refcheck.diff.findings import Report
    from refcheck.report.tokens import TokenText
    from refcheck.trace.rows import StepRow, Trace

TREE_CAP = 200


@dataclass(frozen=True)
class Caps:
    """What one report's part of a page may hold: ``trees`` trees and ``findings`` rows of findings;
    ``trees_why`` and ``findings_why`` say (in parentheses, leading space included) why more are left
    out, ``hint`` where the whole list is."""

    trees: int
    findings: int
    trees_why: str
    findings_why: str = ""
    hint: str = "refcheck diff --against TRACE --json"


def steps_by_request(trace: Trace) -> dict[str, list[StepRow]]:
    out: dict[str, list[StepRow]] = {r.request_id: [] for r in trace.requests}
    for s in trace.steps:
        out.setdefault(s.request_id, []).append(s)
    for steps in out.values():
        steps.sort(key=lambda s: s.step)
    return out


def _legend() -> str:
    items = "".join(f'<span><span class="dot {v}"></span>{LABELS[v]}</span>' for v in COLOURS)
    return (f'<p class="legend">{items}<span>cell number: τ (accepted length, bonus counted) · tree: blue '
            'outline and edges = the engine\'s accepted path; hover a node for its numbers</span></p>')


def trees_to_draw(report: Report, by_request: dict[str, list[StepRow]], index: FindingIndex,
                  cap: int) -> set[tuple[str, int]]:
    """The (request, step) pairs whose tree the page draws: at most ``cap``, in the module docstring's order."""
    present = {(rid, s.step) for rid, steps in by_request.items() for s in steps}
    position = {rid: i for i, rid in enumerate(by_request)}
    firsts = [(f.request_id, f.step) for f in report.first_divergence().values()
              if f.request_id is not None and f.step is not None and (f.request_id, f.step) in present]
    firsts.sort(key=lambda p: (position[p[0]], p[1]))
    starts = [(rid, steps[0].step) for rid, steps in by_request.items() if steps]
    rest = [(rid, s.step) for rid, steps in by_request.items() for s in steps[1:] if index.step(rid, s.step)]
    return set(list(dict.fromkeys(firsts + starts + rest))[:max(cap, 0)])


def _request_section(rid: str, steps: list[StepRow], index: FindingIndex, anchors: Anchors,
                     tokens: TokenText | None, drawn: set[tuple[str, int]], why: str) -> str:
    parts = []
    for k, s in enumerate(steps):
        if (rid, s.step) in drawn:
            parts.append(step_detail(s, index, anchors, tokens))
        else:
            wanted = k == 0 or bool(index.step(s.request_id, s.step))
            parts.append(step_brief(s, index, anchors, f" (tree not drawn: {why})" if wanted else ""))
    return (f'<section id="{anchors.request(rid)}" class="card"><h2>request {esc(rid)} · {len(steps)} verify steps'
            f'</h2>{step_strip(steps, index, anchors)}{_legend()}{"".join(parts)}</section>')


def report_body(report: Report, trace: Trace, tokens: TokenText | None, anchors: Anchors,
                caps: Caps) -> tuple[str, int]:
    """The summary, the request sections and the findings of ``report`` under ``caps``: (HTML, trees drawn)."""
    index = FindingIndex(report.findings)
    by_request = steps_by_request(trace)
    listed = {r.request_id: by_request[r.request_id] for r in trace.requests}  # the requests with an anchor
    drawn = trees_to_draw(report, listed, index, caps.trees)
    order: dict[str | None, int] = {rid: i for i, rid in enumerate(by_request)}
    sections = [_request_section(rid, steps, index, anchors, tokens, drawn, caps.trees_why)
                for rid, steps in listed.items()]
    body = (summary(report, trace, by_request, index, anchors) + "".join(sections)
            + findings_list(report.findings, order, anchors, caps.findings, caps.findings_why, caps.hint))
    return body, len(drawn)


def document(title: str, body: str) -> str:
    """One self-contained HTML document: ``title`` (plain text) and ``body`` (HTML) with the inline style and script."""
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{esc(title)}</title><style>{stylesheet()}</style><script>{SCRIPT}</script></head>'
            f'<body><main>{body}</main></body></html>\n')


def render_page(report: Report, trace: Trace, tokens: TokenText | None = None) -> str:
    """The HTML page of ``report`` (the diff of ``trace``); ``tokens`` adds the tokens' text."""
    anchors = Anchors(r.request_id for r in trace.requests)
    caps = Caps(TREE_CAP, FINDINGS_CAP, f"the page draws at most {TREE_CAP} trees")
    body, _ = report_body(report, trace, tokens, anchors, caps)
    return document(f"refcheck report: {report.case} · {report.verdict}", body)
