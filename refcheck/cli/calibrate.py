"""``refcheck calibrate``: run the clean and faulty corpus in the engine's dtype and tabulate the verdict."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from refcheck.cli.app import err, main, quiet
from refcheck.cli.groups import OutputOptions, option_group
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, UsageError

if TYPE_CHECKING:
    from refcheck.calibrate import CorpusRun

#: the files calibrate writes in --out (besides traces/RUN.arrow with --save-traces)
OUT_FILES = ("calibration.json", "calibration.md")


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

@dataclass(frozen=True)
class CorpusOptions:
    """The corpus calibrate runs: the engines' dtypes and device, the reference's device, the faults, the pairs
    (built-in, or ``--model``/``--draft`` named ``--label``), the budgets and each run's size."""

    dtypes: tuple[str, ...] = ()
    device: str = "cuda"
    ref_device: str | None = None
    faults: tuple[str, ...] = ()
    no_faults: bool = False
    no_corpus: bool = False
    no_long: bool = False
    pairs: tuple[str, ...] = ()
    model_dir: Path | None = None
    draft_dir: Path | None = None
    label: str | None = None
    budgets: tuple[str, ...] = ()
    n_prompts: int = 3
    max_new_tokens: int = 32


@dataclass(frozen=True)
class ExtraRows:
    """Rows besides the corpus's: an earlier calibration.json's (``--rows``), traces recorded elsewhere (``--traces``)."""

    row_files: tuple[Path, ...] = ()
    traces: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Overrides:
    """The calibration under test: cheap bounds and rule settings that replace the measured ones."""

    bounds: str = ""
    rule_text: str = ""

    def parsed(self) -> tuple[dict[str, float], dict[str, float]]:
        """(bounds, rule settings) by name; a malformed item is a usage error naming its option."""
        return _pairs(self.bounds, "--bounds"), _pairs(self.rule_text, "--rule")


@main.command()
@option_group(
    "output", OutputOptions,
    click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
                 help="Directory for calibration.json, calibration.md and the traces."),
    click.option("--save-traces", is_flag=True, help="Keep every run's trace under OUT/traces/."),
    click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout."),
)
@option_group(
    "corpus", CorpusOptions,
    click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["bfloat16", "float16", "float32"]),
                 help="Engine dtypes of the clean runs (default: bfloat16 and float16); faults run in the first."),
    click.option("--device", default="cuda", show_default=True, help="The engines' device."),
    click.option("--ref-device", default=None, help="The fp32 reference's device (default: --device)."),
    click.option("--fault", "faults", multiple=True,
                 help="Only these faults (default: every fault; sampling faults run sampled, docs/calibration.md)."),
    click.option("--no-faults", is_flag=True, help="Clean runs only."),
    click.option("--no-corpus", is_flag=True, help="Run no corpus: only --traces and --rows."),
    click.option("--no-long", is_flag=True,
                 help="Leave out the long-context runs (each dtype's clean run and the long-context faults on "
                      "two prompts of 600 + 64 and 438 + 48 tokens)."),
    click.option("--pair", "pairs", multiple=True, type=click.Choice(["hybrid", "attention"]),
                 help="Built-in pairs of the clean runs (default: both)."),
    click.option("--model", "model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
                 help="Run the corpus on this hybrid target (with --draft) instead of the built-in pairs."),
    click.option("--draft", "draft_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
                 help="The DFlash draft of --model."),
    click.option("--label", default=None,
                 help="The --model pair's name in run names (default: the target's parent directory)."),
    click.option("--budget", "budgets", multiple=True, help="Budgets of the clean runs (default: 8, 15, 32, 64, chain)."),
    click.option("--prompts", "n_prompts", type=click.IntRange(1, 64), default=3, show_default=True,
                 help="Built-in prompts per run."),
    click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=32, show_default=True),
)
@option_group(
    "extra", ExtraRows,
    click.option("--rows", "row_files", multiple=True, type=click.Path(path_type=Path, exists=True, dir_okay=False),
                 help="Add the rows of an earlier calibration.json (a corpus run elsewhere or in parts)."),
    click.option("--traces", "traces", multiple=True, type=click.Path(path_type=Path, exists=True, dir_okay=False),
                 help="Engine traces recorded elsewhere (SGLang captures) to add as rows (repeatable)."),
)
@option_group(
    "overrides", Overrides,
    click.option("--bounds", default="", help="Replace cheap bounds for this measurement, e.g. "
                 "'logprob_abs=0.5,tensor_rel_l2=0.1' (fields of refcheck.diff.tolerance.Tolerance)."),
    click.option("--rule", "rule_text", default="", help="Replace rule settings, e.g. 'factor=3,samples=16'."),
)
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Corpus runs over N processes (on one GPU they share it).")
def calibrate(output: OutputOptions, corpus: CorpusOptions, extra: ExtraRows, overrides: Overrides,
              workers: int) -> None:
    """Measure the verdict: clean engines must pass, every fault must fail where it first acts.

    Dtypes with no measured calibration are run with their candidate bounds (refcheck/diff/tolerance.py)."""
    from refcheck.calibrate import calibration_under_test, row_of_trace, run_one
    from refcheck.outputs import check_output_dir
    from refcheck.parallel import run_parallel

    check_label(corpus.label)
    out_dir = output.out
    check_output_dir(out_dir, "--out", OUT_FILES)  # before any model loads
    quiet()
    dtypes = list(corpus.dtypes) or ["bfloat16", "float16"]
    ref_device = corpus.ref_device or corpus.device
    runs = _corpus_runs(corpus, dtypes)
    if output.save_traces:
        check_output_dir(out_dir, "--out", [f"traces/{run.name}.arrow" for run in runs])
    earlier = _earlier_rows(extra.row_files)
    over, rule = overrides.parsed()
    for d in dtypes:  # a bad field or an unknown dtype: a usage error before any run
        calibration_under_test(d, corpus.device, over, rule)
    out_dir.mkdir(parents=True, exist_ok=True)
    traces = extra.traces
    err.print(f"calibrate: {len(runs)} runs + {len(traces)} traces, {workers} process(es)", markup=False)
    results = run_parallel(run_one, [(r, corpus.n_prompts, corpus.max_new_tokens, ref_device, over, rule) for r in runs],
                           workers)
    rows = [row for row, _ in results]
    if output.save_traces:
        _save_traces(out_dir, runs, [data for _, data in results])
    rows += run_parallel(row_of_trace, [(str(p), name, ref_device, over, rule) for p, name in zip(traces, trace_names(traces))],
                         workers)
    _finish(out_dir, rows + earlier, output.as_json)


def _corpus_runs(corpus: CorpusOptions, dtypes: list[str]) -> list[CorpusRun]:
    """The corpus's runs (none with ``--no-corpus``); unknown faults or budgets, and a wrong ``--model`` pair, are
    usage errors before any run."""
    from refcheck.calibrate import CLEAN_BUDGETS, default_corpus
    from refcheck.sweep import parse_budgets

    names = [] if corpus.no_faults else _fault_names(corpus.faults)
    blist = tuple(parse_budgets(",".join(corpus.budgets))) if corpus.budgets else CLEAN_BUDGETS
    own = _own_pair(corpus.model_dir, corpus.draft_dir, corpus.pairs, corpus.label)
    if corpus.no_corpus:
        return []
    runs = default_corpus(dtypes, corpus.device, names, corpus.pairs or ("hybrid", "attention"), blist, own)
    return [r for r in runs if not r.long] if corpus.no_long else runs


def check_label(label: str | None) -> None:
    """``--label`` names files (OUT/traces/RUN.arrow): a plain name, else a :class:`UsageError`."""
    if label is not None and (label in ("", ".", "..") or "/" in label or "\\" in label or not label.isprintable()):
        raise UsageError(f"--label {label!r} names the runs' files (OUT/traces/RUN.arrow): give a plain name, without "
                         "'/' or '\\', not '.' or '..' (nothing was run)")


def _own_pair(model_dir: Path | None, draft_dir: Path | None, pairs: tuple[str, ...],
              label: str | None) -> tuple[str, str, str] | None:
    """(label, target dir, draft dir) of ``--model``/``--draft``, the pair loaded once to refuse a wrong one
    before any run; None for the built-in pairs."""
    if (model_dir is None) != (draft_dir is None):
        raise UsageError("--model and --draft go together (a target and its DFlash draft)")
    if model_dir is None:
        return None
    if pairs:
        raise UsageError("--pair names built-in pairs; with --model the corpus runs on that pair alone")
    from refcheck.reference_runner import EngineSpec, load_pair

    load_pair(EngineSpec(model_dir=model_dir, draft_dir=draft_dir))
    return (label or model_dir.resolve().parent.name, str(model_dir), str(draft_dir))


def _earlier_rows(row_files: tuple[Path, ...]) -> list[dict]:
    """The rows of the ``--rows`` files (read before any run: a bad file is a usage error at once)."""
    rows: list[dict] = []
    for f in row_files:
        try:
            rows += json.loads(f.read_text())["rows"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--rows {f}: not a calibration.json ({exc})") from None
    return rows


def _save_traces(out_dir: Path, corpus: list, traces: list[bytes]) -> None:
    from refcheck.atomic_file import atomic_write_bytes

    (out_dir / "traces").mkdir(exist_ok=True)
    for run, data in zip(corpus, traces):
        atomic_write_bytes(out_dir / "traces" / f"{run.name}.arrow", data)


def _finish(out_dir: Path, rows: list[dict], as_json: bool) -> None:
    """Write calibration.json and calibration.md (a run in two parts counts once: the first row of a name), print
    the table and exit: 0 when clean runs pass and every fault is caught untriaged, else 1."""
    from refcheck.atomic_file import atomic_write_bytes
    from refcheck.calibrate import markdown, summarize

    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(r["name"], r)
    rows = list(first.values())
    summary = summarize(rows)
    atomic_write_bytes(out_dir / "calibration.json",
                       (json.dumps({"summary": summary, "rows": rows}, indent=1, default=str) + "\n").encode())
    text = markdown(rows, summary)
    atomic_write_bytes(out_dir / "calibration.md", text.encode())
    for line in text.splitlines():  # a line at a time: each one line on the console, whatever a row's name holds
        err.print(line, markup=False)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    ok = summary["false_alarms"] == 0 and summary["detected"] == summary["faulty_runs"] \
        and summary["faulty_nodes_triaged"] == 0
    sys.exit(EXIT_PASS if ok else EXIT_MISMATCH)
