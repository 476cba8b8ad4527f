"""``refcheck report``: one recorded trace diffed against the reference, as a self-contained HTML page.

Contract: ``refcheck report TRACE [-o FILE]`` diffs TRACE as ``refcheck diff --against TRACE`` does
(same modes and reference numerics), prints its one-line verdict on stderr, and writes the page of
:mod:`refcheck.report` to FILE (default: ``<TRACE's stem>.report.html`` in the current directory),
atomically. The output path is checked before the trace is read (a missing directory: exit 2); a
corrupt trace is exit 4; a page that cannot be written after the diff is exit 2 after the table. The
exit code is otherwise the verdict's, as ``diff --against``'s (0 pass, 1 fail, 5 nothing compared).
"""

from __future__ import annotations

from pathlib import Path

import click

from refcheck.cli.app import err, main
from refcheck.cli.options import DeviceType
from refcheck.spec import DTYPE_NAMES


@main.command()
@click.argument("trace_path", metavar="TRACE", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), default=None,
              help="The HTML file to write (default: <TRACE's stem>.report.html here).")
@click.option("--mode", type=click.Choice(["replay", "free", "both"]), default="both", show_default=True)
@click.option("--ref-dtype", type=click.Choice(list(DTYPE_NAMES)), default="float32", show_default=True)
@click.option("--ref-device", type=DeviceType(), default="cpu", show_default=True)
def report(trace_path: Path, output: Path | None, mode: str, ref_dtype: str, ref_device: str) -> None:
    """Diff a recorded trace and write a self-contained HTML report (summary, step strips, trees, findings)."""
    from refcheck.cli.reports import finish, report_table, write_html
    from refcheck.diff.judge import judge
    from refcheck.outputs import check_output_file
    from refcheck.pool import ReferencePool
    from refcheck.report import TokenText, render_page
    from refcheck.trace.io import read_trace

    output = output if output is not None else Path(f"{Path(trace_path).stem}.report.html")
    check_output_file(output, "-o")  # before the diff, not after it
    trace = read_trace(trace_path)
    err.print(f"diffing {trace_path}", markup=False)
    result = judge(trace, ReferencePool(), Path(trace_path).stem, mode, ref_dtype=ref_dtype, ref_device=ref_device)
    report_table([result], f"refcheck report · mode {mode}", verbose=False)  # the page holds the rest
    page = render_page(result, trace, TokenText.for_trace(trace.provenance))
    finish([result], False, error=write_html(output, page))
