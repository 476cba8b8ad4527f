"""The list of all findings, most severe first, capped so a trace of thousands of steps still renders.

Contract: :func:`findings_list` gives ``<section id="findings-section">`` with a table
(``<table id="findings" class="findings">``) of the report's findings ordered by verdict (fail, triaged,
benign tie, unsupported, skipped), then request, step and node: at most ``cap`` rows (default
:data:`FINDINGS_CAP`, 500), each ``<tr id="f<k>" class="VERDICT">`` linking to its step's detail, then a
note (``id="findings-more"``) of how many more there are, why (``why``, appended as it is: on a page of
several cases, the page's cap) and where to get them all (``hint``: ``refcheck diff --against TRACE
--json`` unless given). With ``cap`` 0 the section holds its heading and that note only. Ids are the
:class:`~refcheck.report.anchors.Anchors`' (prefixed on a page of several cases). A select filters the
section's rows by verdict (inline JS).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from refcheck.report.text import details_line, esc
from refcheck.report.verdicts import LABELS, ORDER, rank

if TYPE_CHECKING:
    from refcheck.diff.findings import Finding
    from refcheck.report.anchors import Anchors

FINDINGS_CAP = 500


def _row(k: int, f: Finding, anchors: Anchors) -> str:
    target = anchors.step(f.request_id, f.step) if f.step is not None and f.step >= 0 else anchors.request(f.request_id)
    step = f'<a href="#{esc(target)}">{f.step}</a>' if target and f.step is not None else esc(
        "-" if f.step is None else f.step)
    details = details_line(f.details)
    cells = [f'<td class="v">{LABELS.get(f.verdict.value, f.verdict.value)}</td>', f"<td>{esc(f.category)}</td>",
             f"<td>{esc(f.request_id if f.request_id is not None else '(run)')}</td>", f"<td>{step}</td>",
             f"<td>{esc('-' if f.node is None else f.node)}</td>", f"<td>{esc('-' if f.layer is None else f.layer)}</td>",
             f'<td class="msg">{esc(f.message)}' + (f'<br><span class="mono">{esc(details)}</span>' if details else "")
             + "</td>"]
    return f'<tr id="{anchors.finding(k)}" class="{esc(f.verdict.value)}">{"".join(cells)}</tr>'


def ordered(findings: list[Finding], request_order: dict[str | None, int]) -> list[Finding]:
    """``findings`` most severe first, then by request (trace order), step and node."""
    return sorted(findings, key=lambda f: (rank(f), request_order.get(f.request_id, -1),
                                           f.step if f.step is not None else 1 << 30, f.node if f.node is not None else -1))


def findings_list(findings: list[Finding], request_order: dict[str | None, int], anchors: Anchors,
                  cap: int | None = None, why: str = "", hint: str = "refcheck diff --against TRACE --json") -> str:
    """The findings section (module docstring)."""
    cap = FINDINGS_CAP if cap is None else cap
    shown = ordered(findings, request_order)[:cap]
    section = anchors.fixed("findings-section")
    by_verdict = Counter(f.verdict.value for f in findings)
    options = "".join(f'<option value="{v}">{LABELS[v]} ({by_verdict[v]})</option>' for v in ORDER if by_verdict[v])
    head = "<tr><th>verdict</th><th>category</th><th>request</th><th>step</th><th>node</th><th>layer</th>" \
           "<th>message and details</th></tr>"
    rows = "".join(_row(k, f, anchors) for k, f in enumerate(shown))
    more = len(findings) - len(shown)
    told = (f"showing the first {len(shown)} of {len(findings)} findings{why}: {more} more not listed" if shown
            else f"none of the {len(findings)} findings listed{why}")
    note = (f'<p class="note" id="{anchors.fixed("findings-more")}">{esc(told)} ({esc(hint)} lists them all)</p>'
            if more > 0 else "")
    if not findings:
        return (f'<section id="{section}"><h2>findings</h2><p class="note">no findings: every check '
                'passes</p></section>')
    table = (f'<p>show <select onchange="filterFindings(this)"><option value="">all</option>{options}</select></p>'
             f'<table id="{anchors.fixed("findings")}" class="findings"><thead>{head}</thead><tbody>{rows}</tbody>'
             '</table>' if shown else "")
    return f'<section id="{section}"><h2>findings ({len(findings)})</h2>{table}{note}</section>'
