"""``refcheck calibrate``: run the clean and faulty corpus in the engine's dtype and tabulate the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from refcheck.cli.app import err, main, quiet
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, UsageError


def _fault_names(selected: tuple[str, ...]) -> list[str]:
    """The faults to run: the named ones (each checked), or every discrete, graded and sampling fault."""
    from refcheck.selftest.faults import fault, fault_names
    from refcheck.selftest.sampling_faults import SAMPLING_FAULTS

    for name in selected:
        fault(name)  # an unknown name is a usage error listing the faults
    return list(selected) or [*fault_names(), *SAMPLING_FAULTS]


def _pairs(text: str, option: str) -> dict[str, float]:
    """'a=1,b=2.5' -> {'a': 1.0, 'b': 2.5}; anything else is a usage error naming the option."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise UsageError(f"{option}: expected NAME=NUMBER[,NAME=NUMBER...], got {part!r}") from None
        if not eq or out[key.strip()] != out[key.strip()]:
            raise UsageError(f"{option}: expected NAME=NUMBER[,NAME=NUMBER...], got {part!r}")
    return out



def trace_names(paths: list[Path]) -> list[str]:
    """A row name per trace: its file stem, or ``folder/stem`` where two traces share a stem (captures of
    the same configuration from different runs must not merge into one row)."""
    stems = [Path(p).stem for p in paths]
    names = [s if stems.count(s) == 1 else f"{Path(p).parent.name}/{s}" for p, s in zip(paths, stems)]
    return [n if names.count(n) == 1 else str(p) for p, n in zip(paths, names)]

@main.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory for calibration.json, calibration.md and the traces.")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Engine dtypes of the clean runs (default: bfloat16 and float16); faults run in the first.")
@click.option("--device", default="cuda", show_default=True, help="The engines' device.")
@click.option("--ref-device", default=None, help="The fp32 reference's device (default: --device).")
@click.option("--fault", "faults", multiple=True,
              help="Only these faults (default: every fault; sampling faults run sampled, docs/calibration.md).")
@click.option("--no-faults", is_flag=True, help="Clean runs only.")
@click.option("--no-corpus", is_flag=True, help="Run no corpus: only --traces and --rows.")
@click.option("--rows", "row_files", multiple=True, type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Add the rows of an earlier calibration.json (a corpus run elsewhere or in parts).")
@click.option("--pair", "pairs", multiple=True, type=click.Choice(["hybrid", "attention"]),
              help="Built-in pairs of the clean runs (default: both).")
@click.option("--model", "model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Run the corpus on this hybrid target (with --draft) instead of the built-in pairs.")
@click.option("--draft", "draft_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="The DFlash draft of --model.")
@click.option("--label", default=None, help="The --model pair's name in run names (default: the target's parent directory).")
@click.option("--budget", "budgets", multiple=True, help="Budgets of the clean runs (default: 8, 15, 32, 64, chain).")
@click.option("--prompts", "n_prompts", type=click.IntRange(1, 64), default=3, show_default=True,
              help="Built-in prompts per run.")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=32, show_default=True)
@click.option("--traces", "traces", multiple=True, type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Engine traces recorded elsewhere (SGLang captures) to add as rows (repeatable).")
@click.option("--bounds", default="", help="Replace cheap bounds for this measurement, e.g. "
              "'logprob_abs=0.5,tensor_rel_l2=0.1' (fields of refcheck.diff.tolerance.Tolerance).")
@click.option("--rule", "rule_text", default="", help="Replace rule settings, e.g. 'factor=3,samples=16'.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Corpus runs over N processes (on one GPU they share it).")
@click.option("--save-traces", is_flag=True, help="Keep every run's trace under OUT/traces/.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def calibrate(out_dir, dtypes, device, ref_device, faults, no_faults, no_corpus, row_files, pairs, model_dir, draft_dir,
              label, budgets, n_prompts, max_new_tokens, traces, bounds, rule_text, workers, save_traces, as_json):
    """Measure the verdict: clean engines must pass, every fault must fail where it first acts.

    Dtypes with no measured calibration are run with their candidate bounds (refcheck/diff/tolerance.py)."""
    from refcheck.atomic_file import atomic_write_bytes
    from refcheck.calibrate import calibration_under_test, default_corpus, markdown, row_of_trace, run_one, summarize
    from refcheck.parallel import run_parallel

    quiet()
    dtypes = list(dtypes) or ["bfloat16", "float16"]
    ref_device = ref_device or device
    names = [] if no_faults else _fault_names(faults)
    from refcheck.calibrate import CLEAN_BUDGETS
    from refcheck.sweep import parse_budgets

    blist = tuple(parse_budgets(",".join(budgets))) if budgets else CLEAN_BUDGETS
    if (model_dir is None) != (draft_dir is None):
        raise UsageError("--model and --draft go together (a target and its DFlash draft)")
    if model_dir is not None and pairs:
        raise UsageError("--pair names built-in pairs; with --model the corpus runs on that pair alone")
    own = None
    if model_dir is not None:
        from refcheck.reference_runner import EngineSpec, load_pair

        load_pair(EngineSpec(model_dir=model_dir, draft_dir=draft_dir))  # a wrong pair is refused before any run
        own = (label or model_dir.resolve().parent.name, str(model_dir), str(draft_dir))
    corpus = [] if no_corpus else default_corpus(dtypes, device, names, tuple(pairs) or ("hybrid", "attention"), blist,
                                                 own)
    out_dir.mkdir(parents=True, exist_ok=True)
    err.print(f"calibrate: {len(corpus)} runs + {len(traces)} traces, {workers} process(es)", markup=False)
    over, rule = _pairs(bounds, "--bounds"), _pairs(rule_text, "--rule")
    for d in dtypes:  # a bad field or an unknown dtype: a usage error before any run
        calibration_under_test(d, device, over, rule)
    results = run_parallel(run_one, [(r, n_prompts, max_new_tokens, ref_device, over, rule) for r in corpus], workers)
    rows = [row for row, _ in results]
    if save_traces:
        (out_dir / "traces").mkdir(exist_ok=True)
        for run, (_, data) in zip(corpus, results):
            atomic_write_bytes(out_dir / "traces" / f"{run.name}.arrow", data)
    rows += run_parallel(row_of_trace, [(str(p), name, ref_device, over, rule) for p, name in zip(traces, trace_names(traces))],
                         workers)
    for f in row_files:
        try:
            rows += json.loads(f.read_text())["rows"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--rows {f}: not a calibration.json ({exc})") from None
    first: dict[str, dict] = {}  # a run in two parts (each part's clean twins) counts once: the first row of a name
    for r in rows:
        first.setdefault(r["name"], r)
    rows = list(first.values())
    summary = summarize(rows)
    atomic_write_bytes(out_dir / "calibration.json",
                       (json.dumps({"summary": summary, "rows": rows}, indent=1, default=str) + "\n").encode())
    atomic_write_bytes(out_dir / "calibration.md", markdown(rows, summary).encode())
    err.print(markdown(rows, summary), markup=False)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    ok = summary["false_alarms"] == 0 and summary["detected"] == summary["faulty_runs"] \
        and summary["faulty_nodes_triaged"] == 0
    sys.exit(EXIT_PASS if ok else EXIT_MISMATCH)
