"""The verdict output shared by the diffing commands: report tables, per-step tables, exit codes.

Contract: :func:`report_table` prints, by default, one line per report (its verdict, counts, τ and, when it
fails, its first failure) and a summary line (:func:`report_lines`); with ``verbose`` one row per report, then the
column legend, the manifest rules that changed a verdict, a line per group of non-pass findings saying why and
where (:mod:`refcheck.cli.notes`), the replayed steps and τ; :func:`steps_table` one row per verify
step; :func:`finish` the JSON (with ``--json``) and the exit code, or a late write's error once the JSON is out;
:func:`write_html` writes a report page atomically and prints ``wrote FILE (N bytes)``. Human output goes to stderr. Case
names, request ids and messages are text from files: a table cell shows them as written, escaped
(:func:`name_cell`), and no line is read as markup.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from refcheck.cli.app import err
from refcheck.cli.notes import LEGEND, count_notes, headline, manifest_notes, where
from refcheck.diff.acceptance import account_line
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS
from refcheck.log import one_line


def name_cell(text: str) -> str:
    """A name or message from a file as a table cell: one line, characters that do not print escaped, no markup."""
    return escape(one_line(text))


def first_cell(r) -> str:
    """The table's "first divergence" cell: the headline finding (:func:`refcheck.cli.notes.headline`),
    how many other requests fail, or the expected failure's status."""
    first = headline(r)
    others = len(r.first_divergence()) - 1
    more = f"\n(+{others} more request{'s' if others > 1 else ''} failing: --steps, --json)" if others > 0 else ""
    if r.expect_failure is not None:
        tag = "[green]expected failure caught[/]" if r.expected_failure_met else "[red]expected failure NOT caught[/]"
        return tag + (f"\n{name_cell(where(first))}: {name_cell(first.message)}" if first else f" ({r.expect_failure})")
    if first is not None:
        return f"[red]{name_cell(where(first))}[/]\n{name_cell(first.message)}{more}"
    return "[green]none[/]"


def report_lines(reports, title: str) -> None:
    """The quiet report: one line per report, then one summary line."""
    for r in reports:
        c = r.counts
        tau = r.stats.get("mean_tau_engine")
        ref = r.stats.get("mean_tau_reference")
        line = (f"{r.case}: {r.verdict} · {sum(r.checks.values())} checks: {c['pass']} pass, {c['benign_tie']} benign, "
                f"{c['triaged']} triaged, {c['fail']} fail, {c['unsupported'] + c['skipped']} unsupported")
        if tau is not None:
            line += f" · τ {tau:.3f}" + (f" vs {ref:.3f}" if ref is not None else "")
        first = headline(r) if r.failures or r.expect_failure is not None else None
        if first is not None:
            line += f" · first: {where(first)}: {first.message}"
        err.print(one_line(line), markup=False, soft_wrap=True)
    verdicts: dict[str, int] = {}
    for r in reports:
        verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    counted = ", ".join(f"{n} {v}" for v, n in verdicts.items()) or "nothing diffed"
    err.print(f"{title}: {len(reports)} case(s): {counted} (--verbose: the table and what every count holds)",
              markup=False, soft_wrap=True)


def report_table(reports, title: str, verbose: bool = True) -> None:
    if not verbose:
        report_lines(reports, title)
        return
    table = Table(title=title)
    for col in ("case", "mode", "checks", "pass", "benign", "triaged", "fail", "unsupp.", "first divergence"):
        table.add_column(col)
    for r in reports:
        c = r.counts
        table.add_row(name_cell(r.case), r.mode, str(sum(r.checks.values())), str(c["pass"]), str(c["benign_tie"]),
                      str(c["triaged"]), str(c["fail"]), str(c["unsupported"] + c["skipped"]), first_cell(r))
    err.print(table)
    if any(r.findings for r in reports):
        err.print(LEGEND, markup=False)
    for r in reports:
        for line in manifest_notes(r) + count_notes(r):
            err.print(line, markup=False)
        st = r.stats.get("steps")
        if st:
            devs = [f"max |Δ log-prob| {r.stats['max_logprob_abs']:.3g}"] if "max_logprob_abs" in r.stats else []
            devs += [f"max rel L2 {k[11:]} {r.stats[k]:.3g}" for k in sorted(r.stats) if k.startswith("max_rel_l2_")]
            err.print(f"{r.case}: replayed steps: {st.get('pass', 0)} pass · {st.get('benign_tie', 0)} benign tie · "
                      + (f"{st['triaged']} triaged · " if st.get("triaged") else "") + f"{st.get('fail', 0)} fail" + (" · " + ", ".join(devs) if devs else ""),
                      markup=False)
        if r.stats.get("mean_tau_engine") is not None:
            ref = r.stats.get("mean_tau_reference")
            err.print(f"{r.case}: mean τ engine {r.stats['mean_tau_engine']:.3f}"
                      + (f", reference {ref:.3f} (its own run)" if ref is not None else "") + " (bonus counted)", markup=False)
        if r.stats.get("acceptance_account"):
            err.print(f"{r.case}: {account_line(r.stats['acceptance_account'])}", markup=False)
        sh = r.stats.get("shadow")
        if sh and sh.get("steps"):
            err.print(f"{r.case}: shadow tree: τ {sh['tau_shadow_tree'] / sh['steps']:.3f} under the reference's verify "
                      f"vs the verified chain's {sh['tau_engine'] / sh['steps']:.3f} ({sh['steps']} steps)", markup=False)

def finish(reports, as_json: bool, extra: dict | None = None, error: Exception | None = None) -> None:
    """The JSON (with ``as_json``), the inconclusive lines, then exit with the verdicts' code; ``error`` (a write
    that failed after the report was printed) is raised instead, its exit code winning."""
    from refcheck.errors import EXIT_NOTHING

    if as_json:
        click.echo(json.dumps({**(extra or {}), "reports": [r.to_json() for r in reports]}, indent=2, default=str))
    codes = [r.exit_code for r in reports]
    for r in reports:
        for why in r.inconclusive:
            err.print(f"{r.case}: INCONCLUSIVE {why}", markup=False, soft_wrap=True)
    if error is not None:
        raise error
    if EXIT_MISMATCH in codes:
        sys.exit(EXIT_MISMATCH)
    if not reports or all(c == EXIT_NOTHING for c in codes) or any(r.inconclusive for r in reports):
        sys.exit(EXIT_NOTHING)  # nothing compared, or a statistical verdict short of its stated power
    sys.exit(EXIT_PASS)

def write_html(path: Path, page: str) -> Exception | None:
    """Write ``page`` to ``path`` atomically and print ``wrote PATH (N bytes)``; a write that fails gives the
    error to raise once the report is out (:func:`refcheck.outputs.late_write_error`, exit 2), else None."""
    from refcheck.atomic_file import atomic_write_bytes
    from refcheck.outputs import late_write_error

    data = page.encode("utf-8")
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        return late_write_error(path, exc, "the report page")
    err.print(f"wrote {path} ({len(data):,} bytes)", markup=False)
    return None


def steps_table(report, trace, limit: int = 500) -> None:
    """One row per verify step of the engine trace: its tree, τ and the replay's verdict there."""
    from refcheck.diff.findings import Verdict, worst_verdict

    by_step: dict[tuple, list] = {}
    for f in report.findings:
        if f.step is not None and f.step >= 0:
            by_step.setdefault((f.request_id, f.step), []).append(f)
    table = Table(title=f"{name_cell(report.case)}: verify steps")
    for col in ("request", "step", "position", "nodes", "τ", "verdict", "categories", "first finding"):
        table.add_column(col)
    for s in trace.steps[:limit]:
        fs = by_step.get((s.request_id, s.step), [])
        verdicts = {f.verdict for f in fs}
        worst = worst_verdict(verdicts)
        shown = [f for f in fs if f.verdict == worst] if worst else []
        style = {Verdict.FAIL: "red", Verdict.TRIAGED: "yellow", Verdict.BENIGN_TIE: "cyan"}.get(worst, "green")
        first = shown[0] if shown else None
        table.add_row(name_cell(s.request_id), str(s.step), str(s.committed_len), str(len(s.tree_tokens)), str(s.accept_length),
                      f"[{style}]{worst.value if worst else 'pass'}[/]", ", ".join(sorted({f.category for f in shown})),
                      (f"node {first.node} " if first and first.node is not None else "")
                      + (f"layer {first.layer} " if first and first.layer is not None else "")
                      + (name_cell(first.message[:90]) if first else ""))
    err.print(table)
    if len(trace.steps) > limit:
        err.print(f"{report.case}: {len(trace.steps) - limit} more steps not shown (see --json)", markup=False)
