"""``refcheck gate`` and ``refcheck golden regen|add|verify``: the golden traces and the CI gate on them.

Contract of ``refcheck gate --html PATH``: the path is checked before the goldens are verified (a missing
directory: exit 2, nothing run); after the verdicts are printed, every case's report goes on one page
(:func:`refcheck.report.render_cases`), each case's trace read for it from its golden file (a report from
``--cache-dir`` included; a trace that cannot be read: the page says so for that case), written atomically
with its size printed. A page that cannot be written is exit 2 after the report; otherwise the exit code is
the verdicts'.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from refcheck.cli.app import err, main, progress_line, quiet
from refcheck.cli.reports import finish, report_table, write_html
from refcheck.errors import EXIT_GOLDEN, EXIT_PASS

if TYPE_CHECKING:
    from refcheck.diff.findings import Report
    from refcheck.goldens.manifest import Manifest


@main.command()
@click.argument("golden_dir", required=False, type=click.Path(path_type=Path))
@click.option("--case", "cases", multiple=True, help="Only these cases.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes to spread cases over (default: one per usable CPU core; 1 = this process only).")
@click.option("--profile", "profile", is_flag=True,
              help="Time each case's phases and count its work (steps replayed, forwards): a table, and 'profile' in --json.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, envvar="REFCHECK_GATE_CACHE",
              help="Keep each case's report there, keyed by the golden's bytes, its settings, refcheck's and the "
                   "reference's code and the library versions; a case whose key is stored is not diffed again.")
@click.option("-v", "--verbose", is_flag=True,
              help="The report as a table, with what every count holds (default: one line per case and a summary).")
@click.option("--html", "html", type=click.Path(path_type=Path), default=None,
              help="Also write every case's report on one self-contained HTML page (refcheck report's, per case).")
@click.option("--json", "as_json", is_flag=True)
def gate(golden_dir, cases, workers, profile, cache_dir, verbose, html, as_json):
    """CI gate: verify, then diff every golden case against the live reference (strict about skips)."""
    import time

    from refcheck.goldens import default_golden_dir
    from refcheck.goldens.gate import gate as run_gate
    from refcheck.goldens.verify import verify
    from refcheck.log import progress_bar
    from refcheck.outputs import check_output_file
    from refcheck.pool import ReferencePool

    if html is not None:
        check_output_file(html, "--html")  # before any case runs
    t0, c0 = time.perf_counter(), time.process_time()
    quiet()
    profiles: dict | None = {} if profile else None
    gdir = golden_dir or default_golden_dir()
    manifest = verify(gdir)  # the hashes checked once, before any case runs
    with progress_bar(err, len(cases) or len(manifest.cases), "gate") as progress:
        reports = run_gate(gdir, ReferencePool(), list(cases) or None, progress=progress, workers=workers,
                           profiles=profiles, cache_dir=cache_dir, manifest=manifest)
    report_table(reports, "refcheck gate", verbose=verbose)
    wall = time.perf_counter() - t0
    extra: dict = {"wall_s": wall, "cpu_s_this_process": time.process_time() - c0}
    if profiles is not None:
        profile_table(profiles)
        extra["profile"] = {n: p.to_json() for n, p in profiles.items()}
    err.print(f"gate: {len(reports)} cases in {wall:.1f} s", markup=False)
    error = write_html(html, gate_page(gdir, manifest, reports)) if html is not None else None
    finish(reports, as_json, extra, error)


def gate_page(gdir: Path, manifest: Manifest, reports: list[Report]) -> str:
    """The page of the gate's ``reports``, each case's trace read from its golden file when its section is drawn."""
    from functools import partial

    from refcheck.report import Case, render_cases
    from refcheck.trace.io import read_trace

    files = [Path(gdir) / manifest.cases[r.case].file for r in reports]
    return render_cases([Case(r, partial(read_trace, f), str(f)) for r, f in zip(reports, files)],
                        "refcheck gate", "refcheck gate --json")


def profile_table(profiles: dict) -> None:
    """The profile: per case, seconds per phase group (exclusive), wall, CPU, steps and forwards;
    then per phase over all cases."""
    from refcheck.profile import case_rows, phase_rows

    for title, (cols, rows) in (("refcheck gate --profile: wall seconds per case and phase group", case_rows(profiles)),
                                ("refcheck gate --profile: seconds per phase, all cases", phase_rows(profiles))):
        table = Table(title=title)
        for col in cols:
            table.add_column(col, justify="left" if col in ("case", "phase") else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        err.print(table)

@main.group()
def golden() -> None:
    """Golden traces: regenerate (with review) and verify."""

@golden.command("regen")
@click.option("--case", "cases", multiple=True, help="Only these cases (default: all built-in cases).")
@click.option("--reason", default=None, help="Why the goldens change (recorded in MANIFEST.json).")
@click.option("--accept", is_flag=True, help="Replace the goldens (otherwise: write .pending files and exit 3).")
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True)
def golden_regen(cases, reason, accept, golden_dir, as_json):
    """Re-run the reference for the golden cases and show what changed; --accept replaces them."""
    from refcheck.goldens import default_golden_dir
    from refcheck.goldens.regen import regenerate
    from refcheck.pool import ReferencePool

    quiet()
    reviews = regenerate(golden_dir or default_golden_dir(), list(cases) or None, reason, accept, ReferencePool(),
                         progress=progress_line)
    table = Table(title="golden regen review" + ("" if accept else " (pending: nothing replaced)"))
    for col in ("case", "status", "τ old → new", "first divergences", "library versions", "numbers", "provenance changes"):
        table.add_column(col)
    for r in reviews:
        tau = f"{r.tau_old:.3f} → {r.tau_new:.3f}" if r.tau_old is not None else f"- → {r.tau_new:.3f}"
        div = ", ".join(f"{k}@{v}" for k, v in r.first_divergence.items()) or "none"
        versions = "; ".join(r.version_changes) or ("new golden" if r.drift is None else "same")
        numbers = "new golden" if r.drift is None else r.drift.summary()
        table.add_row(r.case, r.status, tau, div, versions, numbers, "; ".join(r.provenance_changes) or "none")
    err.print(table)
    err.print("status: unchanged = same tokens, acceptance, numbers and library versions · drifted = same tokens and "
              "acceptance, other numbers or library versions (the bytes change) · changed = tokens, acceptance or "
              "the recorded models/settings differ", markup=False)
    if as_json:
        click.echo(json.dumps({"accepted": accept, "reviews": [r.to_json() for r in reviews]}, indent=2))
    if not accept:
        err.print("review the summary, then run again with --accept --reason TEXT to replace the goldens", markup=False)
        sys.exit(EXIT_GOLDEN)
    sys.exit(EXIT_PASS)

@golden.command("add")
@click.argument("trace_path", type=click.Path(path_type=Path))
@click.option("--case", "case", required=True, help="Name of the golden case.")
@click.option("--expect", default="pass", show_default=True,
              help="'pass', or 'fail' / 'fail:CATEGORY' for a trace of a known-buggy engine that must be caught.")
@click.option("--allow-unsupported", default="", help="Comma-separated categories the engine cannot record (kv,conv,...).")
@click.option("--reason", required=True, help="Why this trace becomes a golden (recorded in MANIFEST.json).")
@click.option("--triage", multiple=True, help="A reviewed finding the gate reports as triaged, not failed: "
              "REQUEST:STEP:NODE:CATEGORY (NODE '-' for none); repeat for each. Any other failure still fails.")
@click.option("--expect-first", default=None, help="With --expect fail[:CATEGORY]: where the first failure must be, "
              "REQUEST:STEP:NODE:LAYER (NODE, LAYER '-' for any); the gate fails the case if it moves.")
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None)
def golden_add(trace_path, case, expect, allow_unsupported, reason, triage, expect_first, golden_dir):
    """Store an engine's trace (SGLang, z-lab, ...) as a golden case the gate re-checks."""
    from refcheck.goldens import default_golden_dir, shown
    from refcheck.goldens.edits import add_trace

    path = add_trace(golden_dir or default_golden_dir(), trace_path, case, expect,
                     [c for c in allow_unsupported.split(",") if c], reason, list(triage), expect_first=expect_first)
    err.print(f"added golden {shown(case)}: {path}", markup=False)
    sys.exit(EXIT_PASS)

@golden.command("remove")
@click.argument("case")
@click.option("--reason", required=True, help="Why the case goes (its entry is kept in MANIFEST.json's 'removed').")
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None)
def golden_remove(case, reason, golden_dir):
    """Remove a golden case (one locked, crash-safe change; its manifest entry is kept with the reason)."""
    from refcheck.goldens import default_golden_dir, shown
    from refcheck.goldens.edits import remove_case

    remove_case(golden_dir or default_golden_dir(), case, reason)
    err.print(f"removed golden {shown(case)}", markup=False)
    sys.exit(EXIT_PASS)

@golden.command("verify")
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None)
@click.option("--clean", is_flag=True, help="Delete leftover temporary and *.pending files (under the writer lock).")
@click.option("--clean-orphans", is_flag=True, help="Also delete *.arrow files the manifest does not list.")
def golden_verify(golden_dir, clean, clean_orphans):
    """Check every golden trace's sha256 against MANIFEST.json; warn about orphan and leftover files."""
    from refcheck.goldens import default_golden_dir, store
    from refcheck.goldens.verify import verify

    gdir = golden_dir or default_golden_dir()
    manifest = verify(gdir)
    if clean or clean_orphans:
        for name in store.clean(gdir, orphans=clean_orphans):
            err.print(f"removed {name}", markup=False)
    for msg in store.leftovers(gdir, manifest).messages():
        err.print(f"warning: {msg}", markup=False)
    from refcheck.goldens import shown
    from refcheck.trace.io import file_checksummed

    legacy = [c for c, e in sorted(manifest.cases.items()) if not file_checksummed(gdir / e.file)]
    if legacy:
        err.print(f"warning: {len(legacy)} golden(s) are schema 1.0 traces without their own checksums (unchecked on "
                  f"read; the manifest's sha256 protects them; seal them: python scripts/seal_goldens.py): "
                  + ", ".join(shown(c) for c in legacy), markup=False)
    err.print(f"{len(manifest.cases)} golden traces match {gdir / 'MANIFEST.json'}", markup=False)
    sys.exit(EXIT_PASS)
