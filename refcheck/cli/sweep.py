"""``refcheck sweep``: acceptance and speed against node budget (the reference, or SGLang with verdicts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from refcheck.cli.app import err, main, progress_line, quiet
from refcheck.cli.groups import (
    JSON_OPTION,
    ModelOptions,
    OutputOptions,
    ReferenceOptions,
    SamplingOptions,
    SGLangOptions,
    model_options,
    option_group,
    sampling_options,
)
from refcheck.cli.options import DeviceType, unless_given
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, UsageError
from refcheck.prompts import load_prompts

if TYPE_CHECKING:  # ddtree_reference.sampling imports torch: --help must not
    from ddtree_reference.sampling import Sampling


@main.command()
@click.option("--budgets", default="chain,1,4,8,15,16,32,64", show_default=True, help="Comma-separated budgets or 'chain'.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Timed repetitions. With --engine sglang: untraced runs on the warm engine after the captured one.")
@option_group(
    "output", OutputOptions,
    click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("sweep-out"), show_default=True,
                 help="Directory for sweep.json and the PNG plots."),
    click.option("--no-plots", is_flag=True, help="Skip the PNG plots (no matplotlib needed)."),
    JSON_OPTION,
)
@click.option("--engine", type=click.Choice(["reference", "sglang"]), default="reference", show_default=True)
@option_group(
    "ref", ReferenceOptions,
    click.option("--ref-device", type=DeviceType(), default="cuda", show_default=True,
                 help="With --engine sglang: the replay reference's device."),
)
@click.option("--from-traces", "from_traces", multiple=True, type=click.Path(path_type=Path),
              help="With --engine sglang: tabulate saved SGLang traces (repeatable) instead of running the engine; "
                   "rows are grouped by each trace's algorithm and budget.")
@option_group(
    "sglang", SGLangOptions.from_params,
    click.option("--sglang-algorithm", "sglang_algorithms", multiple=True,
                 help="With --engine sglang: algorithms to sweep (default: REFCHECK_DDTREE and REFCHECK_DDTREE_LEAKY_CHAIN)."),
    click.option("--sglang-mem-fraction", "mem_fraction", type=click.FloatRange(0.01, 0.95), default=None,
                 help="With --engine sglang: SGLang's mem_fraction_static per engine (default 0.3)."),
    click.option("--cuda-graphs", is_flag=True, help="With --engine sglang: run each engine with CUDA graphs."),
)
@model_options
@sampling_options
def sweep(budgets: str, repeats: int, output: OutputOptions, engine: str, ref: ReferenceOptions,
          from_traces: tuple[Path, ...], sglang: SGLangOptions, model: ModelOptions, sampling: SamplingOptions) -> None:
    """Acceptance and speed against node budget: τ, histograms, per-phase time, speedup over target-only.

    With --engine sglang: per SGLang algorithm and budget, τ, step time, tokens/s and the replay verdict."""
    from refcheck.outputs import check_output_dir
    from refcheck.sweep import parse_budgets, run_sweep

    quiet()
    drawn = sampling.sampling()  # out of range: exit 2
    if drawn is not None and from_traces:
        raise UsageError("--temperature with --from-traces: a recorded trace carries its own sampling parameters")
    blist = parse_budgets(budgets)
    out_dir, no_plots = output.out, output.no_plots
    check_output_dir(out_dir, "--out", _out_files(engine, no_plots, blist, sglang.algorithms, bool(from_traces)))
    if from_traces and engine != "sglang":
        raise UsageError("--from-traces tabulates SGLang traces: add --engine sglang")
    runner_options = sglang.runner_options()
    if runner_options and engine != "sglang":
        raise UsageError(f"--{'sglang-mem-fraction' if 'mem_fraction' in runner_options else 'cuda-graphs'} "
                         "needs --engine sglang")
    if engine == "sglang":
        _sweep_sglang(blist, repeats, output, sglang, ref, model, from_traces, drawn)
        return
    spec = model.spec(drawn, budget=blist[0])
    prompts = load_prompts(model.prompts_file, spec.resolved_dirs()[0])
    if not no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise UsageError("plotting backend missing: pip install matplotlib (or pass --no-plots)") from exc
    result = run_sweep(spec, prompts, blist, repeats, progress=progress_line)
    plots, late = _write_sweep(result, out_dir, no_plots)
    at = f" · T={drawn.temperature:g} top-k {drawn.top_k} top-p {drawn.top_p:g}" if drawn else ""
    table = Table(title=f"refcheck sweep · {result['model']} · {model.dtype} · {model.device} · {model.drafter} drafter · "
                  f"{repeats} repeat(s)" + at)
    for col in ("budget", "τ", "τ range (req.)", "steps", "draft ms", "tree ms", "verify ms", "commit ms", "tok/s", "speedup", "lossless"):
        table.add_column(col, justify="right")
    for r in result["budgets"]:
        ms = r["ms_per_step"]
        sp = r["tau_spread_over_requests"]
        table.add_row(r["budget"], f"{r['mean_tau']:.2f}", f"{sp['min']:.2f}–{sp['max']:.2f}", str(r["steps"]),
                      *(f"{ms[p]['median']:.2f}" for p in ("draft", "tree", "verify", "commit")),
                      f"{r['tokens_per_s']['median']:.1f}", f"{r['speedup_vs_autoregressive']:.2f}×",
                      "yes" if r["lossless"] else "[red]NO[/]")
    err.print(table)
    err.print(f"target-only: {result['autoregressive_tokens_per_s']['median']:.1f} tok/s; wrote {out_dir / 'sweep.json'}"
              + "".join(f", {p}" for p in plots), markup=False)
    if output.as_json:
        click.echo(json.dumps(result, indent=2))
    if late is not None:
        raise late
    sys.exit(EXIT_PASS if all(r["lossless"] for r in result["budgets"]) else EXIT_MISMATCH)

#: the plots ``sweep`` writes beside sweep.json (refcheck/sweep.py: plot_sweep)
PLOTS = ("sweep_tau_speed.png", "sweep_acceptance_histogram.png")


def _out_files(engine: str, no_plots: bool, budgets: list, algorithms: tuple[str, ...], from_traces: bool) -> list[str]:
    """The files a sweep writes in --out: each must be a regular file or absent before it starts."""
    if engine != "sglang":
        return ["sweep.json", *(() if no_plots else PLOTS)]
    from refcheck.sglang.sweep import DEFAULT_ALGORITHMS

    traces = [] if from_traces else [f"traces/{a}-b{b}.arrow" for a in (algorithms or DEFAULT_ALGORITHMS) for b in budgets]
    return ["sweep-sglang.json", *traces]


def _write_sweep(result: dict, out_dir: Path, no_plots: bool) -> tuple[list[Path], Exception | None]:
    """sweep.json and the plots in ``out_dir``: (the plots written, the error to raise after the report or None)."""
    from refcheck.atomic_file import atomic_write_bytes
    from refcheck.outputs import late_write_error
    from refcheck.sweep import plot_sweep

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out_dir / "sweep.json", (json.dumps(result, indent=2) + "\n").encode())
        return ([] if no_plots else plot_sweep(result, out_dir)), None
    except OSError as exc:  # the table and the JSON still print; the error follows them
        return [], late_write_error(out_dir, exc, "the sweep results")


def _sweep_sglang(blist: list[int | None], repeats: int, output: OutputOptions, sglang: SGLangOptions,
                  ref: ReferenceOptions, model: ModelOptions, from_traces: tuple[Path, ...] = (),
                  sampling: Sampling | None = None) -> None:
    """The SGLang sweep (or the table of ``from_traces``): sweep-sglang.json in ``--out``, the table, exit 0."""
    from refcheck.sglang.sweep import DEFAULT_ALGORITHMS, run_sglang_sweep, tabulate_traces
    from refcheck.trace.io import atomic_write_bytes, read_trace

    out_dir = output.out
    if from_traces:
        result = tabulate_traces([read_trace(p) for p in from_traces], ref_device=ref.ref_device)
        dtype = result["dtype"]
    else:
        if any(b is None or b < 1 for b in blist):
            raise UsageError("--engine sglang sweeps tree budgets >= 1 (chain mode is --sglang-algorithm DFLASH in diff)")
        dtype = unless_given("dtype", model.dtype, "bfloat16")
        # T > 0: REFCHECK_DDTREE samples with refcheck's keyed sampler (exact replay), NONE / NGRAM with SGLang's own
        # generator (the distributional test); DFLASH is refused by the runner
        spec = model.spec(sampling, budget=blist[0], dtype=dtype, device="cuda", drafter="dflash")
        result = run_sglang_sweep(spec, load_prompts(model.prompts_file, spec.resolved_dirs()[0]), blist, repeats,
                                  sglang.algorithms or DEFAULT_ALGORITHMS, ref_device=ref.ref_device,
                                  save_dir=out_dir / "traces", progress=progress_line,
                                  runner_options=sglang.runner_options())
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "sweep-sglang.json", (json.dumps(result, indent=2) + "\n").encode())
    at = f" · T={result['temperature']:g}" if result.get("temperature") else ""
    table = Table(title=f"refcheck sweep · SGLang · {result['model']} · {dtype} · {result['repeats']} repeat(s){at}")
    for col in ("algorithm", "budget", "τ", "τ reference (same rule)", "τ difference by cause", "steps", "step ms",
                "of which draft ms", "tok/s warm", "tok/s captured", "verdict", "first divergence", "first state failure"):
        table.add_column(col)
    for r in result["rows"]:
        ms, ts, dm, cold = r["step_ms"], r["tokens_per_s"], r.get("draft_ms") or {}, r.get("cold_tokens_per_s") or {}
        same = "" if r.get("repeats_match") is not False else " (repeats differ!)"
        acc = r.get("acceptance_account") or {}
        causes = ", ".join(f"{v:+.2f} {c}" for c, v in (acc.get("by_cause") or {}).items()) if acc.get("steps") else \
            ("no drafts recorded" if acc.get("unrecorded_steps") else "-")
        table.add_row(r["algorithm"], str(r["budget"]), f"{r['mean_tau']:.2f}" if r["mean_tau"] else "-",
                      f"{acc['tau_reference']:.2f}" if acc.get("steps") else "-", causes or "none", str(r["steps"]),
                      f"{ms['median']:.1f} ({ms['min']:.1f}–{ms['max']:.1f})" if ms else "-",
                      f"{dm['median']:.1f}" if dm else "-",
                      (f"{ts['median']:.0f} ({ts['min']:.0f}–{ts['max']:.0f})" if ts else "-") + same,
                      f"{cold['median']:.0f}" if cold else "-",
                      r["verdict"] + (f" ({', '.join(r['fail_categories'])})" if r["fail_categories"] else ""),
                      r["first_divergence"] or "-", r.get("first_state_failure") or "-")
    err.print(table)
    err.print(f"wrote {out_dir / 'sweep-sglang.json'}", markup=False)
    if output.as_json:
        click.echo(json.dumps(result, indent=2))
    sys.exit(EXIT_PASS)
