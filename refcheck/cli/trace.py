"""``refcheck trace show``: a trace file's summary."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

from refcheck.cli.app import err, main
from refcheck.errors import EXIT_PASS


@main.group()
def trace() -> None:
    """Inspect trace files."""

@trace.command("show")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def trace_show(path, as_json):
    """Summarise a trace: provenance, requests, steps, mean τ, bytes per step."""
    from refcheck.trace.io import read_trace

    t = read_trace(path)
    size = path.stat().st_size
    taus = [s.accept_length for s in t.steps]
    info = {"path": str(path), "schema_version": t.schema_version,
            "integrity": "checksums verified" if t.checksummed else "unchecked (schema 1.0 file: no checksums)", "bytes": size, "requests": len(t.requests),
            "steps": len(t.steps), "bytes_per_step": size / max(len(t.steps), 1),
            "mean_tau": statistics.fmean(taus) if taus else None, "provenance": t.provenance}
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        for k, v in info.items():
            err.print(f"{k}: {v}", markup=False)
    sys.exit(EXIT_PASS)
