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

from refcheck.errors import EXIT_GOLDEN, EXIT_MISMATCH, EXIT_PASS, GoldenError, UsageError, exit_code_for
from refcheck.models import BUILTIN_PAIRS, DEFAULT_PAIR
from refcheck.prompts import load_prompts, prompt_set_hash
from refcheck.runners.reference import DRAFTERS, DTYPES, EngineSpec, PromptRun, ReferenceRunner

ENGINES = ("reference",)  # live engines; faults are "fault:<name>" (see `refcheck selftest`)
err = Console(stderr=True)
if not err.is_terminal:  # logs and CI: wide enough that tables do not wrap every cell
    err = Console(stderr=True, width=160)


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


def _report_table(reports, title: str) -> None:
    table = Table(title=title)
    for col in ("case", "mode", "checks", "pass", "benign", "triaged", "fail", "unsupp.", "first divergence"):
        table.add_column(col)
    for r in reports:
        c = r.counts
        fd = r.first_divergence()
        if r.expect_failure is not None:
            tag = "[green]expected failure caught[/]" if r.expected_failure_met else "[red]expected failure NOT caught[/]"
            f = next(iter(fd.values()), None)
            first = tag + (f"\n{f.request_id} step {f.step} · {f.category}: {f.message}" if f else f" ({r.expect_failure})")
        elif fd:
            f = next(iter(fd.values()))
            where = f"{f.request_id} step {f.step} node {f.node} · {f.category}"
            if f.layer is not None:
                where += f" · layer {f.layer} ({f.layer_type})"
            first = f"[red]{where}[/]\n{f.message}"
        else:
            first = "[green]none[/]"
        table.add_row(r.case, r.mode, str(sum(r.checks.values())), str(c["pass"]), str(c["benign_tie"]),
                      str(c["triaged"]), str(c["fail"]), str(c["unsupported"] + c["skipped"]), first)
    err.print(table)
    for r in reports:
        st = r.stats.get("steps")
        if st:
            devs = [f"max |Δ log-prob| {r.stats['max_logprob_abs']:.3g}"] if "max_logprob_abs" in r.stats else []
            devs += [f"max rel L2 {k[11:]} {r.stats[k]:.3g}" for k in sorted(r.stats) if k.startswith("max_rel_l2_")]
            err.print(f"{r.case}: replayed steps: {st.get('pass', 0)} pass · {st.get('benign_tie', 0)} benign tie · "
                      + (f"{st['triaged']} triaged · " if st.get("triaged") else "") + f"{st.get('fail', 0)} fail" + (" · " + ", ".join(devs) if devs else ""))
        if r.stats.get("mean_tau_engine") is not None:
            ref = r.stats.get("mean_tau_reference")
            err.print(f"{r.case}: mean τ engine {r.stats['mean_tau_engine']:.3f}"
                      + (f", reference {ref:.3f}" if ref is not None else "") + " (bonus counted)")


def _finish(reports, as_json: bool, extra: dict | None = None) -> None:
    from refcheck.errors import EXIT_NOTHING

    if as_json:
        click.echo(json.dumps({**(extra or {}), "reports": [r.to_json() for r in reports]}, indent=2, default=str))
    codes = [r.exit_code for r in reports]
    if not reports or all(c == EXIT_NOTHING for c in codes):
        sys.exit(EXIT_NOTHING)
    sys.exit(EXIT_MISMATCH if EXIT_MISMATCH in codes else EXIT_PASS)


def _sglang_engine(engine, algorithm, cuda_graphs, ngram_breadth, tp, dtype, device):
    """Fold the SGLang options into the engine name and options; SGLang runs bf16 on the GPU unless told."""
    is_sglang = bool(engine) and (engine == "sglang" or engine.startswith("sglang:"))
    if not is_sglang:
        if algorithm or cuda_graphs or tp > 1:
            raise UsageError("--sglang-algorithm, --cuda-graphs and --tp need --engine sglang")
        return engine, None, dtype, device
    if algorithm:
        if ":" in engine and engine.split(":", 1)[1].upper() != algorithm.upper():
            raise UsageError(f"--engine {engine} and --sglang-algorithm {algorithm} disagree")
        engine = f"sglang:{algorithm.upper()}"
    ctx = click.get_current_context()
    if ctx.get_parameter_source("dtype") == click.core.ParameterSource.DEFAULT:
        dtype = "bfloat16"
    if ctx.get_parameter_source("device") == click.core.ParameterSource.DEFAULT:
        device = "cuda"
    return engine, {"cuda_graphs": cuda_graphs, "ngram_breadth": ngram_breadth, "tp": tp}, dtype, device


@main.command()
@click.option("--engine", default=None,
              help="Run this live engine instead of reading goldens: reference, zlab, sglang[:ALGORITHM], fault:NAME.")
@click.option("--against", "against", type=click.Path(path_type=Path), multiple=True, help="Engine trace file(s) to diff.")
@click.option("--mode", type=click.Choice(["replay", "free", "both"]), default="both", show_default=True)
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None, help="Golden directory.")
@click.option("--ref-dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@click.option("--ref-device", default="cpu", show_default=True)
@click.option("--save-trace", type=click.Path(path_type=Path), default=None, help="Write the live engine's trace here.")
@click.option("--workers", "--gpus", "workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes to spread the prompts over (one per GPU: worker i uses cuda:i).")
@click.option("--full-state", is_flag=True, help="Record full KV/state tensors in the trace (not only sketches).")
@click.option("--sglang-algorithm", default=None,
              help="With --engine sglang: NONE (target-only), DFLASH, NGRAM, REFCHECK_DDTREE (refcheck's DDTree on "
                   "SGLang; REFCHECK_DDTREE_LEAKY_CHAIN is its leaky twin), or any algorithm your SGLang registers.")
@click.option("--cuda-graphs", is_flag=True, help="With --engine sglang: run SGLang with CUDA graphs (off by default).")
@click.option("--ngram-breadth", type=click.IntRange(min=1), default=10, show_default=True,
              help="With --sglang-algorithm NGRAM: speculative_ngram_max_bfs_breadth.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --engine sglang: tensor parallelism (state captured on every rank and combined).")
@click.option("--layer-sketches", is_flag=True,
              help="With --engine sglang: sketch every target layer's output (forward hooks) so a failing node gets "
                   "layer bisection; slower.")
@click.option("--steps", is_flag=True, help="Also print one row per verify step: tree size, τ, verdict, first finding.")
@click.option("--triage-isolated", is_flag=True,
              help="Report a node whose log-probs deviate while its argmax and every descendant agree as triaged "
                   "(rounding at that node), not failed. Off by default.")
@click.option("--ref-shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --against and --mode replay: split the reference by layers over N processes (N GPUs with "
                   "--ref-device cuda, NCCL; gloo on CPUs).")
@model_options
def diff(engine, against, mode, golden_dir, ref_dtype, ref_device, save_trace, workers, full_state, sglang_algorithm,
         cuda_graphs, ngram_breadth, tp, layer_sketches, steps, triage_isolated, ref_shards, model_dir, draft_dir, pair, prompts_file, budget, max_new_tokens, dtype, device,
         drafter, stop_ids, as_json):
    """Diff an engine against the reference: per prompt and verify step, tokens, log-probs, acceptance, KV and state.

    With no --engine / --against: the golden engine traces in golden/ for this budget and pair."""
    from refcheck.diff.session import DiffSession
    from refcheck.golden import apply_triage, default_golden_dir, live_provenance_reasons, verify
    from refcheck.trace.io import read_trace, write_trace

    session = DiffSession()
    reports = []
    traces = []  # the engine trace behind each report (for --steps)
    if ref_shards > 1 and not against:
        raise UsageError("--ref-shards works with --against TRACE (record live engines with --save-trace first)")
    if engine:
        from refcheck.parallel import engine_decoder, engine_shard, merge_reports, merge_traces, run_parallel, split
        from refcheck.trace.io import trace_from_bytes

        engine, engine_opts, dtype, device = _sglang_engine(engine, sglang_algorithm, cuda_graphs, ngram_breadth, tp,
                                                            dtype, device)
        if layer_sketches:
            if engine_opts is None:
                raise UsageError("--layer-sketches needs --engine sglang")
            engine_opts["layer_sketches"] = True
        spec = _spec(model_dir, draft_dir, pair, budget, max_new_tokens, dtype, device, drafter, stop_ids)
        prompts = load_prompts(prompts_file)
        engine_decoder(engine)  # unknown engine: a usage error before any process starts
        shards = split(prompts, workers)
        err.print(f"running live engine {engine} on {len(prompts)} prompts in {len(shards)} process(es)", markup=False)
        results = run_parallel(engine_shard, [(engine, spec, sh, mode, ref_dtype, ref_device, i, len(shards), full_state,
                                               engine_opts) for i, sh in enumerate(shards)], len(shards))
        trace = merge_traces([trace_from_bytes(b) for b, _ in results], [p.id for p in prompts], prompt_set_hash(prompts))
        if save_trace:
            write_trace(trace, save_trace)
        reports.append(merge_reports([r for _, r in results], engine, mode))
        traces.append(trace)
    elif against:
        for path in against:
            err.print(f"diffing {path}" + (f" against the reference sharded over {ref_shards} processes" if ref_shards > 1
                                            else ""), markup=False)
            traces.append(read_trace(path))
            if ref_shards > 1:
                from refcheck.sharding import sharded_diff

                reports.append(sharded_diff(traces[-1], Path(path).stem, mode, ref_shards, ref_dtype, ref_device))
            else:
                reports.append(session.diff(traces[-1], Path(path).stem, mode, ref_dtype=ref_dtype,
                                            ref_device=ref_device, triage_isolated=triage_isolated))
    else:
        gdir = golden_dir or default_golden_dir()
        manifest = verify(gdir)
        want_budget = "chain" if budget is None else budget
        model = f"builtin:{pair}" if model_dir is None else str(model_dir)
        names = [n for n, e in sorted(manifest.cases.items())
                 if e.provenance.get("budget") == want_budget and e.provenance.get("model") == model
                 and e.provenance.get("expect", "pass") == "pass"]
        if not names:
            raise GoldenError(f"no golden trace for budget {want_budget} on {model} in {gdir} "
                              "(create them: refcheck golden regen --accept --reason ...)")
        for name in names:
            trace = read_trace(gdir / manifest.cases[name].file)
            stale = live_provenance_reasons(trace, session)
            if stale:
                raise GoldenError(f"stale golden {name}: " + "; ".join(stale))
            err.print(f"diffing golden {name} against the live reference", markup=False)
            strict = trace.provenance.get("engine", {}).get("name") == "reference"
            report = session.diff(trace, name, mode, strict_acceptance=strict, ref_dtype=ref_dtype, ref_device=ref_device,
                                  triage_isolated=triage_isolated)
            apply_triage(report, manifest.cases[name].provenance.get("triaged", []))
            reports.append(report)
            traces.append(trace)
    _report_table(reports, f"refcheck diff · budget {'chain' if budget is None else budget} · mode {mode}")
    if steps:
        for report, trace in zip(reports, traces):
            _steps_table(report, trace)
    _finish(reports, as_json)


def _steps_table(report, trace, limit: int = 500) -> None:
    """One row per verify step of the engine trace: its tree, τ and the replay's verdict there."""
    from refcheck.diff.findings import Verdict

    by_step: dict[tuple, list] = {}
    for f in report.findings:
        if f.step is not None and f.step >= 0:
            by_step.setdefault((f.request_id, f.step), []).append(f)
    table = Table(title=f"{report.case}: verify steps")
    for col in ("request", "step", "position", "nodes", "τ", "verdict", "categories", "first finding"):
        table.add_column(col)
    for s in trace.steps[:limit]:
        fs = by_step.get((s.request_id, s.step), [])
        verdicts = {f.verdict for f in fs}
        worst = next((v for v in (Verdict.FAIL, Verdict.TRIAGED, Verdict.BENIGN_TIE) if v in verdicts), None)
        shown = [f for f in fs if f.verdict == worst] if worst else []
        style = {Verdict.FAIL: "red", Verdict.TRIAGED: "yellow", Verdict.BENIGN_TIE: "cyan"}.get(worst, "green")
        first = shown[0] if shown else None
        table.add_row(s.request_id, str(s.step), str(s.committed_len), str(len(s.tree_tokens)), str(s.accept_length),
                      f"[{style}]{worst.value if worst else 'pass'}[/]", ", ".join(sorted({f.category for f in shown})),
                      (f"node {first.node} " if first and first.node is not None else "")
                      + (f"layer {first.layer} " if first and first.layer is not None else "")
                      + (first.message[:90] if first else ""))
    err.print(table)
    if len(trace.steps) > limit:
        err.print(f"{report.case}: {len(trace.steps) - limit} more steps not shown (see --json)", markup=False)


@main.command()
@click.argument("golden_dir", required=False, type=click.Path(path_type=Path))
@click.option("--case", "cases", multiple=True, help="Only these cases.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Processes to spread cases over.")
@click.option("--json", "as_json", is_flag=True)
def gate(golden_dir, cases, workers, as_json):
    """CI gate: verify, then diff every golden case against the live reference (strict about skips)."""
    import time

    from refcheck.diff.session import DiffSession
    from refcheck.golden import default_golden_dir
    from refcheck.golden import gate as run_gate

    t0 = time.perf_counter()
    _quiet()
    reports = run_gate(golden_dir or default_golden_dir(), DiffSession(), list(cases) or None,
                       progress=lambda n: err.print(f"gate: {n}", markup=False), workers=workers)
    _report_table(reports, "refcheck gate")
    wall = time.perf_counter() - t0
    err.print(f"gate: {len(reports)} cases in {wall:.1f} s", markup=False)
    _finish(reports, as_json, {"wall_s": wall})


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
    from refcheck.diff.session import DiffSession
    from refcheck.golden import default_golden_dir, regenerate

    _quiet()
    reviews = regenerate(golden_dir or default_golden_dir(), list(cases) or None, reason, accept, DiffSession(),
                         progress=lambda n: err.print(f"regen: {n}", markup=False))
    table = Table(title="golden regen review" + ("" if accept else " (pending: nothing replaced)"))
    for col in ("case", "status", "τ old → new", "first divergences", "provenance changes"):
        table.add_column(col)
    for r in reviews:
        tau = f"{r.tau_old:.3f} → {r.tau_new:.3f}" if r.tau_old is not None else f"- → {r.tau_new:.3f}"
        div = ", ".join(f"{k}@{v}" for k, v in r.first_divergence.items()) or "-"
        table.add_row(r.case, r.status, tau, div, "; ".join(r.provenance_changes) or "-")
    err.print(table)
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
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None)
def golden_add(trace_path, case, expect, allow_unsupported, reason, triage, golden_dir):
    """Store an engine's trace (SGLang, z-lab, ...) as a golden case the gate re-checks."""
    from refcheck.golden import add_trace, default_golden_dir

    path = add_trace(golden_dir or default_golden_dir(), trace_path, case, expect,
                     [c for c in allow_unsupported.split(",") if c], reason, list(triage))
    err.print(f"added golden {case}: {path}", markup=False)
    sys.exit(EXIT_PASS)


@golden.command("verify")
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None)
def golden_verify(golden_dir):
    """Check every golden trace's sha256 against MANIFEST.json."""
    from refcheck.golden import default_golden_dir, verify

    gdir = golden_dir or default_golden_dir()
    manifest = verify(gdir)
    err.print(f"{len(manifest.cases)} golden traces match {gdir / 'MANIFEST.json'}", markup=False)
    sys.exit(EXIT_PASS)


@main.command()
@click.option("--fault", "faults", multiple=True, help="Only these faults.")
@click.option("--json", "as_json", is_flag=True)
def selftest(faults, as_json):
    """Inject every known engine bug class into the reference and check that the diff catches each."""
    from refcheck.selftest.run import selftest as run_selftest

    _quiet()
    rows = run_selftest(list(faults) or None, progress=lambda n: err.print(f"selftest: {n}", markup=False))
    table = Table(title="refcheck selftest")
    for col in ("fault", "detected", "expected category", "first divergence", "ok"):
        table.add_column(col)
    for r in rows:
        f = r.first
        where = "-" if f is None else f"{f['request_id']} step {f['step']} node {f['node']} · {f['category']}" + (
            f" · layer {f['layer']} ({f['layer_type']})" if f.get("layer") is not None else "")
        table.add_row(r.fault, "yes" if r.detected else "no", r.expected, where, "[green]ok[/]" if r.ok else "[red]NO[/]")
    err.print(table)
    if as_json:
        click.echo(json.dumps({"rows": [r.to_json() for r in rows]}, indent=2, default=str))
    sys.exit(EXIT_PASS if all(r.ok for r in rows) else EXIT_MISMATCH)


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
    info = {"path": str(path), "schema_version": t.schema_version, "bytes": size, "requests": len(t.requests),
            "steps": len(t.steps), "bytes_per_step": size / max(len(t.steps), 1),
            "mean_tau": statistics.fmean(taus) if taus else None, "provenance": t.provenance}
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        for k, v in info.items():
            err.print(f"{k}: {v}", markup=False)
    sys.exit(EXIT_PASS)


@main.command()
@click.option("--budgets", default="chain,1,4,8,15,16,32,64", show_default=True, help="Comma-separated budgets or 'chain'.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("sweep-out"), show_default=True,
              help="Directory for sweep.json and the PNG plots.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots (no matplotlib needed).")
@click.option("--engine", type=click.Choice(["reference", "sglang"]), default="reference", show_default=True)
@click.option("--sglang-algorithm", "sglang_algorithms", multiple=True,
              help="With --engine sglang: algorithms to sweep (default: REFCHECK_DDTREE and REFCHECK_DDTREE_LEAKY_CHAIN).")
@click.option("--ref-device", default="cuda", show_default=True, help="With --engine sglang: the replay reference's device.")
@model_options
def sweep(budgets, repeats, out_dir, no_plots, engine, sglang_algorithms, ref_device, model_dir, draft_dir, pair,
          prompts_file, budget, max_new_tokens, dtype, device, drafter, stop_ids, as_json):
    """Acceptance and speed against node budget: τ, histograms, per-phase time, speedup over target-only.

    With --engine sglang: per SGLang algorithm and budget, τ, step time, tokens/s and the replay verdict."""
    from refcheck.sweep import parse_budgets, plot_sweep, run_sweep
    from refcheck.trace.io import atomic_write_bytes

    _quiet()
    blist = parse_budgets(budgets)
    if engine == "sglang":
        _sweep_sglang(blist, repeats, out_dir, sglang_algorithms, ref_device, model_dir, draft_dir, pair, prompts_file,
                      max_new_tokens, dtype, stop_ids, as_json)
        return
    spec = _spec(model_dir, draft_dir, pair, blist[0], max_new_tokens, dtype, device, drafter, stop_ids)
    prompts = load_prompts(prompts_file)
    if not no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise UsageError("plotting backend missing: pip install matplotlib (or pass --no-plots)") from exc
    result = run_sweep(spec, prompts, blist, repeats, progress=lambda r, b: err.print(f"repeat {r} budget {b}", markup=False))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "sweep.json", (json.dumps(result, indent=2) + "\n").encode())
    plots = [] if no_plots else plot_sweep(result, out_dir)
    table = Table(title=f"refcheck sweep · {result['model']} · {dtype} · {device} · {drafter} drafter · {repeats} repeat(s)")
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
    if as_json:
        click.echo(json.dumps(result, indent=2))
    sys.exit(EXIT_PASS if all(r["lossless"] for r in result["budgets"]) else EXIT_MISMATCH)


def _sweep_sglang(blist, repeats, out_dir, algorithms, ref_device, model_dir, draft_dir, pair, prompts_file,
                  max_new_tokens, dtype, stop_ids, as_json) -> None:
    from refcheck.sweep_sglang import DEFAULT_ALGORITHMS, run_sglang_sweep
    from refcheck.trace.io import atomic_write_bytes

    if any(b is None or b < 1 for b in blist):
        raise UsageError("--engine sglang sweeps tree budgets >= 1 (chain mode is --sglang-algorithm DFLASH in diff)")
    if click.get_current_context().get_parameter_source("dtype") == click.core.ParameterSource.DEFAULT:
        dtype = "bfloat16"
    spec = _spec(model_dir, draft_dir, pair, blist[0], max_new_tokens, dtype, "cuda", "dflash", stop_ids)
    result = run_sglang_sweep(spec, load_prompts(prompts_file), blist, repeats, tuple(algorithms) or DEFAULT_ALGORITHMS,
                              ref_device=ref_device,
                              progress=lambda a, b, r: err.print(f"{a} budget {b} repeat {r}", markup=False))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "sweep-sglang.json", (json.dumps(result, indent=2) + "\n").encode())
    table = Table(title=f"refcheck sweep · SGLang · {result['model']} · {dtype} · {repeats} repeat(s)")
    for col in ("algorithm", "budget", "τ", "steps", "step ms", "tok/s", "verdict", "first divergence"):
        table.add_column(col)
    for r in result["rows"]:
        ms, ts = r["step_ms"], r["tokens_per_s"]
        table.add_row(r["algorithm"], str(r["budget"]), f"{r['mean_tau']:.2f}" if r["mean_tau"] else "-", str(r["steps"]),
                      f"{ms['median']:.1f} ({ms['min']:.1f}–{ms['max']:.1f})" if ms else "-",
                      f"{ts['median']:.0f} ({ts['min']:.0f}–{ts['max']:.0f})" if ts else "-",
                      r["verdict"] + (f" ({', '.join(r['fail_categories'])})" if r["fail_categories"] else ""),
                      r["first_divergence"] or "-")
    err.print(table)
    err.print(f"wrote {out_dir / 'sweep-sglang.json'}", markup=False)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    sys.exit(EXIT_PASS)


@main.command()
@click.argument("trace_path", type=click.Path(path_type=Path))
@click.option("--source", default=None, help="Baseline file (ddtree_table1, ddtree_budget_sweep, dflash_readme, ...).")
@click.option("--model", "bl_model", default=None, help="Baseline target model, e.g. Qwen3-8B.")
@click.option("--dataset", default=None, help="Baseline dataset, e.g. MATH-500.")
@click.option("--temperature", type=float, default=0.0, show_default=True)
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
    from refcheck.trace.io import read_trace

    trace = read_trace(trace_path)
    taus_by_req = [[s.accept_length for s in trace.steps_of(r.request_id)] for r in trace.requests]
    taus = [t for r in taus_by_req for t in r]
    if not taus:
        from refcheck.errors import NothingComparedError

        raise NothingComparedError(f"{trace_path}: no verify steps to compare")
    tb = trace.provenance.get("budget")
    method = method or ("dflash" if tb == "chain" else "ddtree")
    budget = None if bl_budget in (None, "best") else int(bl_budget)
    rows = match(load_baselines(source), model=bl_model, dataset=dataset, temperature=temperature, method=method,
                 budget=budget)
    rows = [r for r in rows if "histogram" not in r.extra] or rows
    row = rows[0]
    bs = int(trace.provenance.get("block_size", row.block_size))
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


def _quiet() -> None:
    from refcheck.runners.reference import _quiet_transformers

    _quiet_transformers()


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
