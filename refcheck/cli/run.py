"""``refcheck run``: decode a prompt set with the reference and report acceptance and the AR check."""

from __future__ import annotations

import json
import statistics
import sys

import click
from rich.table import Table

from refcheck.budget import budget_json
from refcheck.cli.app import err, main, progress_line
from refcheck.cli.groups import (
    JSON_OPTION,
    ModelOptions,
    OutputOptions,
    SamplingOptions,
    model_options,
    option_group,
    sampling_options,
)
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS
from refcheck.prompts import load_prompts, prompt_set_hash
from refcheck.spec import EngineSpec

ENGINES = ("reference",)  # live engines; faults are "fault:<name>" (see `refcheck selftest`)


@main.command()
@click.option("--engine", type=click.Choice(ENGINES), default="reference", show_default=True)
@click.option("--check-ar", is_flag=True, help="Compare every prompt's tokens with target-only greedy decoding "
              "(at --temperature > 0: target-only sampling with the same keys).")
@model_options
@option_group("output", OutputOptions, JSON_OPTION)
@sampling_options
def run(engine: str, check_ar: bool, model: ModelOptions, output: OutputOptions, sampling: SamplingOptions) -> None:
    """Decode prompts with an engine and report acceptance (and the AR check)."""
    from refcheck.reference_runner import ReferenceRunner

    spec = model.spec(sampling.sampling())
    prompts = load_prompts(model.prompts_file, spec.resolved_dirs()[0])
    runner = ReferenceRunner(spec)
    runs = runner.run(prompts, check_ar=check_ar, progress=progress_line)
    report = _run_report(engine, spec, prompts, runs)
    _print_run_table(report)
    if output.as_json:
        click.echo(json.dumps(report, indent=2))
    failed = check_ar and any(r.ar_match is False for r in runs)
    sys.exit(EXIT_MISMATCH if failed else EXIT_PASS)

def _run_report(engine: str, spec: EngineSpec, prompts, runs: list) -> dict:
    taus = [t for r in runs for t in r.result.accept_lengths]
    verify_ms = [1e3 * s.timings["verify"] for r in runs for s in r.result.steps]
    return {
        "engine": engine,
        "budget": budget_json(spec.budget),
        **({"sampling": spec.sampling.to_json()} if spec.sampled else {}),
        "drafter": spec.drafter,
        "dtype": spec.dtype,
        "device": spec.device,
        "model": str(spec.resolved_dirs()[0]),
        "prompt_set_sha256": prompt_set_hash(prompts),
        "tau_convention": "accepted drafted tokens + 1 (bonus counted)",
        "mean_tau": statistics.fmean(taus) if taus else 0.0,
        "steps": len(taus),
        "verify_ms_median": statistics.median(verify_ms) if verify_ms else None,
        "prompts": [
            {
                "id": r.prompt.id,
                "kind": r.prompt.kind,
                "output_ids": r.result.output_ids,
                "accept_lengths": r.result.accept_lengths,
                "mean_tau": r.result.mean_tau,
                "ar": "unchecked" if r.ar_match is None else ("pass" if r.ar_match else "fail"),
                "first_ar_mismatch": r.first_ar_mismatch,
            }
            for r in runs
        ],
    }

def _print_run_table(report: dict) -> None:
    from refcheck.cli.reports import name_cell

    table = Table(title=f"refcheck run · {report['engine']} · budget {report['budget']} · {report['drafter']} drafter")
    for col in ("prompt", "kind", "tokens", "steps", "τ", "AR"):
        table.add_column(col, justify="right" if col in ("tokens", "steps", "τ") else "left")
    for p in report["prompts"]:
        ar = {"pass": "[green]pass[/]", "fail": f"[red]FAIL @{p['first_ar_mismatch']}[/]"}.get(p["ar"], "-")
        table.add_row(name_cell(p["id"]), name_cell(p["kind"]), str(len(p["output_ids"])), str(len(p["accept_lengths"])), f"{p['mean_tau']:.2f}", ar)
    err.print(table)
    vm = report["verify_ms_median"]
    err.print(f"mean τ {report['mean_tau']:.3f} over {report['steps']} steps; median verify {vm:.1f} ms" if vm else "no verify steps")
