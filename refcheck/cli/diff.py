"""``refcheck diff``: an engine (live, a recorded trace, or the goldens) against the reference.

Contract: one source is diffed: a live engine (``--engine``), recorded trace files (``--against``), the capture
directory of an SGLang server the user started (``--capture``: :mod:`refcheck.sglang.served`) or the goldens
(none of them). An option that the chosen source does not use is refused before anything runs (exit 2):
a recorded trace or a golden names its own models and settings, so the live run's options (``--model``,
``--prompts``, ``--save-trace``, ...) would be ignored, and a live run reads no golden directory.
``--html PATH`` (any source) is checked before anything runs (a missing directory: exit 2); after the report
it writes every diffed case on one self-contained page (:func:`refcheck.report.render_cases`, each case with
the trace it judged), atomically, with its size printed; a page that cannot be written is exit 2 after the
report, otherwise the exit code is the verdicts'.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from refcheck.budget import budget_json, budget_label
from refcheck.cli.app import err, main
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
from refcheck.cli.notes import explain_target, headline, where
from refcheck.cli.options import DeviceType, given_options, unless_given
from refcheck.cli.reports import finish, report_table, steps_table, write_html
from refcheck.errors import GoldenError, UsageError
from refcheck.prompts import load_prompts, prompt_set_hash
from refcheck.spec import DTYPE_NAMES

if TYPE_CHECKING:
    from ddtree_reference.sampling import Sampling
    from refcheck.diff.findings import Report
    from refcheck.pool import ReferencePool
    from refcheck.spec import EngineSpec
    from refcheck.trace.rows import Trace

#: options of a live run (--engine) only: a recorded trace or a golden carries its own
_LIVE_ONLY = ("draft_dir", "prompts_file", "max_new_tokens", "dtype", "device", "drafter", "stop_ids", "save_trace",
              "workers", "full_state", "sglang_algorithm", "cuda_graphs", "ngram_breadth", "tp", "max_running",
              "mem_fraction", "serving", "layer_sketches", "capture_sample", "capture_max_mb", "capture_roll")
#: options that pick the goldens to diff (and the live run's models, with --engine)
_GOLDEN_PICKS = ("golden_dir", "model_dir", "pair", "budget")
#: of those, what --capture takes: the models where the server's paths are not this machine's, the trace to keep
_CAPTURE_TAKES = ("model_dir", "draft_dir", "save_trace")


def refuse_unused_options(engine: str | None, against: tuple[Path, ...], capture: Path | None = None) -> None:
    """A :class:`UsageError` for options the chosen source (module docstring) would ignore."""
    if engine and against:
        raise UsageError(f"--engine {engine} runs a live engine and --against diffs recorded trace files: give one of "
                         "them (nothing was run)")
    if capture is None and given_options(("running", "last_records")):
        raise UsageError(f"{', '.join(given_options(('running', 'last_records')))}: only with --capture DIR, a "
                         "server's capture directory (nothing was run)")
    if capture is not None:
        if engine or against:
            raise UsageError("--capture diffs the capture directory of a server you started: give it without --engine "
                             "or --against (nothing was run)")
        unused = given_options(o for o in _LIVE_ONLY + _GOLDEN_PICKS if o not in _CAPTURE_TAKES)
        if unused:
            raise UsageError(f"--capture takes its requests and settings from the capture directory: {', '.join(unused)} "
                             "would be ignored (nothing was run)")
        return
    if against:
        unused = given_options(_LIVE_ONLY + _GOLDEN_PICKS)
        if unused:
            raise UsageError(f"--against diffs recorded trace files, which name their own models and settings: "
                             f"{', '.join(unused)} would be ignored (they set up a live --engine run or pick the "
                             "goldens; nothing was run)")
    elif engine:
        if given_options(("golden_dir",)):
            raise UsageError("--golden picks the goldens to diff; with --engine the live run is diffed (nothing was run)")
    else:
        unused = given_options(_LIVE_ONLY)
        if unused:
            raise UsageError(f"{', '.join(unused)} set up a live run, which needs --engine: without --engine or "
                             "--against, diff judges the golden traces, which carry their own settings (nothing was run)")


def _engine_and_options(engine: str, sglang: SGLangOptions, dtype: str,
                        device: str) -> tuple[str, dict[str, Any], str, str]:
    """The engine name and its kind's options from the command line (only the options given), refused
    where the engine's kind does not take them; dtype and device default to the kind's (SGLang: bf16 on
    the GPU)."""
    from refcheck.engines import check_engine

    algorithm = sglang.algorithm
    if algorithm:
        if not (engine == "sglang" or engine.startswith("sglang:")):
            raise UsageError("--sglang-algorithm needs --engine sglang")
        if ":" in engine and engine.split(":", 1)[1].upper() != algorithm.upper():
            raise UsageError(f"--engine {engine} and --sglang-algorithm {algorithm} disagree")
        engine = f"sglang:{algorithm.upper()}"
    settings = None
    if sglang.serving:
        from refcheck.sglang.settings import parse_settings

        settings = parse_settings(sglang.serving)  # an unknown or malformed item: exit 2 before anything starts
    if sglang.capture_sample:
        from refcheck.sglang.capture.sample_rule import CaptureSampleError, parse

        try:
            parse(sglang.capture_sample)  # out of range: exit 2 before anything starts
        except CaptureSampleError as exc:
            raise UsageError(f"--capture-sample: {exc}") from None
    from refcheck.sglang.capture.byte_budget import CaptureBudgetError, from_megabytes

    try:
        from_megabytes(sglang.capture_max_mb, sglang.capture_roll)  # out of range: exit 2 before anything starts
    except CaptureBudgetError as exc:
        raise UsageError(str(exc)) from None
    opts = sglang.runner_options(settings)
    kind = check_engine(engine, opts)
    if "ngram_breadth" in kind.options:
        opts["ngram_breadth"] = sglang.ngram_breadth
    return (engine, opts, unless_given("dtype", dtype, kind.dtype or dtype),
            unless_given("device", device, kind.device or device))


@dataclass(frozen=True)
class LiveOptions:
    """A live run's own options (``--engine``): where its trace goes, the processes it runs in, what it records."""

    save_trace: Path | None = None
    workers: int = 1
    full_state: bool = False


@dataclass(frozen=True)
class ServedOptions:
    """A server's capture directory as the source (``--capture``) and how to read it."""

    capture: Path | None = None
    running: bool = False
    last_records: int | None = None


served_options = option_group(
    "served", ServedOptions,
    click.option("--capture", "capture", type=click.Path(path_type=Path), default=None,
                 help="The capture directory of an SGLang server you started (REFCHECK_CAPTURE_DIR): imported as "
                      "refcheck trace import does (--model/--draft where the server's paths are not this machine's), "
                      "then diffed; --save-trace keeps the trace."),
    click.option("--running", is_flag=True,
                 help="With --capture: the server is still serving; records queued but not yet written are in flight, "
                      "not an error."),
    click.option("--last-records", "last_records", type=int, default=None, metavar="N",
                 help="With --capture: read only each scheduler process's last N records."),
)
reference_options = option_group(
    "ref", ReferenceOptions,
    click.option("--ref-dtype", type=click.Choice(list(DTYPE_NAMES)), default="float32", show_default=True),
    click.option("--ref-device", type=DeviceType(), default="cpu", show_default=True),
    click.option("--ref-shards", type=click.IntRange(min=1), default=1, show_default=True,
                 help="With --against and --mode replay: split the reference by layers over N processes (N GPUs with "
                      "--ref-device cuda, NCCL; gloo on CPUs)."),
)
live_options = option_group(
    "live", LiveOptions,
    click.option("--save-trace", type=click.Path(path_type=Path), default=None, help="Write the live engine's trace here."),
    click.option("--workers", "--gpus", "workers", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Processes to spread the prompts over (one per GPU: worker i uses cuda:i)."),
    click.option("--full-state", is_flag=True, help="Record full KV/state tensors in the trace (not only sketches)."),
)
sglang_options = option_group(
    "sglang", SGLangOptions.from_params,
    click.option("--sglang-algorithm", default=None,
                 help="With --engine sglang: NONE (target-only), DFLASH, NGRAM, REFCHECK_DDTREE (refcheck's DDTree on "
                      "SGLang; REFCHECK_DDTREE_LEAKY_CHAIN is its leaky twin, REFCHECK_DDTREE_FAULT_* its fault-injected "
                      "ones), or any algorithm your SGLang registers."),
    click.option("--cuda-graphs", is_flag=True, help="With --engine sglang: run SGLang with CUDA graphs (off by default)."),
    click.option("--ngram-breadth", type=click.IntRange(min=1), default=10, show_default=True,
                 help="With --sglang-algorithm NGRAM: speculative_ngram_max_bfs_breadth."),
    click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                 help="With --engine sglang: tensor parallelism (state captured on every rank and combined)."),
    click.option("--sglang-max-running", "max_running", type=click.IntRange(min=1), default=None,
                 help="With --engine sglang: SGLang's max_running_requests (1: one request at a time)."),
    click.option("--sglang-mem-fraction", "mem_fraction", type=float, default=None,
                 help="With --engine sglang: SGLang's mem_fraction_static (default 0.3); lower it to run several engines "
                      "on one GPU side by side."),
    click.option("--sglang-settings", "serving", default=None, metavar="LIST",
                 help="With --engine sglang: how SGLang serves, as in production: a comma list of graphs, overlap, radix, "
                      "page=N, chunk=N (chunked prefill), running=N (max running requests), stagger=MS (requests arrive "
                      "one every MS ms); default: refcheck's safest corner (all off, page 1, all requests at once)."),
    click.option("--layer-sketches", is_flag=True,
                 help="With --engine sglang: sketch every target layer's output (forward hooks) so a failing node gets "
                      "layer bisection; slower."),
    click.option("--capture-sample", "capture_sample", default=None, metavar="N[:SEED]",
                 help="With --engine sglang: record one decode batch in N and one prefill batch in N, every request in "
                      "it (phase seeded by SEED, default 0); the diff judges the steps recorded, re-prefilling the "
                      "engine's output across the others."),
    click.option("--capture-max-mb", "capture_max_mb", type=int, default=None, metavar="MB",
                 help="With --engine sglang: each scheduler process writes at most MB MiB of capture records; past it "
                      "the capture stops (the engine runs on unrecorded), and the diff reports the batches not recorded "
                      "and judges the steps before them."),
    click.option("--capture-roll", "capture_roll", is_flag=True,
                 help="With --capture-max-mb: past the budget, delete the oldest records to make room and keep "
                      "recording (the directory holds the latest ones)."),
)
output_options = option_group(
    "output", OutputOptions,
    click.option("--steps", is_flag=True, help="Also print one row per verify step: tree size, τ, verdict, first finding."),
    click.option("--html", "html", type=click.Path(path_type=Path), default=None,
                 help="Also write every diffed case's report on one self-contained HTML page (refcheck report's, per case)."),
    click.option("-v", "--verbose", is_flag=True,
                 help="The report as a table, with what every count holds (default: one line per case and a summary)."),
    JSON_OPTION,
)


@main.command()
@click.option("--engine", default=None,
              help="Run this live engine instead of reading goldens: reference, zlab, sglang[:ALGORITHM], fault:NAME.")
@click.option("--against", "against", type=click.Path(path_type=Path), multiple=True, help="Engine trace file(s) to diff.")
@served_options
@click.option("--mode", type=click.Choice(["replay", "free", "both"]), default="both", show_default=True)
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), default=None, help="Golden directory.")
@reference_options
@live_options
@sglang_options
@output_options
@model_options
@sampling_options
def diff(engine: str | None, against: tuple[Path, ...], served: ServedOptions, mode: str, golden_dir: Path | None,
         ref: ReferenceOptions, live: LiveOptions, sglang: SGLangOptions, output: OutputOptions, model: ModelOptions,
         sampling: SamplingOptions) -> None:
    """Diff an engine against the reference: per prompt and verify step, tokens, log-probs, acceptance, KV and state.

    With no --engine / --against: the golden engine traces in golden/ for this budget and pair."""
    from refcheck.outputs import check_output_file
    from refcheck.pool import ReferencePool

    capture = served.capture
    refuse_unused_options(engine, against, capture)
    drawn = _live_sampling(engine, sampling)
    check_output_file(live.save_trace, "--save-trace")  # before the run, not after it
    if output.html is not None:
        check_output_file(output.html, "--html")
    pool = ReferencePool()
    reports: list[Report] = []
    traces: list[Trace] = []  # the engine trace behind each report (for --steps)
    golden_notes: list[tuple[Path, bool]] = []  # goldens diffed: (file, whether their reviewed findings were applied)
    if ref.ref_shards > 1 and not against:
        raise UsageError("--ref-shards works with --against TRACE (record live engines with --save-trace first)")
    if engine:
        # an unknown engine, or an option it does not take: a usage error before any process starts
        engine, engine_opts, dtype, device = _engine_and_options(engine, sglang, model.dtype, model.device)
        spec = model.spec(drawn, dtype=dtype, device=device)
        report, trace = _live_engine(engine, engine_opts, spec, model.prompts_file, live, mode, ref)
        reports.append(report)
        traces.append(trace)
    elif against:
        _diff_files(against, pool, mode, ref, reports, traces, golden_notes)
    elif capture is not None:
        _diff_capture(served, model, pool, mode, ref, reports, traces)
    else:
        _diff_goldens(golden_dir, model.budget, model.model_label, pool, mode, ref, reports, traces, golden_notes)
    # the budgets diffed: the traces' own (an --against trace of budget 64 is not "budget 15")
    shown = sorted({budget_label(t.prov.budget) for t in traces}) or [budget_label(model.budget)]
    report_table(reports, f"refcheck diff · budget {', '.join(shown)} · mode {mode}",
                 verbose=output.verbose or output.steps)
    if output.steps:
        for report, trace in zip(reports, traces):
            steps_table(report, trace)
    for path, applied in golden_notes:  # a golden diffed alone: the gate's rules for it, which this diff does not apply
        if output.verbose or output.steps or not applied:
            golden_note(path, applied)
    save_trace = live.save_trace
    files = list(against) if against else ([save_trace] * len(reports) if save_trace else [])
    for report, path in zip(reports, files):
        explain_hint(report, path)
    sources = [str(p) for p in against] if against else [str(capture)] if capture is not None else (
        [str(save_trace or f"live engine {engine}")] if engine else [str(p) for p, _ in golden_notes])
    late = _write_outputs(traces[0] if engine or capture is not None else None, save_trace, output.html, reports,
                          traces, sources)
    if late is not None:
        report_json_and_raise(reports, output.as_json, late)
    finish(reports, output.as_json)


def _diff_capture(opts: ServedOptions, model: ModelOptions, pool: ReferencePool, mode: str, ref: ReferenceOptions,
                  reports: list[Report], traces: list[Trace]) -> None:
    """Diff the trace of a server's capture directory (:func:`refcheck.sglang.served.served_trace`; what it left out
    said), appending to ``reports`` and ``traces``."""
    from refcheck.diff.judge import judge
    from refcheck.sglang.served import served_trace

    capture = Path(opts.capture or ".")
    served = served_trace(capture, model.model_dir, model.draft_dir, running=opts.running,
                          last_records=opts.last_records)
    for why, n in sorted(served.left_out.items()):
        err.print(f"{capture}: left out {n} request(s) with {why}", markup=False)
    if served.state_not_judged:
        err.print(f"{capture}: state not judged: {served.state_not_judged}", markup=False)
    traces.append(served.assembly.trace)
    reports.append(judge(traces[-1], pool, capture.name or "capture", mode, ref_dtype=ref.ref_dtype,
                         ref_device=ref.ref_device))


def _write_outputs(live_trace: Trace | None, save_trace: Path | None, html: Path | None, reports: list[Report],
                   traces: list[Trace], sources: list[str]) -> Exception | None:
    """The writes after the report (a late failure cannot lose it): the live engine's trace to ``save_trace``,
    the page to ``html``; the first write's error, else None."""
    from refcheck.outputs import late_write_error
    from refcheck.trace.io import write_trace

    late: list[Exception] = []
    if live_trace is not None and save_trace:
        try:
            write_trace(live_trace, save_trace)
        except OSError as exc:
            late.append(late_write_error(save_trace, exc, "the trace"))
    if html is not None:
        page_error = write_html(html, diff_page(reports, traces, sources))
        late += [page_error] if page_error is not None else []
    return late[0] if late else None


def _live_sampling(engine: str | None, options: SamplingOptions) -> Sampling | None:
    """The live run's sampling (None: greedy); out of range, without a live engine, or for an engine that records
    greedily only: a usage error (exit 2)."""
    sampling = options.sampling()
    if sampling is not None and not engine:
        raise UsageError("--temperature > 0 runs a live engine (--engine ...): a recorded trace carries its own "
                         "sampling parameters")
    if sampling is not None and engine and not _can_sample(engine):
        raise UsageError(f"engine {engine} cannot sample yet: refcheck records its runs greedily only (temperature 0). "
                         "Sampling engines: reference, fault:NAME")
    return sampling


def diff_page(reports: list[Report], traces: list[Trace], sources: list[str]) -> str:
    """The page of the diffed ``reports``, each with the trace it judged (``sources``: where each trace is)."""
    from refcheck.report import Case, render_cases

    return render_cases([Case(r, t, src) for r, t, src in zip(reports, traces, sources)], "refcheck diff",
                        "refcheck diff --json")


def _live_engine(engine: str, engine_opts: dict[str, Any], spec: EngineSpec, prompts_file: Path | None,
                 live: LiveOptions, mode: str, ref: ReferenceOptions) -> tuple[Report, Trace]:
    """Run the live engine over the prompts in ``live.workers`` processes: (the merged report, the merged trace)."""
    from refcheck.diff.tolerance import calibration_for
    from refcheck.parallel import engine_shard, merge_reports, merge_traces, run_parallel, split
    from refcheck.trace.io import trace_from_bytes

    prompts = load_prompts(prompts_file, spec.resolved_dirs()[0])
    calibration_for(spec.dtype, spec.device)  # no verdict for these numerics: say so before the engine runs
    shards = split(prompts, live.workers)
    err.print(f"running live engine {engine} on {len(prompts)} prompts in {len(shards)} process(es)", markup=False)
    results = run_parallel(engine_shard, [(engine, spec, sh, mode, ref.ref_dtype, ref.ref_device, i, len(shards),
                                           live.full_state, engine_opts) for i, sh in enumerate(shards)], len(shards))
    trace = merge_traces([trace_from_bytes(b) for b, _ in results], [p.id for p in prompts], prompt_set_hash(prompts))
    return merge_reports([r for _, r in results], engine, mode), trace


def _diff_files(against: tuple[Path, ...], pool: ReferencePool, mode: str, ref: ReferenceOptions,
                reports: list[Report], traces: list[Trace], golden_notes: list[tuple[Path, bool]]) -> None:
    """Diff each ``--against`` trace file (appending to ``reports``, ``traces`` and ``golden_notes``)."""
    from refcheck.diff.judge import judge
    from refcheck.trace.io import read_trace

    ref_shards, ref_dtype, ref_device = ref.ref_shards, ref.ref_dtype, ref.ref_device
    for path in against:
        err.print(f"diffing {path}" + (f" against the reference sharded over {ref_shards} processes" if ref_shards > 1
                                        else ""), markup=False)
        traces.append(read_trace(path))
        golden_notes.append((Path(path), False))
        if ref_shards > 1:
            from refcheck.sharding import sharded_diff

            reports.append(sharded_diff(traces[-1], Path(path).stem, mode, ref_shards, ref_dtype, ref_device))
        else:
            reports.append(judge(traces[-1], pool, Path(path).stem, mode, ref_dtype=ref_dtype, ref_device=ref_device))


def _diff_goldens(golden_dir: Path | None, budget: int | None, model: str, pool: ReferencePool, mode: str,
                  ref: ReferenceOptions, reports: list[Report], traces: list[Trace],
                  golden_notes: list[tuple[Path, bool]]) -> None:
    """Judge the goldens of this budget and model as the gate does (appending to ``reports``, ``traces`` and
    ``golden_notes``); none: a :class:`GoldenError`. With the gate's reference options (mode both, the default
    reference) a case goes through the gate's report cache when ``REFCHECK_GATE_CACHE`` names one: the same
    key, so a report the gate stored is this diff's, and the other way round."""
    from refcheck.goldens import default_golden_dir
    from refcheck.goldens.judge import check_trace
    from refcheck.goldens.verify import verify
    from refcheck.trace.io import read_trace

    gdir = golden_dir or default_golden_dir()
    manifest = verify(gdir)
    want_budget = budget_json(budget)
    names = [n for n, e in sorted(manifest.cases.items())
             if e.provenance.get("budget") == want_budget and e.provenance.get("model") == model
             and e.provenance.get("expect", "pass") == "pass"]
    if not names:
        raise GoldenError(f"no golden trace for budget {want_budget} on {model} in {gdir} "
                          "(create them: refcheck golden regen --accept --reason ...)")
    cache = _gate_cache() if mode == "both" and ref == ReferenceOptions() else None
    for name in names:
        entry = manifest.cases[name]
        trace = read_trace(gdir / entry.file)
        report = cache.get(entry) if cache is not None else None
        if report is None:
            logging.getLogger("refcheck.cli.diff").debug("diffing golden %s against the live reference", name)
            # the gate's own judgement of the golden (its manifest entry's rules included): diff and gate agree
            report = check_trace(name, trace, entry.provenance, pool, mode, ref.ref_dtype, ref.ref_device)
            if cache is not None:
                cache.put(entry, report)
        reports.append(report)
        golden_notes.append((gdir / manifest.cases[name].file, True))
        traces.append(trace)


def _gate_cache():
    """The gate's report cache named by ``REFCHECK_GATE_CACHE`` (``refcheck gate --cache-dir``'s variable), or None."""
    import os

    from refcheck.goldens.cache import ReportCache

    directory = os.environ.get("REFCHECK_GATE_CACHE")
    return ReportCache(Path(directory)) if directory else None


def _can_sample(engine: str) -> bool:
    """Live engines whose runs refcheck can record at temperature > 0 (the engine table's ``samples``: the
    reference decoder and its faults, and SGLang (which refuses the algorithms it cannot capture at T > 0);
    z-lab's dflash_generate is driven greedily)."""
    from refcheck.engines import kind_of

    return kind_of(engine).samples


def report_json_and_raise(reports, as_json: bool, error: Exception) -> None:
    """Print the JSON report (the table is already out), then raise ``error`` (its exit code wins)."""
    if as_json:
        import json

        click.echo(json.dumps({"reports": [r.to_json() for r in reports]}, indent=2, default=str))
    raise error


def explain_line(report, path) -> str | None:
    """The command that explains the node the table shows (:func:`refcheck.cli.notes.explain_target`:
    the headline finding when it is a node-level logits finding, else the earliest one that is), as the line
    ``explain it: ...``; with ``--layer`` when layer bisection placed it (the trace carries layer sketches).
    None: no node to explain."""
    f = explain_target(report)
    if f is None:
        return None
    shown = headline(report)
    layer = " --layer" if f.layer is not None else ""  # bisected: the trace has layer sketches to explain with
    why = "" if f is shown else f" (the table's {where(shown)} is not a node-level logits finding; this is the earliest one)"
    command = (f"refcheck explain {shlex.quote(str(path))} --request {shlex.quote(f.request_id)} --step {f.step} "
               f"--node {f.node}")
    return f"explain it: {command}{layer}{why}"


def explain_hint(report, path) -> None:
    """:func:`explain_line`, printed (one line, whatever the width: a command to paste)."""
    line = explain_line(report, path)
    if line is not None:
        err.print(line, markup=False, soft_wrap=True)


def golden_note(path: Path, applied: bool) -> None:
    """When ``path`` is a golden listed in the manifest beside it: say that ``refcheck gate`` judges it
    through that entry, what the entry says, and whether this diff applied it."""
    from refcheck.goldens.judge import entry_rules
    from refcheck.goldens.manifest import golden_entry_for

    found = golden_entry_for(path)
    if found is None:
        return
    name, entry = found
    rules = entry_rules(entry)
    if applied:  # the goldens of `refcheck diff [--budget B]`: only entries with rules beyond "expect pass" are news
        s = entry.provenance
        if s.get("expect", "pass") == "pass" and not s.get("allow_unsupported") and not s.get("triaged"):
            return
        err.print(f"note: golden {name}: its reviewed findings were applied here; refcheck gate applies its whole "
                  f"manifest entry: " + "; ".join(r.split(": ")[0] for r in rules), markup=False, soft_wrap=True)
        return
    err.print(f"note: {path} is golden case {name!r} of {Path(path).parent / 'MANIFEST.json'}; refcheck gate judges it "
              f"through its manifest entry, which this diff does not apply (the gate's verdict: refcheck gate "
              f"{Path(path).parent} --case {name}):", markup=False, soft_wrap=True)
    for rule in rules:
        err.print(f"  {rule}", markup=False, soft_wrap=True)
