"""``refcheck selftest``: every injected engine fault must be caught by the diff."""

from __future__ import annotations

import json
import sys

import click
from rich.table import Table

from refcheck.cli.app import err, main, progress_line, quiet
from refcheck.cli.notes import where
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS


@main.command()
@click.option("--fault", "faults", multiple=True,
              help="Only these faults (default: every discrete fault; graded ones by name, e.g. rec-scale:0.01).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="> 0: the sampling faults (argmax-at-temperature, temperature-twice, ...), sampled at this temperature.")
@click.option("--top-p", type=float, default=0.9, show_default=True, help="With --temperature: top-p of the sampled runs.")
@click.option("--json", "as_json", is_flag=True)
def selftest(faults, temperature, top_p, as_json):
    """Inject every known engine bug class into the reference and check that the diff catches each."""
    from ddtree_reference.sampling import Sampling
    from refcheck.selftest.run import selftest as run_selftest
    from refcheck.selftest.sampling_faults import SELFTEST_SAMPLING

    quiet()
    sampling = Sampling(temperature, 0, top_p, SELFTEST_SAMPLING.seed)  # out of range: exit 2
    rows = run_selftest(list(faults) or None, progress=progress_line, sampling=None if sampling.greedy else sampling)
    table = Table(title="refcheck selftest")
    sampled = any(r.hidden is not None for r in rows)
    for col in ("fault", "detected", "expected category", "first divergence", "ok") + (("randomness hidden",) if sampled else ()):
        table.add_column(col)
    for r in rows:
        f = r.first
        hidden = () if not sampled else (f"{r.hidden['verdict']} (p {r.hidden['p_value']:.2g}, {r.hidden['n_tokens']} tokens)",)
        table.add_row(r.fault, "yes" if r.detected else "no", r.expected, "not detected" if f is None else where(f),
                      "[green]ok[/]" if r.ok else "[red]NO[/]", *hidden)
    err.print(table)
    if as_json:
        click.echo(json.dumps({"rows": [r.to_json() for r in rows]}, indent=2, default=str))
    sys.exit(EXIT_PASS if all(r.ok for r in rows) else EXIT_MISMATCH)
