"""The report page of several diffed cases (``refcheck gate --html``, ``refcheck diff --html``).

Contract: :func:`render_cases` returns one self-contained HTML document (:func:`.page.document`) whose
title and heading state the overall verdict (:func:`overall_verdict`: as the command's exit code has
it), then ``<section id="index">`` with ``<table id="cases">``: one row per case, in the order given
(its name linking to ``#c<k>``, its verdict, its counts, mean τ and a link to its first failing step),
then per case ``<section id="c<k>" class="case">`` holding a line naming the case and where its trace is
(:attr:`Case.source`), then what :func:`.page.render_page` shows of one trace (summary, request sections,
findings) with every id prefixed ``c<k>-`` (``c3-q0-s5``, ``c3-summary``;
:class:`~refcheck.report.anchors.Anchors`), so ids are unique across the page.

The caps are per page: the page draws at most :data:`~refcheck.report.page.TREE_CAP` trees and lists
at most :data:`~refcheck.report.findings_list.FINDINGS_CAP` findings in all, however many cases it
holds, so its size is bounded by those plus a summary per case and a strip cell and a line per verify
step. They are handed
out case by case: the cases whose verdict fails the command first, then the others (each group in the
order given); a case may take what is left divided by the cases of its group still to draw (rounded
up), so what one case leaves unused goes to the cases drawn after it. Each case notes what its share
left out.

A case's trace is given, or read when its section is drawn (:attr:`Case.trace` a callable: one trace in
memory at a time); one that cannot be read gives that case a section with its verdict, counts and
findings and a note of why its steps are missing (``id="c<k>-unread"``), and the page is still written.
Token text comes from :meth:`TokenText.for_trace`, loaded once per target directory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import refcheck.report.page as page
from refcheck.errors import EXIT_MISMATCH, EXIT_NOTHING
from refcheck.report.anchors import Anchors
from refcheck.report.findings_list import FINDINGS_CAP, findings_list
from refcheck.report.summary import counts_table, verdict_class
from refcheck.report.text import esc, num
from refcheck.report.tokens import TokenText, target_dir

if TYPE_CHECKING:
    from refcheck.diff.findings import Report
    from refcheck.trace.rows import Trace


@dataclass(frozen=True)
class Case:
    """One diffed case of the page: its report, its trace (or how to read it) and where the trace is."""

    report: Report
    trace: Trace | Callable[[], Trace]
    source: str = ""


@dataclass
class _Drawn:
    """One case's section as drawn: its HTML, what it used of the page's caps, its first failing step's id and
    text, and the engine's mean τ (the report's, else the trace's)."""

    html: str
    trees: int
    rows: int
    first: tuple[str, str] | None  # when the trace was read
    tau: float | None


def overall_verdict(reports: Sequence[Report]) -> str:
    """fail, pass, inconclusive or nothing compared: the verdict of the command's exit code over ``reports``."""
    codes = [r.exit_code for r in reports]
    if EXIT_MISMATCH in codes:
        return "fail"
    if any(r.inconclusive for r in reports):
        return "inconclusive"
    if not reports or all(c == EXIT_NOTHING for c in codes):
        return "nothing compared"
    return "pass"


def _load(case: Case) -> tuple[Trace | None, str]:
    if not callable(case.trace):
        return case.trace, ""
    try:
        return case.trace(), ""
    except Exception as exc:  # noqa: BLE001 - any trace that does not read: the page says so for its case
        return None, f"{type(exc).__name__}: {exc}"


def _first(report: Report, trace: Trace, anchors: Anchors) -> tuple[str, str] | None:
    firsts = report.first_divergence()
    for r in trace.requests:
        f = firsts.get(r.request_id)
        if f is not None:
            target = anchors.step(f.request_id, f.step) if f.step is not None and f.step >= 0 else anchors.request(
                f.request_id)
            where = f"{r.request_id} step {f.step}" if f.step is not None else str(r.request_id)
            return (target or "", f"{where}: {f.category}")
    return None


def _unread(case: Case, error: str, anchors: Anchors, caps: page.Caps) -> str:
    r = case.report
    return (f'<section id="{anchors.fixed("summary")}" class="card"><h1>refcheck report: {esc(r.case)}</h1>'
            f'<p>mode {esc(r.mode)} · verdict <span id="{anchors.fixed("verdict")}" class="badge {verdict_class(r)}">'
            f'{esc(r.verdict)}</span></p><p class="note" id="{anchors.fixed("unread")}">no steps shown: the trace '
            f'{esc(case.source or "-")} could not be read for this page ({esc(error)}); the verdict, counts and '
            f'findings are the diff\'s own</p>{counts_table(r, anchors)}</section>'
            + findings_list(r.findings, {}, anchors, caps.findings, caps.findings_why, caps.hint))


class _Tokens:
    """Token text per target directory, each tokenizer loaded once."""

    def __init__(self) -> None:
        self._by_dir: dict[str, TokenText | None] = {}

    def for_trace(self, trace: Trace) -> TokenText | None:
        key = str(target_dir(trace.provenance))
        if key not in self._by_dir:
            self._by_dir[key] = TokenText.for_trace(trace.provenance)
        return self._by_dir[key]


def _draw(k: int, n: int, case: Case, caps: page.Caps, tokens: _Tokens) -> _Drawn:
    cid = f"c{k}"
    trace, error = _load(case)
    rows = min(len(case.report.findings), caps.findings)
    tau = case.report.stats.get("mean_tau_engine")
    if trace is None:
        body, trees, first = _unread(case, error, Anchors([], f"{cid}-"), caps), 0, None
    else:
        if tau is None and trace.steps:
            tau = sum(s.accept_length for s in trace.steps) / len(trace.steps)
        anchors = Anchors((r.request_id for r in trace.requests), f"{cid}-")
        body, trees = page.report_body(case.report, trace, tokens.for_trace(trace), anchors, caps)
        first = _first(case.report, trace, anchors)
    source = f" · {esc(case.source)}" if case.source else ""
    nav = (f'<p class="casenav">case {k + 1} of {n}: {esc(case.report.case)}{source} · <a href="#index">all cases</a>'
           '</p>')
    return _Drawn(f'<section id="{cid}" class="case">{nav}{body}</section>', trees, rows, first, tau)


def _draw_all(cases: Sequence[Case], hint: str) -> list[_Drawn]:
    """Every case's section (in the order given), the page's caps handed out as the module docstring says."""
    n, tree_cap = len(cases), page.TREE_CAP
    failing = [k for k, c in enumerate(cases) if c.report.exit_code == EXIT_MISMATCH]
    order = failing + [k for k in range(n) if k not in set(failing)]
    trees_left, rows_left, failing_left = tree_cap, FINDINGS_CAP, len(failing)
    tokens = _Tokens()
    drawn: dict[int, _Drawn] = {}
    for pos, k in enumerate(order):
        group = failing_left if pos < len(failing) else n - pos
        caps = page.Caps(-(-trees_left // group), -(-rows_left // group),
                         f"the page draws at most {tree_cap} trees, shared by its {n} cases",
                         f" (the page lists at most {FINDINGS_CAP} findings, shared by its {n} cases)", hint)
        drawn[k] = _draw(k, n, cases[k], caps, tokens)
        trees_left -= drawn[k].trees
        rows_left -= drawn[k].rows
        if pos < len(failing):
            failing_left -= 1
    return [drawn[k] for k in range(n)]


def _index(cases: Sequence[Case], drawn: list[_Drawn], title: str, verdict: str) -> str:
    head = ("<tr><th>case</th><th>verdict</th><th>checks</th><th>pass</th><th>benign tie</th><th>triaged</th>"
            "<th>fail</th><th>unsupported</th><th>mean τ</th><th>first failure</th></tr>")
    rows = []
    for k, (case, d) in enumerate(zip(cases, drawn)):
        r, c = case.report, case.report.counts
        first = "none" if d.first is None else (f'<a href="#{esc(d.first[0])}">{esc(d.first[1])}</a>' if d.first[0]
                                                else esc(d.first[1]))
        if d.first is None and r.failures:
            first = esc(f"{len(r.failures)} failing finding(s): see the case")
        cells = [f'<span class="dot {verdict_class(r)}"></span><a href="#c{k}">{esc(r.case)}</a>', esc(r.verdict),
                 str(sum(r.checks.values())), *(str(c[v]) for v in ("pass", "benign_tie", "triaged", "fail")),
                 str(c["unsupported"] + c["skipped"]), num(d.tau), first]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    badge = {"fail": "fail", "pass": "pass"}.get(verdict, "unsupported")
    return (f'<section id="index" class="card"><h1>{esc(title)}: <span id="overall" class="badge {badge}">'
            f'{esc(verdict)}</span> · {len(cases)} case(s)</h1><p>each case below: its summary, its requests (step '
            f'strips and trees) and its findings; the page draws at most {page.TREE_CAP} trees and lists at most '
            f'{FINDINGS_CAP} findings in all, the failing cases first</p>'
            f'<table id="cases" class="cases">{head}{"".join(rows)}</table></section>')


def render_cases(cases: Sequence[Case], title: str, hint: str) -> str:
    """The page of ``cases`` (module docstring); ``title`` names the command (``refcheck gate``), ``hint`` the
    command that lists every finding (``refcheck gate --json``)."""
    verdict = overall_verdict([c.report for c in cases])
    drawn = _draw_all(cases, hint)
    body = _index(cases, drawn, title, verdict) + "".join(d.html for d in drawn)
    return page.document(f"{title}: {verdict} · {len(cases)} case(s)", body)
