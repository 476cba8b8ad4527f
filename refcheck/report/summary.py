"""The page's summary: what was diffed, the verdict, the counts, τ, provenance, first divergences.

Contract: :func:`summary` gives ``<section id="summary">`` holding the case and trace file, the
verdict (``<span id="verdict">``, the report's :attr:`~refcheck.diff.findings.Report.verdict`), the
counts table (``<table id="counts">``, one ``<td data-verdict=V>`` per verdict: the report's
:attr:`~refcheck.diff.findings.Report.counts`; :func:`counts_table`), mean τ of the engine and of the
reference with the acceptance account where the report has one, the engine and models from the trace's
provenance, and one row per request linking to its strip (``#q<i>``) and to its first divergence's
step. Every id is the :class:`~refcheck.report.anchors.Anchors`' own (prefixed on a page of several
cases: ``c3-summary``), and every ``href`` in it is an anchor of the page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from refcheck.report.text import esc, num
from refcheck.report.verdicts import LABELS, FindingIndex, worst

if TYPE_CHECKING:
    from refcheck.diff.findings import Finding, Report
    from refcheck.report.anchors import Anchors
    from refcheck.trace.rows import StepRow, Trace

COUNTED = ("pass", "benign_tie", "triaged", "fail", "unsupported", "skipped")


def _short(value: Any) -> str:
    return value[:12] + "…" if isinstance(value, str) and len(value) == 64 else str(value)


def verdict_class(report: Report) -> str:
    """The badge colour of the report's verdict: pass, fail, or unsupported (grey) for the rest."""
    if report.expect_failure is not None:
        return "pass" if report.expected_failure_met else "fail"
    return {"fail": "fail", "pass": "pass"}.get(report.verdict, "unsupported")


def counts_table(report: Report, anchors: Anchors) -> str:
    """The counts table (one cell per verdict) and the number of checks made."""
    counts = report.counts
    cells = "".join(f'<td data-verdict="{v}"><span class="dot {v}"></span>{LABELS[v]} <b>{counts.get(v, 0)}</b></td>'
                    for v in COUNTED)
    return (f'<table id="{anchors.fixed("counts")}" class="counts"><tr>{cells}</tr></table>'
            f'<p>{sum(report.checks.values())} checks made</p>')


def _tau(report: Report, trace: Trace, anchors: Anchors) -> str:
    from refcheck.diff.acceptance import account_line

    st = report.stats
    lines = []
    if st.get("mean_tau_engine") is not None:
        ref = st.get("mean_tau_reference")
        lines.append(f"mean τ engine {num(st['mean_tau_engine'])}"
                     + (f" · reference {num(ref)} (its own run)" if ref is not None else "") + " (bonus counted)")
    elif trace.steps:
        tau = sum(s.accept_length for s in trace.steps) / len(trace.steps)
        lines.append(f"mean τ engine {num(tau)} (bonus counted; the reference's own run is diffed in modes free "
                     "and both)")
    if st.get("acceptance_account"):
        lines.append(account_line(st["acceptance_account"]))
    return "".join(f'<p id="{anchors.fixed("tau")}">{esc(line)}</p>' if i == 0 else f"<p>{esc(line)}</p>" for i, line in enumerate(lines))


def _provenance(trace: Trace, anchors: Anchors) -> str:
    p = trace.provenance
    eng = p.get("engine") or {}
    settings = eng.get("settings") or {}
    temps = sorted({r.temperature for r in trace.requests})
    rows = [("engine", f"{eng.get('name', '?')} {eng.get('version') or ''}".strip()
             + (f" · algorithm {settings['algorithm']}" if settings.get("algorithm") else "")),
            ("target model", f"{p.get('model', '?')} (sha256 {_short(p.get('model_sha256'))})"),
            ("draft model", f"{settings.get('draft_dir') or 'of the pair'} (sha256 {_short(p['draft_sha256'])})"
             if p.get("draft_sha256") else "none"),
            ("run", f"{p.get('dtype', '?')} on {p.get('device', '?')} · budget {p.get('budget', '?')} · block size "
                    f"{p.get('block_size', '?')} · drafter {p.get('drafter', '?')} · up to "
                    f"{p.get('max_new_tokens', '?')} new tokens · temperature {', '.join(num(t) for t in temps)}"),
            ("recorded", ", ".join(f"{k} {v}" for k, v in (p.get("versions") or {}).items())
             + (f" · {p['created']}" if p.get("created") else ""))]
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table id="{anchors.fixed("provenance")}">{body}</table>'


def _first_link(f: Finding | None, anchors: Anchors) -> str:
    if f is None:
        return "none"
    target = anchors.step(f.request_id, f.step) if f.step is not None and f.step >= 0 else anchors.request(f.request_id)
    where = f"step {f.step}" + (f", node {f.node}" if f.node is not None else "") if f.step is not None else "request"
    text = esc(f"{where}: {f.category}: {f.message}")
    return f'<a class="first" href="#{esc(target)}">{text}</a>' if target else text


def _requests(report: Report, trace: Trace, by_request: dict[str, list[StepRow]], index: FindingIndex,
              anchors: Anchors) -> str:
    firsts = report.first_divergence()
    rows = []
    for r in trace.requests:
        steps = by_request.get(r.request_id, [])
        verdict = worst(f for s in steps for f in index.step(s.request_id, s.step))
        if r.request_id in firsts:
            verdict = "fail"
        tau = sum(s.accept_length for s in steps) / len(steps) if steps else None
        rows.append(f'<tr><td><span class="dot {verdict}"></span><a href="#{anchors.request(r.request_id)}">'
                    f'{esc(r.request_id)}</a></td><td>{len(steps)}</td><td>{num(tau)}</td><td>{LABELS[verdict]}</td>'
                    f'<td>{_first_link(firsts.get(r.request_id), anchors)}</td></tr>')
    head = "<tr><th>request</th><th>steps</th><th>mean τ</th><th>worst</th><th>first divergence</th></tr>"
    run_level = firsts.get(None)
    extra = f"<p>whole run: {_first_link(run_level, anchors)}</p>" if run_level is not None else ""
    return f'<table id="{anchors.fixed("requests")}">{head}{"".join(rows)}</table>{extra}'


def summary(report: Report, trace: Trace, by_request: dict[str, list[StepRow]], index: FindingIndex,
            anchors: Anchors) -> str:
    """The summary section (module docstring)."""
    verdict = report.verdict
    notes = "".join(f'<p class="note">INCONCLUSIVE: {esc(w)}</p>' for w in report.inconclusive)
    if report.expect_failure is not None:
        notes += f'<p class="note">expected failure of this engine: {esc(report.expect_failure)}</p>'
    return (f'<section id="{anchors.fixed("summary")}" class="card"><h1>refcheck report: {esc(report.case)}</h1>'
            f'<p>trace <code>{esc(trace.source or "-")}</code> · schema {esc(trace.schema_version)} · mode '
            f'{esc(report.mode)} · verdict <span id="{anchors.fixed("verdict")}" class="badge {verdict_class(report)}">'
            f'{esc(verdict)}</span></p>{notes}{counts_table(report, anchors)}{_tau(report, trace, anchors)}'
            f'{_provenance(trace, anchors)}'
            f'<h3>requests</h3>{_requests(report, trace, by_request, index, anchors)}</section>')
