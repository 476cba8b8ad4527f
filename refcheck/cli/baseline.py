"""``refcheck baseline``: a trace's acceptance against z-lab's published figures."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from refcheck.cli.app import err, main
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS


@main.command()
@click.argument("trace_path", type=click.Path(path_type=Path))
@click.option("--source", default=None, help="Baseline file (ddtree_table1, ddtree_budget_sweep, dflash_readme, ...).")
@click.option("--model", "bl_model", default=None, help="Baseline target model, e.g. Qwen3-8B.")
@click.option("--dataset", default=None, help="Baseline dataset, e.g. MATH-500.")
@click.option("--temperature", type=float, default=None,
              help="Baseline rows at this temperature (default: the trace's own sampling temperature, 0 when greedy).")
@click.option("--method", type=click.Choice(["ddtree", "dflash"]), default=None,
              help="Default: dflash for a chain trace, ddtree otherwise.")
@click.option("--budget", "bl_budget", default=None, help="Baseline budget (default: the trace's, when the source has budgets).")
@click.option("--rtol", type=float, default=0.05, show_default=True, help="Allowed relative shortfall of mean τ.")
@click.option("--position-floor", type=float, default=0.05, show_default=True,
              help="Allowed shortfall of each per-position acceptance rate when a published histogram matches.")
@click.option("--json", "as_json", is_flag=True)
def baseline(trace_path, source, bl_model, dataset, temperature, method, bl_budget, rtol, position_floor, as_json):
    """Compare a trace's acceptance with z-lab's published baselines (bootstrap CI, per-position, histogram)."""
    from refcheck.baselines import load_baselines, match
    from refcheck.baselines.stats import (
        acceptance_verdict,
        histogram,
        histogram_distance,
        per_position_acceptance,
        positions_from_histogram,
    )
    from refcheck.errors import UsageError
    from refcheck.trace.io import read_trace

    for name, value in (("--rtol", rtol), ("--position-floor", position_floor)):
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{name} must be a finite number >= 0, got {value}")
    if bl_budget not in (None, "best") and not str(bl_budget).isdigit():
        raise UsageError(f"--budget must be a non-negative integer or 'best', got {bl_budget!r}")
    trace = read_trace(trace_path)
    temperature = _trace_temperature(trace, temperature)
    taus_by_req = [[s.accept_length for s in trace.steps_of(r.request_id)] for r in trace.requests]
    taus = [t for r in taus_by_req for t in r]
    if not taus:
        from refcheck.errors import NothingComparedError

        raise NothingComparedError(f"{trace_path}: no verify steps to compare")
    method = method or ("dflash" if trace.prov.budget is None else "ddtree")
    budget = None if bl_budget in (None, "best") else int(bl_budget)
    rows = match(load_baselines(source), model=bl_model, dataset=dataset, temperature=temperature, method=method,
                 budget=budget)
    rows = [r for r in rows if "histogram" not in r.extra] or rows
    row = rows[0]
    bs = trace.prov.block_size or row.block_size
    hist_rows = [r for r in load_baselines() if "histogram" in r.extra and r.method == method
                 and (bl_model is None or r.model.lower() == bl_model.lower())
                 and (dataset is None or r.dataset.lower() == dataset.lower())
                 and (budget is None or r.budget is None or r.budget == budget)]
    positions = positions_from_histogram(hist_rows[0].extra["histogram"]) if hist_rows else None
    if positions is not None and len(positions) != bs - 1:
        positions = None  # a histogram of another block size says nothing per position here
    verdict = acceptance_verdict(taus_by_req, row.tau, rtol=rtol, position_floor=position_floor,
                                 baseline_positions=positions)
    out = {"trace": str(trace_path), "baseline": {"source": row.source, "conditions": row.conditions(), "tau": row.tau,
                                                  "speedup": row.speedup, "file": row.extra.get("file")},
           "matched_rows": len(rows), "verdict": verdict,
           "observed_per_position_acceptance": per_position_acceptance(taus, bs)}
    if hist_rows:
        out["histogram_baseline"] = hist_rows[0].conditions()
        out["histogram_distance_tv"] = histogram_distance(histogram(taus, bs), hist_rows[0].extra["histogram"])
    err.print(f"baseline: {row.conditions()} τ={row.tau} ({row.source})", markup=False)
    err.print(f"trace: mean τ {verdict['mean']:.3f}, CI {verdict['ci']}, {verdict['n_steps']} steps / "
              f"{verdict['n_requests']} requests → {verdict['verdict']}: {verdict['reason']}", markup=False)
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
    code = {"PASS": EXIT_PASS, "FAIL": EXIT_MISMATCH}.get(str(verdict["verdict"]).upper(), 5)
    sys.exit(code)


def _trace_temperature(trace, given: float | None) -> float:
    """The temperature to match baseline rows at: the trace's (one for all its requests). A different
    ``--temperature`` is a usage error: acceptance at one temperature says nothing about another."""
    from refcheck.errors import UsageError

    temps = sorted({float(r.temperature) for r in trace.requests})
    if len(temps) > 1:
        raise UsageError(f"the trace's requests were sampled at several temperatures {temps}: compare one at a time")
    own = temps[0] if temps else 0.0
    if given is not None and not math.isclose(given, own, abs_tol=1e-9):
        raise UsageError(f"--temperature {given:g} but the trace was decoded at temperature {own:g}: its acceptance "
                         f"is not comparable with rows at {given:g}")
    return own
