"""``refcheck capture show``: what an SGLang capture directory holds, read while its server runs.

Contract: one block per scheduler process (:mod:`refcheck.sglang.capture.inventory`: frame heads, counters and
status alone, no record decoded and no model loaded): its records, segments and bytes; its counters (queued,
written, still queued, lost to a full queue, past the byte budget, rolled out, requests met); the sampling rule and
budget its status gives; its error records (the first one's text), torn segment ends and unreadable files. Human
lines on stderr, ``--json`` every field on stdout. A path that is not a capture directory is exit 2; otherwise exit 0,
whatever the directory holds (``refcheck trace import`` and ``refcheck diff --capture`` judge it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import click

from refcheck.cli.app import err, main
from refcheck.errors import EXIT_PASS

if TYPE_CHECKING:
    from refcheck.sglang.capture.inventory import ProcessInventory


@main.group()
def capture() -> None:
    """Inspect SGLang capture directories."""


@capture.command("show")
@click.argument("capture_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def capture_show(capture_dir: Path, as_json: bool) -> None:
    """Per scheduler process: records, bytes, counters, sampling rule, budget, errors and torn ends."""
    from refcheck.sglang.capture.inventory import inventory

    processes = inventory(capture_dir)
    if as_json:
        click.echo(json.dumps({"path": str(capture_dir), "processes": [asdict(p) for p in processes]}, indent=2,
                              default=str))
    else:
        for line in show_lines(capture_dir, processes):
            err.print(line, markup=False, soft_wrap=True)
    sys.exit(EXIT_PASS)


def show_lines(root: Path, processes: list[ProcessInventory]) -> list[str]:
    """The human summary: a header line, then each process's lines."""
    versions = sorted({str(p.status.get("sglang")) for p in processes if p.status.get("sglang")})
    lines = [f"{root}: capture directory, {len(processes)} scheduler process(es)"
             + (f", SGLang {', '.join(versions)}" if versions else "")]
    for p in processes:
        lines += _process_lines(p)
    lines.append(f"next: refcheck trace import {root} --out served.arrow (--running while the server serves)")
    return lines


def _process_lines(p: ProcessInventory) -> list[str]:
    mib = p.record_bytes / (1 << 20)
    lines = [f"{p.name}: {p.records:,} record(s) in {p.segments} segment(s), {mib:,.1f} MiB · "
             f"{p.error_records} error record(s)"]
    c = p.counts
    if c is not None:
        behind = c["queued"] - c["written"]
        still = f", {behind:,} still queued" if behind else ""
        lines.append(f"  queue: {c['queued']:,} queued, {c['written']:,} written{still} · lost {c['lost']:,} · past "
                     f"the budget {c['over_budget']:,} · rolled out {c['rolled_out']:,} · {c['requests']:,} "
                     "request(s) met")
    st = p.status
    sample = st.get("sample") if isinstance(st.get("sample"), dict) else None
    rule = (f"1 batch in {sample.get('every')} (seed {sample.get('seed')})" if sample and sample.get("every") != 1
            else "every batch")
    budget = (f"a budget of {st['max_bytes'] / (1 << 20):,.0f} MiB" + (", rolling" if st.get("roll") else "")
              if isinstance(st.get("max_bytes"), int) else "no byte budget")
    lines.append(f"  capture: {rule} · {budget}")
    if p.first_error:
        lines.append(f"  first error: {p.first_error}")
    lines += [f"  torn: {t}" for t in p.torn]
    if p.old_files:
        lines.append(f"  {p.old_files} record file(s) of the one-file-per-record format (*.rec): not read")
    lines += [f"  unreadable: {problem}" for problem in p.problems]
    return lines
