"""The SGLang settings matrix: algorithms x production settings, each cell captured, diffed and timed.

Contract: :data:`SETTINGS` names the production settings a cell runs under (one at a time, then
together), each with the workload that exercises it (:mod:`refcheck.prompts.workloads`);
:data:`ALGORITHMS` the speculative algorithms and their budgets. :func:`run_matrix` runs every
(algorithm, setting) cell: one SGLang engine per cell (through :class:`~refcheck.sglang.runner.SGLangRunner`,
or ``runner_factory`` in tests), one untraced warm-up pass, the captured pass, one untraced timing
pass, then the replay diff against the reference. Cells run ``parallel`` at a time on one GPU
(engine starts spaced by ``stagger_s``: SGLang sizes its pools from the memory free when it starts);
diffs run one at a time. Each row (:func:`cell_row`) holds the verdict, the first finding, τ (mean
accepted nodes per verify step, bonus counted), warm tokens/s (untraced pass), the capture overhead
(captured pass time / untraced pass time, both warm), whether capture left the tokens unchanged (the
untraced passes' outputs equal the captured one's; greedy cells only), the capture's problems and
the saved trace for ``refcheck explain``. A cell that cannot run (an engine that does not start, a
setting that needs two GPUs, a refusal) is a row with ``status`` ``not run`` and the reason: never
silently missing. :func:`markdown` renders the table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refcheck.diff.place import earliest, where
from refcheck.errors import ModelError, RefcheckError, UsageError
from refcheck.lifetime import end_with
from refcheck.progress import Progress, tell
from refcheck.prompts import Prompt
from refcheck.prompts.workloads import needed_context, workload
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.settings import ServingSettings, parse_settings

if TYPE_CHECKING:
    from refcheck.pool import ReferencePool


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    serving: str  # the --sglang-settings list
    workload: str
    note: str
    gpus: int = 1  # tensor parallelism needs this many GPUs


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("default", "", "builtin", "refcheck's safest corner: eager, no overlap, no radix cache, page 1"),
    Setting("graphs", "graphs", "builtin", "CUDA graphs (decode and verify replayed)"),
    Setting("overlap", "overlap", "builtin", "the overlap scheduler (results processed one step late)"),
    Setting("radix", "radix,stagger=40", "shared-prefix", "radix cache, prefixes shared, requests resuming from it"),
    Setting("prefix", "stagger=40", "shared-prefix", "the radix cell's workload without the cache (its control)"),
    Setting("page16", "page=16", "builtin", "KV pages of 16 tokens"),
    Setting("page64", "page=64", "builtin", "KV pages of 64 tokens"),
    Setting("mixed32", "stagger=25", "mixed", "32 requests of mixed lengths arriving one every 25 ms"),
    Setting("long", "chunk=1024", "long", "prompts of 4k and 16k tokens through chunked prefill (1024)"),
    # SGLang 0.5.17 runs a hybrid's radix cache only at page 1 without overlap (radix_refusal): two cells at once
    Setting("together", "graphs,overlap,page=16,stagger=25", "mixed",
            "graphs, overlap, pages of 16 and 32 staggered mixed requests at once"),
    Setting("together-radix", "graphs,radix,stagger=25", "shared-prefix",
            "graphs and the radix cache at once, prefixes shared (a hybrid's radix cache runs at page 1, no overlap)"),
    Setting("tp2", "", "builtin", "tensor parallelism 2", gpus=2),
    Setting("tp2-graphs", "graphs", "builtin", "tensor parallelism 2 with CUDA graphs", gpus=2),
)}

#: algorithm -> (budget, extra runner options)
ALGORITHMS: dict[str, tuple[int | None, dict[str, Any]]] = {
    "NONE": (None, {}),
    "DFLASH": (15, {}),
    "NGRAM": (11, {"ngram_breadth": 10}),
    "REFCHECK_DDTREE": (15, {}),
}
#: algorithms SGLang 0.5.17 has that no cell can run here, and why
NOT_RUNNABLE = {
    "EAGLE / NEXTN (topk > 1)": "needs an EAGLE / MTP draft head trained for the target; refcheck builds only DFlash "
                                "drafts, and the built-in Qwen3.5 target has no MTP layers",
}
LONG_CONTEXT = 32768
#: SGLang's start-up error when the free memory it measured changed under it (another engine starting)
MEMORY_RACE = "leave no GPU memory for the KV cache"


@dataclass(frozen=True, slots=True)
class Cell:
    algorithm: str
    setting: Setting

    @property
    def name(self) -> str:
        return f"{self.algorithm}-{self.setting.name}"


def named_cells(names: list[str]) -> list[Cell]:
    """Cells named ``ALGORITHM-setting`` (``DFLASH-radix``), refusing unknown ones (exit 2)."""
    out = []
    for name in names:
        alg, _, setting = name.rpartition("-") if name.count("-") else (name, "", "")
        for a in sorted(ALGORITHMS, key=len, reverse=True):  # REFCHECK_DDTREE-... before shorter names
            if name.startswith(a + "-"):
                alg, setting = a, name[len(a) + 1:]
                break
        out.extend(cells([alg], [setting]))
    return out


def cells(algorithms: list[str], settings: list[str]) -> list[Cell]:
    """The cells of the matrix, refusing unknown names (exit 2)."""
    bad_a = [a for a in algorithms if a not in ALGORITHMS]
    bad_s = [s for s in settings if s not in SETTINGS]
    if bad_a or bad_s:
        raise UsageError("unknown " + "; ".join(
            ([f"algorithm(s) {', '.join(bad_a)} (known: {', '.join(ALGORITHMS)})"] if bad_a else [])
            + ([f"setting(s) {', '.join(bad_s)} (known: {', '.join(SETTINGS)})"] if bad_s else [])))
    return [Cell(a, SETTINGS[s]) for s in settings for a in algorithms]


def _tau(trace) -> float | None:
    lens = [s.accept_length for s in trace.steps]
    return statistics.mean(lens) if lens else None


def _first(report: dict[str, Any]) -> str:
    f = earliest((report.get("first_divergence") or {}).values())
    return f"{where(f)}: {str(f.get('message', ''))[:140]}" if f is not None else ""


def cell_row(cell: Cell, trace, report: dict[str, Any], trace_path: Path | None, greedy: bool) -> dict[str, Any]:
    """One table row from a cell's trace and its replay report (``Report.to_json()``)."""
    st = trace.prov.settings
    emitted = sum(len(r.output_ids) for r in trace.requests)
    captured_s = st.get("generate_s") or None
    warm = [t for t in st.get("repeat_generate_s") or [] if t > 0]
    warm_s = statistics.median(warm) if warm else None
    cap = trace.provenance.get("capture", {})
    unchanged = None
    if greedy and (st.get("warmup_match") is not None or st.get("repeats_match") is not None):
        unchanged = all(v is not False for v in (st.get("warmup_match"), st.get("repeats_match")))
    return {
        "cell": cell.name, "algorithm": cell.algorithm, "setting": cell.setting.name, "serving": st.get("serving_label"),
        "workload": cell.setting.workload, "status": "run", "verdict": report["verdict"], "counts": report["counts"],
        "fail_categories": sorted(report.get("fail_categories") or {}), "first_finding": _first(report),
        "requests": len(trace.requests), "steps": len(trace.steps), "tau": _tau(trace),
        "warm_tokens_per_s": emitted / warm_s if warm_s else None,
        "capture_overhead": captured_s / warm_s if captured_s and warm_s else None,
        "tokens_unchanged_by_capture": unchanged, "engine_start_s": st.get("engine_start_s"),
        "captured_generate_s": captured_s, "untraced_generate_s": warm_s,
        "capture_problems": (cap.get("problems") or [])[:5] + (cap.get("errors") or [])[:5],
        "capture_incomplete": cap.get("incomplete") or [],
        "graphed_steps": (cap.get("stats") or {}).get("cuda_graph_steps"),
        "committed_lag_max": (cap.get("stats") or {}).get("committed_lag_max"),
        "trace": str(trace_path) if trace_path else None,
        "explain": f"refcheck explain {trace_path}" if trace_path and report["verdict"] == "fail" else None,
        "outputs": {r.request_id: list(r.output_ids) for r in trace.requests},  # for the capture-off twin
    }


def not_run(cell: Cell, reason: str) -> dict[str, Any]:
    return {"cell": cell.name, "algorithm": cell.algorithm, "setting": cell.setting.name,
            "serving": cell.setting.serving or "default", "workload": cell.setting.workload, "status": "not run",
            "verdict": None, "reason": reason}


@dataclass
class MatrixRun:
    """What every cell shares: the model, the reference's numerics, where traces go."""

    spec: EngineSpec
    out: Path
    ref_dtype: str = "float32"
    ref_device: str = "cuda"
    mem_fraction: float = 0.12
    gpus: int = 1
    runner_factory: Callable | None = None
    progress: Progress | None = None
    #: diffs as ``refcheck diff --against`` processes (real parallelism; the replay is Python-bound), at most
    #: this many at once; 0: in this process, one at a time (tests, and machines without spare cores)
    diff_processes: int = 4
    twin: str | None = "DFLASH"  # per setting, this algorithm also runs once with capture off (tokens and timing)
    pool: ReferencePool | None = field(default=None, repr=False)  # the in-process diffs' reference, shared by cells
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _made: dict[str, Any] = field(default_factory=dict, repr=False)  # workloads and the long-context pair, made once

    def _once(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` the first time a cell asks for ``key`` (cells run in threads: one of them makes it)."""
        with self._lock:
            if key not in self._made:
                self._made[key] = make()
            return self._made[key]

    def prompts_for(self, cell: Cell) -> tuple[list[Prompt], EngineSpec]:
        """The cell's workload and the spec it runs on: a workload longer than the target's context runs on a
        long-context copy of the pair (made once per run)."""
        from refcheck.sglang.pair import target_context

        prompts = list(self._once(f"workload:{cell.setting.workload}", lambda: workload(cell.setting.workload)))
        spec = dataclasses.replace(self.spec, budget=ALGORITHMS[cell.algorithm][0])
        tdir, ddir = self.spec.resolved_dirs()
        if needed_context(prompts, spec.max_new_tokens) > (target_context(tdir) or LONG_CONTEXT):
            from refcheck.models.context import extend_context

            t2, d2 = self._once("long-context-pair",
                                lambda: extend_context(tdir, ddir, self.out / "long-context-pair", LONG_CONTEXT))
            spec = dataclasses.replace(spec, model_dir=t2, draft_dir=d2)
        return prompts, spec


def _factory(run: MatrixRun) -> Callable:
    if run.runner_factory is not None:
        return run.runner_factory
    from refcheck.sglang.runner import SGLangRunner

    return SGLangRunner


def _engine_run(run: MatrixRun, cell: Cell, capture: bool, before_engine: Callable[[], None] | None):
    """The cell's SGLang run (warm-up, the pass, one timing pass); RefcheckError when it cannot run."""
    prompts, spec = run.prompts_for(cell)
    settings: ServingSettings = parse_settings(cell.setting.serving)
    extra = dict(ALGORITHMS[cell.algorithm][1])
    if not capture:
        extra["capture"] = False
    runner = _factory(run)(spec, cell.algorithm, settings=settings, timing_repeats=1, warmup=True,
                           mem_fraction=run.mem_fraction, tp=cell.setting.gpus,
                           capture_dir=run.out / "capture" / (cell.name + ("" if capture else "-twin")), **extra)
    for attempt in range(3):
        if before_engine is not None:
            before_engine()
        try:
            return runner.trace(prompts), spec
        except ModelError as exc:
            # engines starting side by side: SGLang measures the free memory before and after loading weights,
            # and another engine allocating its pools in between reads as "no memory left": start again later
            if MEMORY_RACE not in str(exc) or attempt == 2:
                raise
            time.sleep(5.0 * (attempt + 1))
    raise AssertionError("unreachable")


def _diff(run: MatrixRun, cell: Cell, trace, path: Path, gate: threading.Semaphore) -> dict[str, Any]:
    """The replay verdict as ``Report.to_json()``: in a ``refcheck diff --against`` process, or in this one."""
    with gate:
        if run.diff_processes <= 0:
            from refcheck.diff.judge import judge
            from refcheck.pool import ReferencePool

            if run.pool is None:
                run.pool = ReferencePool()
            report = judge(trace, run.pool, cell.name, mode="replay", ref_dtype=run.ref_dtype, ref_device=run.ref_device)
            return report.to_json()
        cmd = [sys.executable, "-m", "refcheck", "diff", "--against", str(path), "--mode", "replay", "--ref-dtype",
               run.ref_dtype, "--ref-device", run.ref_device, "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **end_with()})  # ends with the matrix
    try:
        return json.loads(p.stdout)["reports"][0]
    except (ValueError, KeyError, IndexError):
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        raise RefcheckError(f"the diff of {path} exited {p.returncode} without a report: {tail}") from None


def run_cell(run: MatrixRun, cell: Cell, gate: threading.Semaphore,
             before_engine: Callable[[], None] | None = None) -> dict:
    if cell.setting.gpus > run.gpus:
        return not_run(cell, f"needs {cell.setting.gpus} GPU{'s' if cell.setting.gpus > 1 else ''}, this machine has {run.gpus}")
    from refcheck.trace.io import write_trace

    try:
        trace, spec = _engine_run(run, cell, True, before_engine)
        path = run.out / "traces" / f"{cell.name}.arrow"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_trace(trace, path)
        report = _diff(run, cell, trace, path, gate)
    except RefcheckError as exc:  # refused, SGLang did not start, the diff died: the reason is the cell
        return not_run(cell, f"{type(exc).__name__}: {exc}")
    row = cell_row(cell, trace, report, path, not spec.sampled)
    if row["tokens_unchanged_by_capture"] is False:
        row["untraced_judged"] = _judge_untraced(run, trace, gate)
    return row


_REFERENCE_LOCK = threading.Lock()  # cells run in threads; models are loaded (and run) one thread at a time


def _judge_untraced(run: MatrixRun, trace, gate: threading.Semaphore) -> dict[str, Any] | None:
    """The untraced passes' differences from the captured one, held to the reference's near-ties
    (:mod:`refcheck.sglang.capture_effect`), with this process's reference."""
    from refcheck.pool import ReferencePool, reference_spec_for
    from refcheck.sglang.capture_effect import judge_untraced

    with gate, _REFERENCE_LOCK:
        if run.pool is None:
            run.pool = ReferencePool()
        return judge_untraced(trace, run.pool.runner(reference_spec_for(trace, run.ref_dtype, run.ref_device)).target)


def run_twin(run: MatrixRun, cell: Cell, before_engine: Callable[[], None] | None = None) -> dict:
    """The cell again with capture off (no plugin hooks at all): its outputs and pass times (also written to the
    partial rows as it finishes, so a run cut short keeps the comparison's data)."""
    try:
        trace, _ = _engine_run(run, cell, False, before_engine)
    except RefcheckError as exc:
        return {"twin_error": f"{type(exc).__name__}: {exc}"}
    st = trace.prov.settings
    return {"outputs": {r.request_id: list(r.output_ids) for r in trace.requests}, "generate_s": st.get("generate_s"),
            "repeat_generate_s": st.get("repeat_generate_s")}


def merge_twin(row: dict[str, Any], twin: dict[str, Any]) -> None:
    """The capture-off twin's verdict on a captured row: tokens identical, and the overhead warm against warm."""
    if "twin_error" in twin:
        row["capture_off_twin"] = twin["twin_error"]
        return
    ours, theirs = row.get("outputs") or {}, twin["outputs"]
    differ = sorted(k for k in theirs if ours.get(k) != theirs[k])
    row["capture_off_twin"] = "tokens identical" if not differ else f"{len(differ)} request(s) differ: {differ[:4]}"
    row["tokens_identical_to_capture_off"] = not differ
    twin_s = statistics.median([t for t in twin.get("repeat_generate_s") or [] if t > 0] or [0.0]) or twin.get("generate_s")
    st = row.get("captured_generate_s")
    row["capture_overhead_vs_off"] = st / twin_s if st and twin_s else None


def run_matrix(run: MatrixRun, todo: list[Cell], parallel: int = 1, stagger_s: float = 10.0,
               on_row: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Every cell of ``todo`` (and, per setting, the capture-off twin of ``run.twin``'s cell); rows in ``todo``'s
    order. ``on_row`` sees each row as its cell finishes (the command writes the rows so far, so a run cut short
    keeps every finished cell)."""
    gate, start_lock = threading.Semaphore(max(1, run.diff_processes)), threading.Lock()
    starts = {"next": 0.0}
    t0 = time.time()

    def slot() -> None:
        with start_lock:
            now = time.time()
            at = max(now, starts["next"])
            starts["next"] = at + stagger_s
        time.sleep(max(0.0, at - now))

    def one(task: tuple[str, Cell]) -> dict:
        kind, cell = task
        tell(run.progress, f"{cell.name}{' (capture off)' if kind == 'twin' else ''}: {cell.setting.note}")
        t = time.time()
        if kind == "twin":
            row = {"twin_of": cell.name, **run_twin(run, cell, slot if parallel > 1 else None)}
        else:
            row = run_cell(run, cell, gate, slot if parallel > 1 else None)
        row["wall_s"] = round(time.time() - t, 1)
        if on_row is not None:
            with start_lock:
                on_row(row)
        return row

    tasks = [("cell", c) for c in todo]
    tasks += [("twin", c) for c in todo if c.algorithm == run.twin and c.setting.gpus <= run.gpus]
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        results = list(pool.map(one, tasks))
    rows = results[:len(todo)]
    for (_, cell), twin in zip(tasks[len(todo):], results[len(todo):]):
        row = rows[todo.index(cell)]
        if row["status"] == "run":
            merge_twin(row, twin)
    for row in rows:
        row.pop("outputs", None)
    return {"model": run.spec.model_label, "dtype": run.spec.dtype, "ref_dtype": run.ref_dtype,
            "max_new_tokens": run.spec.max_new_tokens, "parallel": parallel, "wall_s": round(time.time() - t0, 1),
            "settings": {s.name: {"serving": s.serving or "default", "workload": s.workload, "note": s.note}
                         for s in {c.setting for c in todo}},
            "not_runnable_algorithms": NOT_RUNNABLE, "rows": rows}


def finished_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The cells a cut-short run finished (its ``matrix.partial.json`` or ``matrix.json``): name -> row, for
    ``matrix --resume``. A cell that ran, or was refused for a reason of its own, is finished; one that was only
    not reached, or that needed more GPUs than that machine had, is not. Twin rows come back under ``twin:CELL``."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except FileNotFoundError:
        raise UsageError(f"--resume: no such file {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--resume: {path} is not a matrix result ({type(exc).__name__}: {exc})") from None
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if not isinstance(r, dict):
            raise UsageError(f"--resume: {path} holds a row that is not an object")
        if "twin_of" in r:
            out[f"twin:{r['twin_of']}"] = r
        elif r.get("status") == "run" or (r.get("status") == "not run" and not _retry(str(r.get("reason")))):
            out[str(r.get("cell"))] = r
    return out


def _retry(reason: str) -> bool:
    """A cell not run for a reason another run may not have: not reached in time, or a machine with too few GPUs."""
    return "not reached" in reason or ("needs" in reason and "GPU" in reason and "this machine has" in reason)


def resumed(result: dict[str, Any], todo: list[Cell], done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``result`` (the cells run now) with the finished rows of an earlier run, in ``todo``'s order."""
    new = {r["cell"]: r for r in result["rows"]}
    rows = []
    for c in todo:
        row = new.get(c.name) or done[c.name]
        twin = done.get(f"twin:{c.name}")
        if c.name not in new and twin is not None and row.get("status") == "run" and "capture_off_twin" not in row:
            merge_twin(row, twin)
        row.pop("outputs", None)
        rows.append(row)
    return {**result, "rows": rows, "resumed": sorted(set(done) & {c.name for c in todo})}


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def overhead_text(r: dict[str, Any]) -> str:
    """Captured pass / capture-off twin's pass where a twin ran, else / the same engine's untraced pass."""
    if r.get("capture_overhead_vs_off"):
        return f"{r['capture_overhead_vs_off']:.2f}× (vs off)"
    return f"{r['capture_overhead']:.2f}×" if r.get("capture_overhead") else "—"


def markdown(result: dict[str, Any]) -> str:
    """The matrix as a Markdown table (one row per cell), then the reasons of cells not run."""
    from refcheck.sglang.capture_effect import untraced_text

    head = ("| algorithm | setting | verdict | first finding | τ | warm tok/s | capture overhead | capture off: tokens "
            "| untraced passes | steps |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        if r["status"] != "run":
            lines.append(f"| {r['algorithm']} | {r['setting']} | not run | {r['reason'][:160]} | | | | | | |")
            continue
        lines.append(f"| {r['algorithm']} | {r['setting']} | {r['verdict']} | {(r['first_finding'] or '')[:120]} | "
                     f"{_fmt(r['tau'])} | {_fmt(r['warm_tokens_per_s'], '.0f')} | {overhead_text(r)} | "
                     f"{r.get('capture_off_twin') or '—'} | {untraced_text(r)} | {r['steps']} |")
    lines.append("")
    for name, why in result.get("not_runnable_algorithms", {}).items():
        lines.append(f"- {name}: not run: {why}")
    return "\n".join(lines) + "\n"
