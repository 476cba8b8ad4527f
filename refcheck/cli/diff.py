"""``refcheck diff``: an engine (live, a recorded trace, or the goldens) against the reference."""

from __future__ import annotations

from pathlib import Path

import click

from refcheck.cli.app import err, main
from refcheck.cli.options import (DeviceType, model_options, sampling_from_options, sampling_options, spec_from_options,
                                  unless_given)
from refcheck.cli.reports import finish, report_table, steps_table
from refcheck.errors import GoldenError, UsageError
from refcheck.prompts import load_prompts, prompt_set_hash
from refcheck.runners.reference import DTYPES


def _sglang_engine(engine, algorithm, cuda_graphs, ngram_breadth, tp, dtype, device, mem_fraction=None, max_running=None):
    """Fold the SGLang options into the engine name and options; SGLang runs bf16 on the GPU unless told."""
    is_sglang = bool(engine) and (engine == "sglang" or engine.startswith("sglang:"))
    if not is_sglang:
        if algorithm or cuda_graphs or tp > 1 or mem_fraction is not None or max_running is not None:
            raise UsageError("--sglang-algorithm, --cuda-graphs, --tp, --sglang-mem-fraction and --sglang-max-running "
                             "need --engine sglang")
        return engine, None, dtype, device
    if algorithm:
        if ":" in engine and engine.split(":", 1)[1].upper() != algorithm.upper():
            raise UsageError(f"--engine {engine} and --sglang-algorithm {algorithm} disagree")
        engine = f"sglang:{algorithm.upper()}"
    opts = {"cuda_graphs": cuda_graphs, "ngram_breadth": ngram_breadth, "tp": tp}
    if mem_fraction is not None:
        opts["mem_fraction"] = mem_fraction
    if max_running is not None:
        opts["max_running"] = max_running
    return (engine, opts,
            unless_given("dtype", dtype, "bfloat16"), unless_given("device", device, "cuda"))

@main.command()
@click.option("--engine", default=None,
              help="Run this live engine instead of reading goldens: reference, zlab, sglang[:ALGORITHM], fault:NAME.")
@click.option("--against", "against", type=click.Path(path_type=Path), multiple=True, help="Engine trace file(s) to diff.")
@click.option("--mode", type=click.Choice(["replay", "free", "both"]), default="both", show_default=True)
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None, help="Golden directory.")
@click.option("--ref-dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@click.option("--ref-device", type=DeviceType(), default="cpu", show_default=True)
@click.option("--save-trace", type=click.Path(path_type=Path), default=None, help="Write the live engine's trace here.")
@click.option("--workers", "--gpus", "workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes to spread the prompts over (one per GPU: worker i uses cuda:i).")
@click.option("--full-state", is_flag=True, help="Record full KV/state tensors in the trace (not only sketches).")
@click.option("--sglang-algorithm", default=None,
              help="With --engine sglang: NONE (target-only), DFLASH, NGRAM, REFCHECK_DDTREE (refcheck's DDTree on "
                   "SGLang; REFCHECK_DDTREE_LEAKY_CHAIN is its leaky twin, REFCHECK_DDTREE_FAULT_* its fault-injected "
                   "ones), or any algorithm your SGLang registers.")
@click.option("--cuda-graphs", is_flag=True, help="With --engine sglang: run SGLang with CUDA graphs (off by default).")
@click.option("--ngram-breadth", type=click.IntRange(min=1), default=10, show_default=True,
              help="With --sglang-algorithm NGRAM: speculative_ngram_max_bfs_breadth.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --engine sglang: tensor parallelism (state captured on every rank and combined).")
@click.option("--sglang-max-running", "max_running", type=click.IntRange(min=1), default=None,
              help="With --engine sglang: SGLang's max_running_requests (1: one request at a time).")
@click.option("--sglang-mem-fraction", "mem_fraction", type=float, default=None,
              help="With --engine sglang: SGLang's mem_fraction_static (default 0.3); lower it to run several engines "
                   "on one GPU side by side.")
@click.option("--layer-sketches", is_flag=True,
              help="With --engine sglang: sketch every target layer's output (forward hooks) so a failing node gets "
                   "layer bisection; slower.")
@click.option("--steps", is_flag=True, help="Also print one row per verify step: tree size, τ, verdict, first finding.")
@click.option("--ref-shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --against and --mode replay: split the reference by layers over N processes (N GPUs with "
                   "--ref-device cuda, NCCL; gloo on CPUs).")
@model_options
@sampling_options
def diff(engine, against, mode, golden_dir, ref_dtype, ref_device, save_trace, workers, full_state, sglang_algorithm,
         cuda_graphs, ngram_breadth, tp, max_running, mem_fraction, layer_sketches, steps, ref_shards, model_dir, draft_dir, pair, prompts_file, budget, max_new_tokens, dtype, device,
         drafter, stop_ids, as_json, temperature, top_k, top_p, sample_seed):
    """Diff an engine against the reference: per prompt and verify step, tokens, log-probs, acceptance, KV and state.

    With no --engine / --against: the golden engine traces in golden/ for this budget and pair."""
    from refcheck.diff.session import DiffSession
    from refcheck.golden import (
        apply_triage,
        default_golden_dir,
        live_provenance_reasons,
        verify,
    )
    from refcheck.trace.io import read_trace, write_trace

    from refcheck.outputs import check_output_file, late_write_error

    sampling = sampling_from_options(temperature, top_k, top_p, sample_seed)  # out of range: exit 2
    if sampling is not None and not engine:
        raise UsageError("--temperature > 0 runs a live engine (--engine ...): a recorded trace carries its own "
                         "sampling parameters")
    if sampling is not None and engine and not _can_sample(engine):
        raise UsageError(f"engine {engine} cannot sample yet: refcheck records its runs greedily only (temperature 0). "
                         "Sampling engines: reference, fault:NAME")
    check_output_file(save_trace, "--save-trace")  # before the run, not after it
    session = DiffSession()
    reports = []
    traces = []  # the engine trace behind each report (for --steps)
    if ref_shards > 1 and not against:
        raise UsageError("--ref-shards works with --against TRACE (record live engines with --save-trace first)")
    if engine:
        from refcheck.parallel import (
            engine_decoder,
            engine_shard,
            merge_reports,
            merge_traces,
            run_parallel,
            split,
        )
        from refcheck.trace.io import trace_from_bytes

        engine, engine_opts, dtype, device = _sglang_engine(engine, sglang_algorithm, cuda_graphs, ngram_breadth, tp,
                                                            dtype, device, mem_fraction, max_running)
        if layer_sketches:
            if engine_opts is None:
                raise UsageError("--layer-sketches needs --engine sglang")
            engine_opts["layer_sketches"] = True
        spec = spec_from_options(model_dir, draft_dir, pair, budget, max_new_tokens, dtype, device, drafter, stop_ids,
                                 sampling)
        prompts = load_prompts(prompts_file)
        engine_decoder(engine)  # unknown engine: a usage error before any process starts
        from refcheck.diff.tolerance import calibration_for

        calibration_for(spec.dtype, spec.device)  # no verdict for these numerics: say so before the engine runs
        shards = split(prompts, workers)
        err.print(f"running live engine {engine} on {len(prompts)} prompts in {len(shards)} process(es)", markup=False)
        results = run_parallel(engine_shard, [(engine, spec, sh, mode, ref_dtype, ref_device, i, len(shards), full_state,
                                               engine_opts) for i, sh in enumerate(shards)], len(shards))
        trace = merge_traces([trace_from_bytes(b) for b, _ in results], [p.id for p in prompts], prompt_set_hash(prompts))
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
                                            ref_device=ref_device))
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
            report = session.diff(trace, name, mode, strict_acceptance=strict, ref_dtype=ref_dtype, ref_device=ref_device)
            apply_triage(report, manifest.cases[name].provenance.get("triaged", []))
            reports.append(report)
            traces.append(trace)
    # the budgets diffed: the traces' own (an --against trace of budget 64 is not "budget 15")
    shown = sorted({str(t.provenance.get("budget", budget)) for t in traces}) or [str(budget)]
    shown = ["chain" if b == "None" else b for b in shown]
    report_table(reports, f"refcheck diff · budget {', '.join(shown)} · mode {mode}")
    if steps:
        for report, trace in zip(reports, traces):
            steps_table(report, trace)
    files = list(against) if against else ([save_trace] * len(reports) if save_trace else [])
    for report, path in zip(reports, files):
        _explain_hint(report, path)
    if engine and save_trace:  # after the report: a late write failure cannot lose it
        try:
            write_trace(traces[0], save_trace)
        except OSError as exc:
            report_json_and_raise(reports, as_json, late_write_error(save_trace, exc, "the trace"))
    finish(reports, as_json)


def _can_sample(engine: str) -> bool:
    """Live engines whose runs refcheck can record at temperature > 0 (the reference decoder and its faults).
    z-lab's dflash_generate and the SGLang runner are driven greedily (SGLang's capture of draws: later)."""
    return engine == "reference" or engine.startswith("fault:")


def report_json_and_raise(reports, as_json: bool, error: Exception) -> None:
    """Print the JSON report (the table is already out), then raise ``error`` (its exit code wins)."""
    if as_json:
        import json

        click.echo(json.dumps({"reports": [r.to_json() for r in reports]}, indent=2, default=str))
    raise error


def _explain_hint(report, path) -> None:
    """The command that explains the earliest failing node with a per-node finding (logits); with
    ``--layer`` when layer bisection placed it (the trace carries layer sketches)."""
    nodes = [f for f in report.first_divergence().values() if f.node is not None and f.step is not None
             and f.category == "logits"]
    if nodes:
        f = min(nodes, key=lambda f: (f.step, f.request_id))
        layer = " --layer" if f.layer is not None else ""  # bisected: the trace has layer sketches to explain with
        err.print(f"explain it: refcheck explain {path} --request {f.request_id} --step {f.step} --node {f.node}{layer}",
                  markup=False, soft_wrap=True)  # one line, whatever the width: a command to paste
