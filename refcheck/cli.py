"""The ``refcheck`` command line.

Contract: every command prints human output (rich tables, progress) on stderr and, with
``--json``, only JSON on stdout. User errors never show a traceback: they print
``refcheck: error: <message>`` and exit with the code documented in :mod:`refcheck.errors`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, UsageError, exit_code_for
from refcheck.models import BUILTIN_PAIRS, DEFAULT_PAIR
from refcheck.prompts import load_prompts, prompt_set_hash
from refcheck.runners.reference import DRAFTERS, DTYPES, EngineSpec, PromptRun, ReferenceRunner

ENGINES = ("reference",)
err = Console(stderr=True)


class BudgetType(click.ParamType):
    """A node budget: a non-negative integer, or ``chain`` for vanilla DFlash (top-1 per depth)."""

    name = "budget"

    def convert(self, value, param, ctx):  # type: ignore[override]
        if value is None or isinstance(value, int):
            if isinstance(value, int) and value < 0:
                self.fail(f"budget must be >= 0 or 'chain', got {value}", param, ctx)
            return value
        if str(value).lower() == "chain":
            return None
        try:
            b = int(value)
        except ValueError:
            self.fail(f"budget must be a non-negative integer or 'chain', got {value!r}", param, ctx)
        if b < 0:
            self.fail(f"budget must be >= 0 or 'chain', got {b}", param, ctx)
        return b


def _parse_ids(text: str | None) -> frozenset[int]:
    if not text:
        return frozenset()
    try:
        return frozenset(int(t) for t in text.split(","))
    except ValueError as exc:
        raise UsageError(f"--stop must be comma-separated token ids, got {text!r}") from exc


def model_options(f):
    """Options shared by every command that runs models."""
    opts = [
        click.option("--model", "model_dir", type=click.Path(path_type=Path), help="Target checkpoint directory (default: built-in)."),
        click.option("--draft", "draft_dir", type=click.Path(path_type=Path), help="DFlash draft checkpoint directory."),
        click.option("--pair", type=click.Choice(BUILTIN_PAIRS), default=DEFAULT_PAIR, show_default=True, help="Built-in model pair."),
        click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), help="Prompts JSONL (default: built-in)."),
        click.option("--budget", type=BudgetType(), default="15", show_default=True, help="Node budget B, or 'chain'."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True),
        click.option("--device", default="cpu", show_default=True),
        click.option("--drafter", type=click.Choice(DRAFTERS), default="dflash", show_default=True,
                     help="'scripted' = the target's own continuation with decoys (testing)."),
        click.option("--stop", "stop_ids", default=None, help="Comma-separated stop token ids."),
        click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _spec(model_dir, draft_dir, pair, budget, max_new_tokens, dtype, device, drafter, stop_ids) -> EngineSpec:
    return EngineSpec(
        model_dir=model_dir, draft_dir=draft_dir, pair=pair, dtype=dtype, device=device, drafter=drafter,
        budget=budget, max_new_tokens=max_new_tokens, stop_token_ids=_parse_ids(stop_ids),
    )


@click.group()
@click.version_option(package_name="refcheck")
def main() -> None:
    """refcheck: correctness verification and reference diffs for tree speculative decoding."""


@main.command()
@click.option("--engine", type=click.Choice(ENGINES), default="reference", show_default=True)
@click.option("--check-ar", is_flag=True, help="Compare every prompt's tokens with target-only greedy decoding.")
@model_options
def run(engine, check_ar, model_dir, draft_dir, pair, prompts_file, budget, max_new_tokens, dtype, device, drafter, stop_ids, as_json):
    """Decode prompts with an engine and report acceptance (and the AR check)."""
    spec = _spec(model_dir, draft_dir, pair, budget, max_new_tokens, dtype, device, drafter, stop_ids)
    prompts = load_prompts(prompts_file)
    runner = ReferenceRunner(spec)
    runs = runner.run(prompts, check_ar=check_ar, progress=lambda i, p: err.print(f"[{i + 1}/{len(prompts)}] {p.id}", markup=False))
    report = _run_report(engine, spec, prompts, runs)
    _print_run_table(report)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    failed = check_ar and any(r.ar_match is False for r in runs)
    sys.exit(EXIT_MISMATCH if failed else EXIT_PASS)


def _run_report(engine: str, spec: EngineSpec, prompts, runs: list[PromptRun]) -> dict:
    taus = [t for r in runs for t in r.result.accept_lengths]
    verify_ms = [1e3 * s.timings["verify"] for r in runs for s in r.result.steps]
    return {
        "engine": engine,
        "budget": "chain" if spec.budget is None else spec.budget,
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
    table = Table(title=f"refcheck run · {report['engine']} · budget {report['budget']} · {report['drafter']} drafter")
    for col in ("prompt", "kind", "tokens", "steps", "τ", "AR"):
        table.add_column(col, justify="right" if col in ("tokens", "steps", "τ") else "left")
    for p in report["prompts"]:
        ar = {"pass": "[green]pass[/]", "fail": f"[red]FAIL @{p['first_ar_mismatch']}[/]"}.get(p["ar"], "-")
        table.add_row(p["id"], p["kind"], str(len(p["output_ids"])), str(len(p["accept_lengths"])), f"{p['mean_tau']:.2f}", ar)
    err.print(table)
    vm = report["verify_ms_median"]
    err.print(f"mean τ {report['mean_tau']:.3f} over {report['steps']} steps; median verify {vm:.1f} ms" if vm else "no verify steps")


def entry() -> None:
    """Console-script entry: run the group and turn user errors into exit codes."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - mapped to a code below, re-raised if unknown
        code = exit_code_for(exc)
        if code is None:
            raise
        click.echo(f"refcheck: error: {exc}", err=True)
        sys.exit(code)
