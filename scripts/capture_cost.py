"""What capture costs SGLang: full and sampled capture against untraced passes on the same warm engine.

Usage (on a GPU machine with SGLang; through the bundle: ``scripts/sglang_bundle.sh run python3 scripts/...``)::

    python scripts/capture_cost.py --out OUT [--algorithms NONE,DFLASH,NGRAM,REFCHECK_DDTREE] [--graphs off,on]
        [--workloads one,mixed] [--sample 16] [--repeats 3] [--round-budget S] [--no-full] [--mem-fraction 0.3]
        [--diff [--diff-workloads one,mixed]] [--cells ALG:on|off:one|mixed,...] [--engine-per-cell]
        [--deadline SECONDS] [--until SECONDS]
        [--model DIR [--draft DIR]]
    python scripts/capture_cost.py --reread capture_cost.json[.gz]|CELL/result.json [...] [--pool]  # earlier runs, re-read

A cell is an algorithm x CUDA graphs x workload. Neighbouring cells of one algorithm and CUDA graphs share one
SGLang engine, their workloads run in turn on it, the heaviest first (:func:`engines`; ``--engine-per-cell``: an
engine each; one start-up for both workloads of an engine, the engine start being most of a cell's cost besides its
rounds); per cell the engine runs, in order: an untraced warm-up pass, a
captured warm-up pass, the captured pass (every step recorded: the trace), then ``--repeats`` rounds of three
passes interleaved in rotating order (``refcheck/sglang/child.py``): untraced, sampled (1 decode and 1 prefill batch in
``--sample``, rids marked for it) and full capture. Each pass generates the same requests; the overheads are the
median full and sampled passes over the median untraced pass (the first captured pass's ratio beside them, the
untraced passes' max/min as the noise they are read against, and the ratio the engine's books account for,
:func:`booked`), and every pass's tokens are compared with the captured pass's, each full and sampled pass's also
with the untraced pass of its own round (the capture's own effect where the engine's state moves between passes,
as NGRAM's cache does). Each full and sampled pass is
also divided by the untraced pass of its own round (:func:`readings`): the median of those ratios, its 95 %
interval (:func:`median_interval`) and their range; the target column reads that interval against the issue's
lines (:data:`FULL_LIMIT`, :data:`SAMPLED_LIMIT`): within, over, or undecided (more rounds decide; about how many,
:func:`rounds_to_decide`, is printed beside it). The seconds
each pass booked to the scheduler's ``run_batch`` (the engine's own steps, without the client and the scheduler's
loop around them) get the same per-round reading. Trace bytes per verify step are the written Arrow trace's size
over its steps. ``--diff`` also judges each captured trace (replay, the GPU reference when one is visible; steps per second, the
reference's load timed apart) and the sampled pass's trace, assembled from the same capture directory (its verdict
beside the full one's); ``--diff-workloads`` names the workloads whose cells it judges (default both).
``--round-budget`` stops a cell's timing rounds once that many seconds have passed (after three rounds), so
with a large ``--repeats`` a cell of short passes gets many rounds and one of long passes few; ``--no-full`` leaves
the full-capture pass out of the rounds (an untraced and a sampled pass each: more rounds in the budget; the full
ratio is then the captured pass's alone).
``--cells`` names the cells to run, in order, instead of the product of the three lists; ``--deadline`` starts no
engine (none of its cells) once that many seconds have passed since the script began (for a device call's time limit), listing the cells
left in the JSON's last row; ``--until`` ends every cell's timing rounds by that many seconds after the script began
(no round starts that would end later, judged by the cell's longest round so far, and no engine starts past it),
however long each engine took to start, and shares the time among the cells (:func:`share_until`: each cell's
rounds get an equal part of what is left once every engine left has had what an engine costs besides its rounds,
the most a finished engine spent on that, :func:`fixed_cost`, else :data:`FIXED_S`); the last cell's shutdown and trace
reading come after it, so leave them a margin before the call's limit (``scripts/capture_cost_runs.sh`` passes
one). Writes ``OUT/capture_cost.json`` (rows, as they finish, each write whole or not at all; a row's ``--diff``
columns are added once its trace is judged, so a call killed while judging keeps the timings) and
``OUT/capture_cost.md`` (the table); ``--reread`` prints the table of earlier runs' JSON (gzip-compressed where
its name ends in ``.gz``, as docs/results keeps the long ones; or of a cell's engine run, ``OUT/CELL/result.json``,
its timing columns alone: :func:`result_row`) with the per-round readings recomputed from their passes (``--pool``:
one row per cell, the rounds of its runs together).
Workloads: ``one`` (the first built-in prompt), ``mixed`` (refcheck's 32 mixed requests, all at once).
``--model DIR`` (and ``--draft DIR``, the drafter DFLASH and REFCHECK_DDTREE need) runs the cells on that pair
instead of the built-in ``--pair``: the real-width pair of ``scripts/real_width.py build``, where a step is as long
as a 27B-wide one and the capture's host costs weigh accordingly; each row names its pair (``model``).
This file runs the cells and makes their rows; the readings named above (:func:`booked`, :func:`readings`,
:func:`per_round`, :func:`median_interval`, :func:`rounds_to_decide`, the limits) and the re-read and pooled rows
are ``scripts/capture_cost_readings.py``'s, the table ``scripts/capture_cost_table.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # the readings and the table beside this script

from capture_cost_readings import booked, ledger_of, medians, pooled, ratio, readings, reread  # noqa: E402
from capture_cost_table import markdown  # noqa: E402

from refcheck.prompts import load_prompts  # noqa: E402
from refcheck.prompts.workloads import workload  # noqa: E402
from refcheck.reference_runner import EngineSpec  # noqa: E402
from refcheck.sglang.child import TIMING_KINDS  # noqa: E402


def _prompts(name: str) -> list:
    """A workload's prompts (:data:`WORKLOADS`)."""
    return load_prompts()[:1] if name == "one" else list(workload("mixed"))


def timing_row(algorithm: str, graphs: bool, load: str, st: dict[str, Any],
               ledger_fallback: dict[str, Any] | None = None) -> dict[str, Any]:
    """A row's timing columns from the engine run's settings (``st``: the child's ``result.json``, which the
    trace's provenance carries as its settings): each overhead is a median pass of its kind over the median
    untraced pass, the kinds' passes interleaved on one warm engine; the first captured pass over the same untraced
    median as ``overhead_captured``, and each kind's ratios within a round (:func:`per_round`); the batch columns'
    books (:func:`ledger_of`, ``ledger_fallback`` where the passes booked none)."""
    passes = {kind: st.get(times) or [] for kind, (_, times, _) in TIMING_KINDS.items()}
    costs = st.get("pass_costs") or {}
    mid = medians(passes, st.get("generate_s"))
    untraced = mid["untraced_s"]
    return {"algorithm": algorithm, "graphs": graphs, "workload": load, "captured_s": st.get("generate_s"),
            "passes": passes, **mid, "overhead_captured": ratio(st.get("generate_s"), untraced),
            **readings(passes, costs, graphs),
            "booked": {kind: booked(costs, kind, len(passes[kind]), untraced) for kind in ("full", "sampled")},
            "tokens_same_untraced": st.get("repeats_match"), "tokens_same_sampled": st.get("sampled_match"),
            "tokens_same_full": st.get("full_match"), "tokens_same_round": st.get("round_match") or {},
            "round_mismatch": st.get("round_mismatch") or {},
            "capture_behind": st.get("capture_behind") or {}, "ledger": ledger_of(costs, ledger_fallback),
            "pass_costs": costs, "drain_s": st.get("drain_s")}


def row_of(algorithm: str, graphs: bool, load: str, trace: Any, path: Path, fixed: int | None = None) -> dict[str, Any]:
    """One table row from a captured trace written at ``path``: :func:`timing_row` of its provenance's settings (every
    pass's wall time and books), and what the trace itself holds: its requests and steps, bytes per step (the whole
    file's, and with ``fixed``, :func:`refcheck.trace.io.fixed_bytes`, the steps' alone: ``step_bytes_per_step``), the
    capture's errors and statistics."""
    cap = trace.provenance.get("capture", {})
    stats, steps, size = cap.get("stats") or {}, len(trace.steps), path.stat().st_size
    return {**timing_row(algorithm, graphs, load, trace.prov.settings, stats.get("capture_cost")),
            "requests": len(trace.requests), "steps": steps, "graphed_steps": stats.get("cuda_graph_steps"),
            "bytes_per_step": size / steps if steps else None,
            "step_bytes_per_step": (size - fixed) / steps if steps and fixed is not None else None,
            "capture_errors": (cap.get("errors") or [])[:3], "lost_batches": stats.get("lost_batches", 0),
            "capture_host_ms_per_batch": stats.get("capture_host_ms_per_batch"),
            "host": next((st.get("host") for st in cap.get("status") or [] if isinstance(st, dict)), None)}


def result_row(path: Path) -> dict[str, Any]:
    """A cell's row from its engine run's ``result.json`` alone (``OUT/CELL/result.json``; the cell named by its
    directory, :func:`cell_name`): the timing columns, for a cell whose trace was never read (a call cut while the
    trace was read or judged); ValueError when the file is no such result or the directory names no cell."""
    st = json.loads(path.read_text())
    if not isinstance(st, dict) or "repeat_generate_s" not in st:
        raise ValueError(f"{path} is not an engine run's result.json (no repeat_generate_s)")
    algorithm, graphs, load = cell_of_name(path.parent.name)
    job = path.parent / "job.json"
    model = None
    if job.is_file():
        part = json.loads(job.read_text())
        if "engine_kwargs" not in part and part.get("engine_job"):  # a later workload's part: the engine's job
            first = Path(part["engine_job"])
            first = first if first.is_file() else path.parent.parent / first.parent.name / first.name  # results moved
            part = json.loads(first.read_text()) if first.is_file() else part
        model = (part.get("engine_kwargs") or {}).get("model_path")
    return {**timing_row(algorithm, graphs, load, st), "model": model, "trace_read": False}


@functools.cache
def _pool() -> Any:
    """One reference pool for every trace the script judges (the pair is loaded once, not per trace)."""
    from refcheck.pool import ReferencePool

    return ReferencePool()


def judge(trace: Any, name: str) -> dict[str, Any]:
    """``trace`` diffed in replay mode against the float32 reference on the GPU where one is visible: its verdict, the
    failures' categories and first few, and ``diff_steps_per_s`` (its verify steps over the diff's wall time, the
    reference's load left out: ``diff_load_s``, nought once the pool holds the pair)."""
    import torch

    from refcheck.diff.judge import judge as judge_trace

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    _pool().runner_for(trace, name, "float32", device)  # the reference loaded (once per pair) before the diff is timed
    t1 = time.perf_counter()
    rep = judge_trace(trace, _pool(), name, "replay", ref_device=device)
    wall = time.perf_counter() - t1
    return {"verdict": rep.verdict, "fail_categories": sorted({f.category for f in rep.failures}),
            "first_failures": [f"{f.category} {f.request_id} step {f.step}: {f.message[:160]}" for f in rep.failures[:4]],
            "diff_steps_per_s": len(trace.steps) / wall if wall > 0 else None, "diff_load_s": t1 - t0}


def run_engine(args: argparse.Namespace, algorithm: str, graphs: bool, loads: list[str],
               until: float | None) -> list[tuple[dict[str, Any], Any, Any]]:
    """The cells of one engine (``algorithm`` and CUDA graphs, one per workload in ``loads``, run in turn on it):
    each cell's row, its trace and the engine's capture records, read once for all its cells (None, None when the
    engine failed); their timing rounds end by ``until`` (wall
    clock, :func:`share_until`), shared among them. The engine's capture directory is the first cell's, each cell's
    job and result in its own (:func:`cell_name`). The rows hold no verdict: :func:`diffed` judges each trace after
    its row is written."""
    from refcheck.errors import RefcheckError
    from refcheck.sglang.runner import SGLangRunner
    from refcheck.trace.io import fixed_bytes, write_trace

    names = [cell_name(algorithm, graphs, load) for load in loads]
    spec = EngineSpec(model_dir=args.model, draft_dir=args.draft, pair=args.pair, budget=args.budget,
                      max_new_tokens=args.max_new_tokens, dtype="bfloat16", device="cuda")
    try:
        runner = SGLangRunner(spec, algorithm, cuda_graphs=graphs, warmup=True, timing_repeats=args.repeats,
                              sampled_timing=f"{args.sample}:0", mem_fraction=args.mem_fraction,
                              capture_dir=args.out / names[0], timing_budget_s=args.round_budget,
                              full_timing=not args.no_full, timing_until_s=until)
        traces = runner.traces([_prompts(load) for load in loads], [args.out / name for name in names[1:]])
    except RefcheckError as exc:
        return [({"algorithm": algorithm, "graphs": graphs, "workload": load, "model": spec.model_label,
                  "error": f"{type(exc).__name__}: {exc}"}, None, None) for load in loads]
    out = []
    for load, name, trace in zip(loads, names, traces):
        path = args.out / f"{name}.arrow"
        write_trace(trace, path)
        out.append(({**row_of(algorithm, graphs, load, trace, path, fixed_bytes(trace)), "model": spec.model_label,
                     "engine": names[0]},
                    trace, runner.last_capture))
    return out


#: the workloads a cell runs (:func:`_prompts`)
WORKLOADS = ("one", "mixed")


def cell_name(algorithm: str, graphs: bool, load: str) -> str:
    """A cell's directory name, ``algorithm-graphs|eager-workload`` (:func:`cell_of_name` reads it back)."""
    return f"{algorithm.lower()}-{'graphs' if graphs else 'eager'}-{load}"


def cell_of_name(name: str) -> tuple[str, bool, str]:
    """(algorithm, CUDA graphs, workload) of a :func:`cell_name`; ValueError for another name."""
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or parts[1] not in ("graphs", "eager") or parts[2] not in WORKLOADS:
        raise ValueError(f"{name!r} is not a cell's directory (ALGORITHM-graphs|eager-one|mixed)")
    return parts[0].upper(), parts[1] == "graphs", parts[2]


def cell_arg(algorithm: str, graphs: bool, load: str) -> str:
    """A cell as ``--cells`` names it, ``ALGORITHM:on|off:workload`` (:func:`cells` reads it back)."""
    return f"{algorithm}:{'on' if graphs else 'off'}:{load}"


def diffed(args: argparse.Namespace, row: dict[str, Any], trace: Any, capture: Any) -> dict[str, Any]:
    """``--diff``'s columns of a cell's row: its captured trace judged (:func:`judge`), and the sampled pass's trace,
    assembled from its engine's ``capture`` records, judged beside it."""
    from refcheck.trace.io import write_trace

    name = cell_name(row["algorithm"], row["graphs"], row["workload"])
    got = judge(trace, name)
    sampled = sampled_trace(trace, args.out / name, capture)
    if sampled is not None:
        write_trace(sampled, args.out / f"{name}-sampled.arrow")
        judged = judge(sampled, f"{name}-sampled")
        got.update(sampled_steps=len(sampled.steps), sampled_verdict=judged["verdict"],
                   sampled_fail_categories=judged["fail_categories"])
    return got


#: what an engine costs besides its timing rounds (engine start, warm-up and captured passes, shutdown, reading the
#: trace) until one has been measured: a fresh machine's engine starts took 100-145 s
FIXED_S = 150.0


def share_until(until: float | None, now: float, fixed_s: float, engines_left: int, cells_left: int,
                cells: int = 1) -> float | None:
    """The wall-clock end of the next engine's timing rounds under ``--until``: the time left, less ``fixed_s`` for each
    of the ``engines_left`` engines (the next one included), shared equally among the ``cells_left`` cells, the
    next engine's ``cells`` cells taking theirs after its own ``fixed_s``; never past ``until`` (None: no end). An
    engine that ends its rounds early leaves its share to the later ones, each share being taken afresh when an
    engine starts."""
    if until is None:
        return None
    spare = max(until - now - engines_left * fixed_s, 0.0)
    return min(until, now + fixed_s + spare * cells / cells_left)


def fixed_cost(rows: list[dict[str, Any]], wall_s: float) -> float:
    """What a finished engine spent outside its cells' timing rounds: its wall time less their passes' (a failed
    engine's whole wall time)."""
    spent = 0.0
    for row in rows:
        passes: dict[str, list[float]] = row["passes"] if isinstance(row.get("passes"), dict) else {}
        spent += sum(float(sum(times)) for times in passes.values())
    return max(wall_s - spent, 0.0)


def sampled_trace(trace: Any, cdir: Path, capture: Any) -> Any:
    """The sampled pass's trace, from the records its marked rids (the cell's ``job.json``) left in its engine's
    ``capture``, under the rule the rids carry."""
    from refcheck.prompts import Prompt
    from refcheck.sglang.capture.assemble import assemble_trace
    from refcheck.sglang.capture.sample_rule import SampleRule, rule_for

    job = json.loads((cdir / "job.json").read_text())
    if not job.get("sampled_rids") or not trace.prov.settings.get("sampled_match"):
        return None
    prompts = [Prompt(r.request_id, tuple(r.prompt_ids), r.kind) for r in trace.requests]
    rids = {p.id: rid for p, rid in zip(prompts, job["sampled_rids"][0])}
    results = {r.request_id: {"output_ids": list(r.output_ids)} for r in trace.requests}
    prov = json.loads(json.dumps(trace.provenance, default=str))
    asm = assemble_trace(prompts, rids, results, capture, prov)
    rule = rule_for(job["sampled_rids"][0][0], SampleRule())
    asm.trace.provenance["capture"] = {**prov.get("capture", {}), "problems": asm.problems[:50], "stats": asm.stats,
                                       "sample": rule.to_json()}
    return asm.trace


def cells(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """The (algorithm, CUDA graphs, workload) cells to run, in order; ValueError names a malformed one."""
    if args.cells is None:
        return [(a, g == "on", w) for a in args.algorithms.split(",") for g in args.graphs.split(",")
                for w in args.workloads.split(",")]
    out = []
    for cell in args.cells.split(","):
        parts = cell.split(":")
        if len(parts) != 3 or parts[1] not in ("on", "off") or parts[2] not in WORKLOADS:
            raise ValueError(f"cell {cell!r} is not ALGORITHM:on|off:one|mixed")
        out.append((parts[0], parts[1] == "on", parts[2]))
    return out


def _check_pair(model: Path | None, draft: Path | None) -> None:
    """--model and --draft name directories, and --draft comes with --model; else a UsageError."""
    from refcheck.errors import UsageError

    if draft is not None and model is None:
        raise UsageError("--draft needs --model (the built-in --pair brings its own drafter)")
    for flag, d in (("--model", model), ("--draft", draft)):
        if d is not None and not d.is_dir():
            raise UsageError(f"{flag} {d}: not a directory")


def _checked(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """The cells to run, once every argument is checked (a UsageError or ValueError says which is wrong); sets
    ``args.until_wall``, the rounds' end on the wall clock."""
    from refcheck.errors import UsageError
    from refcheck.sglang.capture.sample_rule import parse
    from refcheck.sglang.runner import timing_budget, timing_until

    todo = cells(args)
    unknown = sorted(set(args.diff_workloads.split(",")) - set(WORKLOADS))
    if unknown:
        raise UsageError(f"--diff-workloads: {','.join(unknown)} is no workload (choose from {', '.join(WORKLOADS)})")
    timing_budget(args.round_budget)
    if args.until is not None and not args.until > 0:
        raise UsageError(f"--until must be > 0 seconds, got {args.until}")
    _check_pair(args.model, args.draft)
    args.until_wall = timing_until(None if args.until is None else time.time() + args.until)
    parse(f"{args.sample}:0")  # the sampled passes' rule: CaptureSampleError (a ValueError) outside its range
    return todo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="required unless --reread")
    ap.add_argument("--reread", type=Path, nargs="+", default=None,
                    help="JSON of earlier runs (capture_cost.json, .json.gz, or a cell's result.json): print their table with "
                         "the per-round reading recomputed, run nothing")
    ap.add_argument("--pool", action="store_true", help="with --reread: one row per cell, its runs' rounds together")
    ap.add_argument("--algorithms", default="NONE,DFLASH,NGRAM,REFCHECK_DDTREE")
    ap.add_argument("--graphs", default="off,on")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--sample", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timing rounds (at most, with --round-budget)")
    ap.add_argument("--round-budget", type=float, default=None,
                    help="seconds of timing rounds per cell: no round starts past it once three have run")
    ap.add_argument("--no-full", action="store_true",
                    help="rounds of an untraced and a sampled pass only (more rounds in a budget; full: the captured pass)")
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--pair", default="hybrid")
    ap.add_argument("--model", type=Path, default=None, help="a target directory instead of the built-in --pair")
    ap.add_argument("--draft", type=Path, default=None, help="with --model: its drafter's directory")
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--diff", action="store_true", help="judge each cell's captured and sampled traces (replay)")
    ap.add_argument("--diff-workloads", default=",".join(WORKLOADS),
                    help="with --diff: the workloads whose cells are judged (at real width a step takes about half "
                         "a second to judge: 'one' keeps the diff inside a device call)")
    ap.add_argument("--cells", default=None, help="ALG:on|off:one|mixed,... (default: every combination)")
    ap.add_argument("--engine-per-cell", action="store_true",
                    help="one engine per cell (by default neighbouring cells of one algorithm and CUDA graphs share "
                         "one, a workload each)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds after which no engine (none of its cells) starts")
    ap.add_argument("--until", type=float, default=None,
                    help="seconds after the script began by which every cell's timing rounds end "
                         "(no engine starts later)")
    args = ap.parse_args(argv)
    if args.reread is not None:
        return _reread(args.reread, args.sample, args.pool)
    if args.out is None:
        ap.error("--out is required (or --reread)")
    from refcheck.errors import UsageError

    try:
        todo = _checked(args)
    except (ValueError, UsageError) as exc:
        print(f"capture_cost: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(run_cells(args, todo), args.sample)
    (args.out / "capture_cost.md").write_text(table)
    print(table)
    return 0


#: the order of an engine's workloads, the heaviest first: a workload's warm-ups and captured pass come out of its
#: own share of the engine's time (refcheck/sglang/child.py's ``part_until``), so the 32 requests' longer setup does
#: not shorten the rounds of the one-request cell after it
HEAVIEST_FIRST = ("mixed", "one")


def engines(todo: list[tuple[str, bool, str]], per_cell: bool = False) -> list[tuple[str, bool, list[str]]]:
    """The engines the cells need, in order: neighbouring cells of one algorithm and CUDA graphs share one, a workload
    each, in :data:`HEAVIEST_FIRST` order (``per_cell``: an engine per cell)."""
    out: list[tuple[str, bool, list[str]]] = []
    for algorithm, graphs, load in todo:
        if out and not per_cell and out[-1][:2] == (algorithm, graphs) and load not in out[-1][2]:
            out[-1][2].append(load)
            out[-1][2].sort(key=HEAVIEST_FIRST.index)
        else:
            out.append((algorithm, graphs, [load]))
    return out


def run_cells(args: argparse.Namespace, todo: list[tuple[str, bool, str]]) -> list[dict[str, Any]]:
    """The cells in order, an engine for each run of neighbouring cells it can serve (:func:`engines`), each row
    written as it ends (its ``--diff`` columns after it), within ``--deadline`` and ``--until`` (each engine's
    rounds ending by :func:`share_until`)."""
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    last_start = min(x for x in (args.deadline, args.until, math.inf) if x is not None)
    fixed: list[float] = []  # each finished engine's cost outside its rounds
    plan = engines(todo, args.engine_per_cell)
    for i, (algorithm, graphs, loads) in enumerate(plan):
        if time.monotonic() - t0 > last_start:
            left = [cell_arg(a, g, load) for a, g, ls in plan[i:] for load in ls]
            print(f"capture_cost: deadline reached, cells not run: {','.join(left)}", flush=True)
            break
        began = time.monotonic()
        until = share_until(args.until_wall, time.time(), max(fixed, default=FIXED_S), len(plan) - i,
                            sum(len(ls) for _, _, ls in plan[i:]), len(loads))
        done = run_engine(args, algorithm, graphs, loads, until)
        fixed.append(fixed_cost([row for row, _, _ in done], time.monotonic() - began))
        for row, trace, capture in done:
            rows.append(row)
            _write_rows(args.out, rows)  # the timing row is kept whatever happens to the diff after it
            if args.diff and trace is not None and row["workload"] in args.diff_workloads.split(","):
                row.update(diffed(args, row, trace, capture))
                _write_rows(args.out, rows)
            print(markdown(rows[-1:], args.sample).splitlines()[-1], flush=True)
    return rows


def _write_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    """The rows so far as ``capture_cost.json``, replaced whole (a call killed mid-write keeps the earlier rows)."""
    from refcheck.atomic_file import atomic_write_bytes

    atomic_write_bytes(out / "capture_cost.json", json.dumps(rows, indent=1, default=str).encode(), durable=False)


def _text_of(path: Path) -> str:
    """A rows file's text, gunzipped where its name ends in ``.gz`` (not gzip: gzip.BadGzipFile, an OSError; cut
    short: EOFError; damaged inside: zlib.error)."""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def _reread(paths: list[Path], sample: int, pool: bool) -> int:
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            data = [result_row(path)] if path.name == "result.json" else json.loads(_text_of(path))
        except (OSError, ValueError, EOFError, zlib.error) as exc:  # zlib.error: a gzip body damaged inside
            print(f"capture_cost: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if not isinstance(data, list):
            print(f"capture_cost: {path} is not a list of rows (capture_cost.json)", file=sys.stderr)
            return 2
        rows += [r for r in data if isinstance(r, dict)]
    print(markdown(pooled(rows) if pool else reread(rows), sample))
    return 0


if __name__ == "__main__":
    sys.exit(main())
