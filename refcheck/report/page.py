"""The whole report page: summary, a section per request (strip and step details), the findings.

Contract: :func:`render_page` returns one self-contained HTML document (inline CSS, SVG and script;
no ``src`` or ``href`` leaves the page). Each request has ``<section id="q<i>">`` with its step strip
(:mod:`.strip`) and an element per verify step (:mod:`.step_detail`): the tree is drawn for the
request's first step and for every step with a non-pass finding, at most :data:`TREE_CAP` (200)
trees in the page, in request and step order; further steps get one line each, which says the cap
left their tree out. The findings list is capped at
:data:`~refcheck.report.findings_list.FINDINGS_CAP` (500) rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refcheck.report.anchors import Anchors
from refcheck.report.findings_list import findings_list
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


class _Trees:
    """How many trees the page may still draw (:data:`TREE_CAP`)."""

    def __init__(self, cap: int) -> None:
        self.left = cap

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _request_section(i: int, rid: str, steps: list[StepRow], index: FindingIndex, anchors: Anchors,
                     tokens: TokenText | None, trees: _Trees) -> str:
    parts = []
    for k, s in enumerate(steps):
        wanted = k == 0 or bool(index.step(s.request_id, s.step))
        if wanted and trees.take():
            parts.append(step_detail(s, index, anchors, tokens))
        else:
            why = f" (tree not drawn: the page draws at most {TREE_CAP} trees)" if wanted else ""
            parts.append(step_brief(s, index, anchors, why))
    return (f'<section id="q{i}" class="card"><h2>request {esc(rid)} · {len(steps)} verify steps</h2>'
            f'{step_strip(steps, index, anchors)}{_legend()}{"".join(parts)}</section>')


def render_page(report: Report, trace: Trace, tokens: TokenText | None = None) -> str:
    """The HTML page of ``report`` (the diff of ``trace``); ``tokens`` adds the tokens' text."""
    anchors = Anchors(r.request_id for r in trace.requests)
    index = FindingIndex(report.findings)
    by_request = steps_by_request(trace)
    trees = _Trees(TREE_CAP)
    order: dict[str | None, int] = {rid: i for i, rid in enumerate(by_request)}
    sections = [_request_section(i, rid, by_request[rid], index, anchors, tokens, trees)
                for i, rid in enumerate(r.request_id for r in trace.requests)]
    body = (summary(report, trace, by_request, index, anchors) + "".join(sections)
            + findings_list(report.findings, order, anchors))
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>refcheck report: {esc(report.case)} · {esc(report.verdict)}</title>'
            f'<style>{stylesheet()}</style><script>{SCRIPT}</script></head>'
            f'<body><main>{body}</main></body></html>\n')
