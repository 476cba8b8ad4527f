"""``refcheck matrix``: SGLang algorithms x production settings, one verdict, τ, speed and capture overhead per cell."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from refcheck.cli.app import err, main, progress_line, quiet
from refcheck.cli.options import DeviceType
from refcheck.errors import EXIT_MISMATCH, EXIT_PASS


@main.command()
@click.option("--algorithms", default="NONE,DFLASH,NGRAM,REFCHECK_DDTREE", show_default=True,
              help="Comma list of SGLang algorithms (budgets: DFLASH 15, NGRAM 11 breadth 10, REFCHECK_DDTREE 15).")
@click.option("--settings", "setting_names", default="default,graphs,overlap,radix,prefix,page16,page64,mixed32,long,together,together-radix,tp2,tp2-graphs",
              show_default=True, help="Comma list of production settings (--list shows what each one is).")
@click.option("--cells", "cell_names", default=None,
              help="Exactly these cells instead of --algorithms x --settings: a comma list of ALGORITHM-setting "
                   "(e.g. DFLASH-radix,NGRAM-mixed32).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("matrix-out"), show_default=True,
              help="Directory for matrix.json, matrix.md and every cell's trace (traces/CELL.arrow).")
@click.option("--pair", default="hybrid", show_default=True, help="Built-in model pair.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="New tokens per request where the workload does not set its own.")
@click.option("--parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Cells run side by side on the one GPU (engine starts spaced by --stagger).")
@click.option("--stagger", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds between engine starts with --parallel (each sizes its memory pools alone).")
@click.option("--diff-processes", type=click.IntRange(min=0), default=4, show_default=True,
              help="Replay diffs run as this many refcheck processes at once (0: in this process, one at a time).")
@click.option("--mem-fraction", type=click.FloatRange(0.01, 0.95), default=0.12, show_default=True,
              help="SGLang's mem_fraction_static per cell.")
@click.option("--ref-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--ref-device", type=DeviceType(), default="cuda", show_default=True)
@click.option("--resume", "resume", type=click.Path(path_type=Path), default=None,
              help="An earlier run's matrix.partial.json or matrix.json: its finished cells are kept, the rest run.")
@click.option("--list", "list_only", is_flag=True, help="Print the settings and algorithms, run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Also print the result as JSON on stdout.")
def matrix(algorithms, setting_names, cell_names, out_dir, pair, max_new_tokens, parallel, stagger, diff_processes, mem_fraction, ref_dtype,
           ref_device, resume, list_only, as_json):
    """Run every (algorithm, setting) cell beside the reference: verdict, first finding, τ, warm tok/s, capture
    overhead and whether capture left the tokens unchanged; writes matrix.json and matrix.md.

    Exit 0 when every cell that ran passed, 1 when one failed (cells that could not run are listed with
    their reason and do not fail the run)."""
    from refcheck.atomic_file import atomic_write_bytes
    from refcheck.outputs import check_output_dir
    from refcheck.reference_runner import EngineSpec
    from refcheck.sglang.matrix import (
        ALGORITHMS,
        NOT_RUNNABLE,
        SETTINGS,
        MatrixRun,
        cells,
        finished_rows,
        markdown,
        named_cells,
    )

    if cell_names:
        todo = named_cells([c.strip() for c in cell_names.split(",") if c.strip()])
    else:
        todo = cells([a.strip().upper() for a in algorithms.split(",") if a.strip()],
                     [s.strip() for s in setting_names.split(",") if s.strip()])
    if list_only:
        for s in SETTINGS.values():
            err.print(f"{s.name:9} --sglang-settings {s.serving or 'default':42} on {s.workload:13} {s.note}", markup=False)
        err.print("algorithms: " + ", ".join(f"{a} (budget {b[0]})" for a, b in ALGORITHMS.items()), markup=False)
        for name, why in NOT_RUNNABLE.items():
            err.print(f"not runnable: {name}: {why}", markup=False)
        sys.exit(EXIT_PASS)
    done = finished_rows(resume) if resume else {}  # a bad file: exit 2 before any engine starts
    quiet()
    check_output_dir(out_dir, "--out", ["matrix.json", "matrix.md", "matrix.partial.json",
                                        *(f"traces/{c.name}.arrow" for c in todo)])
    import torch

    spec = EngineSpec(pair=pair, dtype="bfloat16", device="cuda", max_new_tokens=max_new_tokens)
    run = MatrixRun(spec, out_dir, ref_dtype=ref_dtype, ref_device=ref_device, mem_fraction=mem_fraction,
                    diff_processes=diff_processes,
                    gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0, progress=progress_line)
    result = _run(run, todo, done, out_dir, parallel, stagger)
    atomic_write_bytes(out_dir / "matrix.json", (json.dumps(result, indent=2) + "\n").encode())
    atomic_write_bytes(out_dir / "matrix.md", markdown(result).encode())
    _print_table(result, len(todo))
    err.print(f"wrote {out_dir / 'matrix.json'}, {out_dir / 'matrix.md'}", markup=False)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    failed = [r for r in result["rows"] if r["status"] == "run" and r["verdict"] == "fail"]
    sys.exit(EXIT_MISMATCH if failed else EXIT_PASS)


def _print_table(result: dict, n_cells: int) -> None:
    from refcheck.sglang.matrix import overhead_text

    table = Table(title=f"refcheck matrix · SGLang · {result['model']} · {n_cells} cells · {result['wall_s']:.0f} s")
    for col in ("algorithm", "setting", "verdict", "first finding", "τ", "tok/s", "overhead", "capture off"):
        table.add_column(col)
    for r in result["rows"]:
        if r["status"] != "run":
            table.add_row(r["algorithm"], r["setting"], "not run", r["reason"][:100], "", "", "", "")
            continue
        table.add_row(r["algorithm"], r["setting"], r["verdict"], (r["first_finding"] or "-")[:100],
                      f"{r['tau']:.2f}" if r["tau"] else "-",
                      f"{r['warm_tokens_per_s']:.0f}" if r["warm_tokens_per_s"] else "-",
                      overhead_text(r), r.get("capture_off_twin") or "-")
    err.print(table)


def _run(run, todo: list, done: dict, out_dir: Path, parallel: int, stagger: float) -> dict:
    """The cells not finished before (``--resume``), each row written to ``matrix.partial.json`` as it finishes."""
    from refcheck.atomic_file import atomic_write_bytes
    from refcheck.sglang.matrix import resumed, run_matrix

    out_dir.mkdir(parents=True, exist_ok=True)
    finished: list[dict] = list(done.values())  # a resumed run's partial file keeps the earlier cells too

    def partial(row: dict) -> None:  # every finished cell on disk at once: a run cut short keeps them
        finished.append(row)
        atomic_write_bytes(out_dir / "matrix.partial.json", (json.dumps({"rows": finished}, indent=1) + "\n").encode())

    return resumed(run_matrix(run, [c for c in todo if c.name not in done], parallel, stagger, on_row=partial), todo, done)
