"""Budget sweeps of SGLang engines with a correctness verdict per budget (the seeds' table, checked).

Contract: :func:`run_sglang_sweep` starts one SGLang engine per (algorithm, budget) (by default
refcheck's DDTree and its leaky chain-layout twin), runs the prompts once with capture on, then
``repeats`` more times on the same, now warm, engine untraced (the capture passes those requests
through), and reports: mean τ (bonus counted) and its spread over requests, the scheduler step time
per verify step (median over the captured run's steps), tokens per second over the warm repeats
(median and min–max; the captured run's, which pays first-use kernel compilation and the capture,
apart as ``cold_tokens_per_s``), whether every repeat produced the captured tokens, and the replay
verdict against the reference (pass / benign tie / fail counts, failing categories and the first
divergence with its step, node and layer), and the acceptance account: τ beside the reference's under the same
drafting rule at the same prefixes, the difference split by cause (:mod:`refcheck.diff.acceptance`). Every capture is written to
``save_dir`` (``sweep --out``) so failing rows can be reviewed and re-tabulated later
(:func:`tabulate_traces`, ``sweep --from-traces``). Timings come from the capture,
which synchronises the GPU around each scheduler step and writes its records outside that window.
At T > 0 (``spec.sampling``) the engines sample (REFCHECK_DDTREE with refcheck's keyed sampler,
replayed exactly; NONE / NGRAM with SGLang's generator, judged by the distributional test), the
result carries the sampling parameters, and repeats of SGLang's own generator are not expected to
match the captured tokens (``repeats_match`` is left unset for them).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

from refcheck.diff.judge import judge
from refcheck.diff.place import earliest, where
from refcheck.pool import ReferencePool
from refcheck.progress import Progress, tell
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec
from refcheck.sweep import span
from refcheck.trace.io import write_trace

DEFAULT_ALGORITHMS = ("REFCHECK_DDTREE", "REFCHECK_DDTREE_LEAKY_CHAIN")


def _first(report) -> str:
    f = earliest(report.first_divergence().values())
    return where(f) if f is not None else ""


_STATE_ORDER = ("recurrent", "conv", "kv")


def _first_state(report) -> str:
    """The earliest committed-state failure (recurrent before conv before KV at one step), with its layer:
    where a leak lands in the state the engine carries forward."""
    fails = [f for f in report.failures if f.category in _STATE_ORDER and f.step is not None]
    if not fails:
        return ""
    f = min(fails, key=lambda f: (f.step, _STATE_ORDER.index(f.category), f.layer if f.layer is not None else 1 << 30))
    return f"{f.request_id} step {f.step} · {f.category}" + (f" layer {f.layer}" if f.layer is not None else "")


def _median_ms(trace, phase: str) -> float | None:
    """The median over a trace's steps of one phase's time (NaN where a phase is not reported), in ms."""
    times = [t for t in (s.timings.get(phase) for s in trace.steps) if t is not None and t == t]
    return 1e3 * statistics.median(times) if times else None


def sweep_row(algorithm: str, budget: int, traces: list, report) -> dict:
    """One table row from the repeats' traces of one (algorithm, budget) and the first repeat's report."""
    taus_by_req: dict[str, list[int]] = {}
    step_ms: list[float] = []
    draft_ms: list[float] = []
    tok_s: list[float] = []
    cold: list[float] = []
    repeats_match = None
    for rep, trace in enumerate(traces):
        settings = trace.prov.settings
        emitted = sum(len(r.output_ids) for r in trace.requests)
        captured = [emitted / settings["generate_s"]] if settings.get("generate_s") else []
        cold += captured
        warm = [emitted / t for t in settings.get("repeat_generate_s") or [] if t > 0]
        tok_s.extend(warm or captured)  # traces from before warm repeats: their own (captured) run
        if settings.get("repeats_match") is not None and not str(settings.get("rng", "")).startswith("engine"):
            # (SGLang's own generator at T > 0 draws afresh on every run: its repeats need not match)
            repeats_match = bool(settings["repeats_match"]) and repeats_match is not False
        for phase, acc in (("verify", step_ms), ("draft", draft_ms)):
            ms = _median_ms(trace, phase)
            if ms is not None:
                acc.append(ms)
        if rep == 0:
            for s in trace.steps:
                taus_by_req.setdefault(s.request_id, []).append(s.accept_length)
    all_taus = [t for ts in taus_by_req.values() for t in ts]
    per_req = [statistics.mean(ts) for ts in taus_by_req.values() if ts]
    return {
        "algorithm": algorithm, "budget": budget, "steps": len(all_taus),
        "mean_tau": statistics.mean(all_taus) if all_taus else None,
        "tau_spread_over_requests": span(per_req),
        "step_ms": span(step_ms), "draft_ms": span(draft_ms), "tokens_per_s": span(tok_s),
        "cold_tokens_per_s": span(cold), "repeats_match": repeats_match,
        "verdict": report.verdict, "counts": report.counts,
        "fail_categories": sorted({f.category for f in report.failures}),
        "first_divergence": _first(report), "first_state_failure": _first_state(report),
        "replayed_steps": report.stats.get("steps", {}),
        # τ beside the reference's under the same rule at the same prefixes, with the cause of each difference
        "acceptance_account": report.stats.get("acceptance_account"),
    }


def run_sglang_sweep(spec: EngineSpec, prompts: list[Prompt], budgets: list[int], repeats: int = 1,
                     algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS, ref_dtype: str = "float32",
                     ref_device: str = "cuda", runner_factory: Callable | None = None,
                     progress: Progress | None = None,
                     save_dir: Path | None = None, runner_options: dict | None = None) -> dict:
    """One captured run per (algorithm, budget), diffed in replay (module docstring); ``runner_options`` go to
    each runner as they are (``mem_fraction``, ``cuda_graphs``)."""
    if runner_factory is None:
        from refcheck.sglang.runner import SGLangRunner

        runner_factory = SGLangRunner
    pool = ReferencePool()
    rows = []
    for alg in algorithms:
        for budget in budgets:
            tell(progress, f"{alg} budget {budget}: captured run + {repeats} warm repeat(s)")
            trace = runner_factory(dataclasses.replace(spec, budget=budget), alg, timing_repeats=repeats,
                                   **(runner_options or {})).trace(prompts)
            if save_dir is not None:  # every capture kept: a failing row can be reviewed later, on CPU
                save_dir.mkdir(parents=True, exist_ok=True)
                write_trace(trace, save_dir / f"{alg}-b{budget}.arrow")
            report = judge(trace, pool, f"{alg}-b{budget}", mode="replay", ref_dtype=ref_dtype, ref_device=ref_device)
            rows.append(sweep_row(alg, budget, [trace], report))
    return {"model": spec.model_label, "dtype": spec.dtype, "repeats": repeats, "prompts": len(prompts),
            "max_new_tokens": spec.max_new_tokens, "rows": rows,
            **({"temperature": spec.sampling.temperature, "top_k": spec.sampling.top_k, "top_p": spec.sampling.top_p,
                "seed": spec.sampling.seed} if spec.sampled and spec.sampling is not None else {})}


def tabulate_traces(traces: list, ref_device: str = "cpu", ref_dtype: str = "float32") -> dict:
    """The sweep table from saved SGLang traces (``diff --save-trace`` / the suite's ``.arrow`` files):
    grouped by (algorithm, budget) from each trace's provenance (NGRAM: and its BFS breadth), repeats in the order given; the
    first trace of each group is replayed for the verdict."""
    from refcheck.errors import UsageError

    groups: dict[tuple[str, int], list] = {}
    for trace in traces:
        prov = trace.prov
        if prov.engine != "sglang":
            raise UsageError(f"not an SGLang trace (engine {prov.engine!r}); sweep --from-traces tabulates SGLang captures")
        settings = prov.settings
        alg = str(settings.get("algorithm", "?"))
        if settings.get("speculative_ngram_max_bfs_breadth") is not None:  # NGRAM's layout is its breadth
            alg += f" breadth {settings['speculative_ngram_max_bfs_breadth']}"
        groups.setdefault((alg, prov.budget or 0), []).append(trace)
    pool = ReferencePool()
    rows = []
    for (alg, budget), group in sorted(groups.items()):
        report = judge(group[0], pool, f"{alg}-b{budget}", mode="replay", ref_dtype=ref_dtype, ref_device=ref_device)
        rows.append(sweep_row(alg, budget, group, report))
    first = traces[0].provenance if traces else {}
    return {"model": str(first.get("model", "?")),
            "dtype": first.get("dtype", "?"), "repeats": max((len(g) for g in groups.values()), default=0),
            "prompts": len(traces[0].requests) if traces else 0, "max_new_tokens": first.get("max_new_tokens"),
            "rows": rows}
