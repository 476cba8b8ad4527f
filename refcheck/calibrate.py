"""The calibration corpus: clean and faulty engines in their own dtype, diffed by the calibrated verdict.

Contract: :func:`default_corpus` lists the runs (clean reference engines in each dtype at each budget
and pair, and sampled at :data:`CLEAN_SAMPLINGS` at budget 15; every injected fault, in the first dtype, on
the hybrid pair with the scripted drafter's deep paths, and each sampling fault sampled, with the DFlash
drafter, at :data:`~refcheck.selftest.sampling_faults.CORPUS_SAMPLING`'s parameters or the selftest's);
:func:`run_one` records one run's trace on the engine's device, diffs it against the fp32
reference with the verdict under test (the measured calibration, or a candidate's) and returns its
row; a fault row also carries *where the fault first changes anything*: the first request, step and
node at which its trace differs from the clean engine's trace in the same dtype. :func:`row_of_trace`
makes a row of an engine trace recorded elsewhere (SGLang captures). :func:`summarize` turns rows
into the table's claims: false alarms over clean runs, detection and location over faulty runs,
faulty nodes moved to "triaged" (must be 0), the deviation / spread ratios the verdict judged on
clean runs, and the largest clean deviation per quantity. :func:`markdown` renders it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ddtree_reference.sampling import Sampling
from refcheck.budget import budget_json, budget_tag
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.prompts import Prompt, load_prompts
from refcheck.selftest.faults import LONG_CONTEXT_FAULTS
from refcheck.selftest.sampling_faults import CORPUS_SAMPLING, SAMPLING_FAULTS, SELFTEST_SAMPLING
from refcheck.trace.io import StepRow, Trace

CLEAN_BUDGETS = (8, 15, 32, 64, None)
#: the sampled clean runs (tag, sampling), each at :data:`SAMPLED_BUDGET` with the DFlash drafter: the DDTree
#: paper's T = 1.0 and the selftest's T = 0.7 / top-p 0.9
CLEAN_SAMPLINGS: tuple[tuple[str, Sampling], ...] = (("t1", Sampling(1.0, seed=SELFTEST_SAMPLING.seed)),
                                                     ("t07-p09", SELFTEST_SAMPLING))
SAMPLED_BUDGET = 15
#: the long-context prompts: the ``mixed`` workload's requests of 600 + 64 and 438 + 48 tokens, on which every
#: dtype's clean run (DFlash, budget :data:`SAMPLED_BUDGET`) and each long-context fault run; drifts that grow
#: with the position (the drafter's rotary frequencies in bf16) show there and not on the built-in prompts
LONG_PROMPTS = ("mixed-02", "mixed-04")


@dataclass(frozen=True, slots=True)
class CorpusRun:
    name: str
    kind: str  # "clean" | "fault" | "graded" (a fault of a given size: the detectability curve)
    engine: str  # "reference" | "fault:NAME"
    pair: str
    drafter: str
    budget: int | None
    dtype: str
    device: str
    model_dir: str | None = None  # a pair given by its directories (``pair`` is then its label)
    draft_dir: str | None = None
    sampling: Sampling | None = None  # a sampled run (keyed uniforms, every draw recorded); None: greedy
    long: bool = False  # on :data:`LONG_PROMPTS` (their own token limits) instead of the built-in prompts

    def spec(self, max_new_tokens: int):
        from pathlib import Path

        from refcheck.reference_runner import EngineSpec

        return EngineSpec(pair=self.pair, drafter=self.drafter, budget=self.budget, dtype=self.dtype, device=self.device,
                          max_new_tokens=max_new_tokens, model_dir=Path(self.model_dir) if self.model_dir else None,
                          draft_dir=Path(self.draft_dir) if self.draft_dir else None, sampling=self.sampling)


def default_corpus(dtypes: list[str], device: str, faults: list[str], pairs: tuple[str, ...] = ("hybrid", "attention"),
                   budgets: tuple[int | None, ...] = CLEAN_BUDGETS,
                   own: tuple[str, str, str] | None = None) -> list[CorpusRun]:
    """Clean: every dtype x pair x budget with the DFlash drafter, the scripted drafter's deep paths on
    the hybrid pair at budgets 15 and 64, and every dtype x pair sampled at each of :data:`CLEAN_SAMPLINGS`
    (DFlash, budget :data:`SAMPLED_BUDGET`), and every dtype on :data:`LONG_PROMPTS` (hybrid, DFlash, budget
    :data:`SAMPLED_BUDGET`). Faulty: every fault in the first dtype (hybrid, scripted, budget 15; a sampling fault
    sampled, with DFlash; a long-context fault on :data:`LONG_PROMPTS`). ``own`` = (label, target dir, draft dir): the same corpus on
    that one pair instead (a hybrid target)."""
    dirs = dict(model_dir=own[1], draft_dir=own[2]) if own else {}
    pairs, hybrid = ((own[0],), own[0]) if own else (pairs, "hybrid")
    runs = [CorpusRun(f"clean-{d}-{p}-dflash-{budget_tag(b)}", "clean", "reference", p, "dflash", b, d, device, **dirs)
            for d in dtypes for p in pairs for b in budgets]
    runs += [CorpusRun(f"clean-{d}-{hybrid}-scripted-{budget_tag(b)}", "clean", "reference", hybrid, "scripted", b, d,
                       device, **dirs) for d in dtypes for b in (15, 64)]
    runs += [CorpusRun(f"clean-{d}-{p}-dflash-{budget_tag(SAMPLED_BUDGET)}-{tag}", "clean", "reference", p, "dflash",
                       SAMPLED_BUDGET, d, device, **dirs, sampling=sp)
             for d in dtypes for p in pairs for tag, sp in CLEAN_SAMPLINGS]
    runs += [CorpusRun(f"clean-{d}-{hybrid}-dflash-{budget_tag(SAMPLED_BUDGET)}-long", "clean", "reference", hybrid,
                       "dflash", SAMPLED_BUDGET, d, device, **dirs, long=True) for d in dtypes]
    runs += [CorpusRun(f"fault-{f}-{dtypes[0]}" + (f"-{hybrid}" if own else ""), "graded" if ":" in f else "fault",
                       f"fault:{f}", hybrid, _fault_drafter(f), 15, dtypes[0], device, **dirs,
                       sampling=CORPUS_SAMPLING.get(f, SELFTEST_SAMPLING) if f in SAMPLING_FAULTS else None,
                       long=f in LONG_CONTEXT_FAULTS)
             for f in faults]
    return runs


def corpus_prompts(run: CorpusRun, n_prompts: int) -> list[Prompt]:
    """The prompts ``run`` decodes: :data:`LONG_PROMPTS` (each with its own token limit) for a long-context run, else
    the first ``n_prompts`` built-in."""
    if not run.long:
        return load_prompts()[:n_prompts]
    from refcheck.prompts.workloads import workload

    by_id = {p.id: p for p in workload("mixed")}
    return [by_id[i] for i in LONG_PROMPTS]


def _fault_drafter(name: str) -> str:
    """Faults of the drafter's input, and sampling faults (the DDTree engines that sample draft with DFlash),
    run with the DFlash drafter (its draft is checked at any numerics); the rest with the scripted drafter's
    deep accepted paths, on which commit faults show."""
    from refcheck.selftest.faults import find_fault

    entry = find_fault(name)
    return "dflash" if name in SAMPLING_FAULTS or (entry is not None and entry[1] == "draft") else "scripted"


# -- where a fault first acts -------------------------------------------------------------------------
def _step_diff(a: StepRow, b: StepRow) -> tuple[int | None, str] | None:
    """(node, what) of the first recorded difference between two steps of one request; None if equal."""
    if a.tree_tokens != b.tree_tokens or a.tree_parents != b.tree_parents or a.tree_depths != b.tree_depths:
        node = next((i for i, (x, y) in enumerate(zip(a.tree_tokens, b.tree_tokens)) if x != y), None)
        return node, "tree"
    if a.draft_topk_logprobs != b.draft_topk_logprobs or a.draft_topk_ids != b.draft_topk_ids:
        return None, "draft"
    for i, (x, y) in enumerate(zip(a.topk_logprobs, b.topk_logprobs)):
        if x != y or a.topk_ids[i] != b.topk_ids[i] or a.target_argmax[i] != b.target_argmax[i]:
            return i, "logits"
    for i, (x, y) in enumerate(zip(_draws(a), _draws(b))):  # at T > 0: a node's draw or its uniform
        if x != y:
            return i, "draws"
    if a.accepted != b.accepted or a.accept_length != b.accept_length or a.bonus != b.bonus:
        return None, "walk"
    if a.emitted != b.emitted or a.emitted_logprobs != b.emitted_logprobs:
        return None, "output"
    sa, sb = {e.name: e for e in a.state}, {e.name: e for e in b.state}
    for name in sorted(set(sa) | set(sb)):
        ea, eb = sa.get(name), sb.get(name)
        if ea is None or eb is None or not torch.equal(ea.sketch, eb.sketch):
            return None, f"state {name}"
    return None


def _draws(s: StepRow) -> list[tuple[int, float | None]]:
    """Each node's recorded draw and uniform (a NaN uniform, not recorded, as None), padded to the tree."""
    n = len(s.tree_tokens)
    draws = list(s.node_draws) + [-1] * (n - len(s.node_draws))
    uniforms = [u if u == u else None for u in s.node_uniforms] + [None] * (n - len(s.node_uniforms))
    return list(zip(draws, uniforms))


def first_change(clean: Trace, faulty: Trace) -> dict | None:
    """The earliest (by step; the draw after the prefill is step -1) request, step and node where ``faulty``
    differs from ``clean``."""
    best: dict | None = None
    firsts = {r.request_id: r.output_ids[:1] for r in faulty.requests}
    for req in clean.requests:
        if req.output_ids[:1] != firsts.get(req.request_id, req.output_ids[:1]):
            return {"request_id": req.request_id, "step": -1, "node": None, "what": "first token"}
    for req in clean.requests:
        a_steps, b_steps = clean.steps_of(req.request_id), faulty.steps_of(req.request_id)
        for a, b in zip(a_steps, b_steps):
            d = _step_diff(a, b)
            if d is not None:
                if best is None or a.step < best["step"]:
                    best = {"request_id": req.request_id, "step": a.step, "node": d[0], "what": d[1]}
                break
        else:
            if len(a_steps) != len(b_steps) and (best is None or min(len(a_steps), len(b_steps)) < best["step"]):
                best = {"request_id": req.request_id, "step": min(len(a_steps), len(b_steps)), "node": None,
                        "what": "step count"}
    return best


# -- rows -------------------------------------------------------------------------------------------
def _where(f: Finding | None) -> dict | None:
    if f is None:
        return None
    return {"request_id": f.request_id, "step": f.step, "node": f.node, "layer": f.layer, "category": f.category}


def _first_failure(report: Report) -> Finding | None:
    fails = [f for f in report.first_divergence().values()]
    return min(fails, key=lambda f: (1 << 30 if f.step is None else f.step, f.request_id or ""), default=None)


def report_row(report: Report, kind: str, change: dict | None = None) -> dict:
    """The corpus row of one diffed run (see the module docstring)."""
    first = _first_failure(report)
    fails = report.failures
    triaged = [f for f in report.findings if f.verdict == Verdict.TRIAGED]
    row = {"kind": kind, "verdict": "fail" if fails else "pass", "fail_findings": len(fails), "triaged": len(triaged),
           "fail_categories": sorted({f.category for f in fails}), "first_finding": _where(first),
           "ensemble_steps": report.stats.get("ensemble_steps", 0),
           "rounding_ratios": report.stats.get("rounding_ratios", []),
           "max": {k: v for k, v in report.stats.items() if k.startswith("max_")},
           "steps": report.stats.get("steps", {}), "temperature": report.stats.get("temperature")}
    if kind != "clean":
        row["first_change"] = change
        mine = report.first_divergence().get(change["request_id"]) if change else None
        row["located"] = bool(change and mine is not None and mine.step == change["step"])
        row["located_node"] = bool(row["located"] and (change["node"] is None or mine.node == change["node"]))
        row["first_finding_in_request"] = _where(mine)
    return row


def calibration_under_test(dtype: str, device: str, bounds: dict[str, float] | None = None,
                           rule: dict[str, float] | None = None):
    """The measured calibration of (dtype, device), or its candidate, with ``bounds`` / ``rule`` fields
    replaced (the variants a corpus run measures; a field name that does not exist is a usage error)."""
    from dataclasses import fields, replace

    from refcheck.diff.tolerance import calibration_for
    from refcheck.errors import UsageError

    cal = calibration_for(dtype, device, candidates=True)
    for name, obj, given in (("bound", cal.tolerance, bounds), ("rule", cal.rule, rule)):
        if not given:
            continue
        known = {f.name for f in fields(obj)} if obj is not None else set()
        bad = sorted(set(given) - known)
        if bad:
            raise UsageError(f"unknown {name} field(s) {bad} (known: {sorted(known)})")
    tol = replace(cal.tolerance, **(bounds or {}))
    new_rule = replace(cal.rule, **{k: (int(v) if k in ("samples", "seed", "anchor_steps") else v) for k, v in (rule or {}).items()}) \
        if cal.rule is not None else None
    return replace(cal, tolerance=tol, rule=new_rule)


def run_one(run: CorpusRun, n_prompts: int, max_new_tokens: int, ref_device: str, bounds: dict | None = None,
            rule: dict | None = None) -> tuple[dict, bytes]:
    """Record and diff one corpus run (a worker entry point); returns (row, trace bytes)."""
    from ddtree_reference.decode import DDTreeDecoder
    from refcheck.diff.judge import judge
    from refcheck.engines import open_engine
    from refcheck.pool import ReferencePool
    from refcheck.trace.io import trace_bytes

    t0 = time.perf_counter()
    prompts = corpus_prompts(run, n_prompts)
    pool = ReferencePool()
    runner = pool.runner(run.spec(max_new_tokens))
    clean, results = runner.trace(prompts, record_layers=True)
    change = None
    if run.kind != "clean":
        if run.drafter == "scripted":  # as selftest: a MASK id the target emits, so dropping it shows (the
            first = results[prompts[0].id].output_ids  # scripted drafter never reads it; DFlash's does)
            runner.drafter.mask_token_id = first[min(3, len(first) - 1)]
            clean, _ = runner.trace(prompts, cls=DDTreeDecoder, record_layers=True)
        trace = open_engine(run.engine, run.spec(max_new_tokens), pool).trace(prompts)
        change = first_change(clean, trace)
    else:
        trace = clean
    t1 = time.perf_counter()
    cal = calibration_under_test(run.dtype, run.device, bounds, rule)
    report = judge(trace, pool, run.name, mode="both", ref_dtype="float32", ref_device=ref_device, calibration=cal)
    row = {**asdict(run), **report_row(report, run.kind, change), "engine_s": round(t1 - t0, 2),
           "diff_s": round(time.perf_counter() - t1, 2), "calibration": cal.to_json()}
    return row, trace_bytes(trace)


def row_of_trace(path: str, name: str, ref_device: str, bounds: dict | None = None, rule: dict | None = None) -> dict:
    """The corpus row of an engine trace recorded elsewhere (an SGLang capture; a worker entry point, so
    it takes the path): faulty when its engine is one of refcheck's deliberately broken layouts (LEAKY /
    FAULT in the algorithm name) or ran with a fault injected into SGLang's drafter or sampler (its provenance's
    ``draft_fault`` / ``sampler_fault``)."""
    from refcheck.diff.judge import judge
    from refcheck.diff.tolerance import engine_numerics
    from refcheck.pool import ReferencePool
    from refcheck.trace.io import read_trace

    trace = read_trace(path)

    prov = trace.prov
    settings = prov.settings
    alg = str(settings.get("algorithm", prov.engine))
    injected = settings.get("draft_fault") or settings.get("sampler_fault")  # faults injected into SGLang's own code
    kind = "fault" if ("LEAKY" in alg or "FAULT" in alg or injected) else "clean"
    if injected:
        alg += f"+{injected}"
    dtype, device = engine_numerics(trace.provenance)
    cal = calibration_under_test(dtype, device, bounds, rule)
    t0 = time.perf_counter()
    report = judge(trace, ReferencePool(), name, mode="both", ref_dtype="float32", ref_device=ref_device,
                   calibration=cal)
    row = {"name": name, "kind": kind, "engine": f"sglang:{alg}", "pair": settings.get("pair", "?"),
           "drafter": prov.drafter, "budget": budget_json(prov.budget), "dtype": dtype,
           "device": device, "cuda_graphs": not settings.get("disable_cuda_graph", True),
           **report_row(report, kind), "engine_s": None, "diff_s": round(time.perf_counter() - t0, 2),
           "calibration": cal.to_json()}
    if kind == "fault":  # no clean twin recorded: detection only
        row["located"] = None
    return row


# -- the table ------------------------------------------------------------------------------------------
def summarize(rows: list[dict]) -> dict:
    clean = [r for r in rows if r["kind"] == "clean"]
    faulty = [r for r in rows if r["kind"] == "fault"]
    ratios = sorted(x for r in clean for x in r["rounding_ratios"])
    maxima: dict[str, float] = {}
    for r in clean:
        for k, v in r["max"].items():
            maxima[k] = max(maxima.get(k, 0.0), v)

    def q(p: float) -> float | None:
        return ratios[min(len(ratios) - 1, int(p * len(ratios)))] if ratios else None

    leans = [r["temperature"] for r in clean if r.get("temperature") and r["temperature"].get("keyed_draws")]

    return {
        "clean_runs": len(clean), "false_alarms": sum(r["verdict"] == "fail" for r in clean),
        "faulty_runs": len(faulty), "detected": sum(r["verdict"] == "fail" for r in faulty),
        "located": sum(bool(r.get("located")) for r in faulty),
        "faulty_nodes_triaged": sum(r["triaged"] for r in faulty),
        "clean_triaged": sum(r["triaged"] for r in clean),
        "clean_ensemble_steps": sum(r["ensemble_steps"] for r in clean),
        "clean_judged": len(ratios),
        "clean_ratio_quantiles": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": ratios[-1] if ratios else None},
        "clean_maxima": maxima,
        # the temperature check over the sampled clean runs: their steps' votes and the smallest p-value
        "clean_temperature": {"runs": len(leans), "higher": sum(t["higher"] for t in leans),
                              "lower": sum(t["lower"] for t in leans),
                              "min_p": min((t["p_value"] for t in leans), default=None)},
    }


def detectability(rows: list[dict]) -> dict[str, list[tuple[float, bool]]]:
    """Graded faults: "family (dtype[, pair])" -> [(size, detected)] in increasing size (one curve per
    quantity, dtype and pair: a size run twice in one of them counts as detected only if both runs were)."""
    curves: dict[str, dict[float, bool]] = {}
    for r in rows:
        if r["kind"] == "graded":
            family, size = r["engine"].split(":", 1)[1].rsplit(":", 1)
            pair = r.get("pair", "hybrid")
            key = f"{family} ({r['dtype']}{'' if pair == 'hybrid' else ', ' + pair})"
            pts = curves.setdefault(key, {})
            pts[float(size)] = pts.get(float(size), True) and r["verdict"] == "fail"
    return {k: sorted(v.items()) for k, v in sorted(curves.items())}


def _temperature_line(summary: dict) -> list[str]:
    """The temperature check's line of the table's header (sampled clean runs only)."""
    t = summary.get("clean_temperature") or {}
    if not t.get("runs"):
        return []
    return ["", f"Temperature check on the {t['runs']} sampled clean runs: steps leaning higher {t['higher']}, lower "
                f"{t['lower']}; smallest p {t['min_p']:.3g}."]


def _cell(w: dict | None) -> str:
    if not w:
        return "-"
    s = f"{w['request_id']} s{w['step']}"
    s += f" n{w['node']}" if w.get("node") is not None else ""
    s += f" L{w['layer']}" if w.get("layer") is not None else ""
    return s + (f" {w['category']}" if w.get("category") else f" ({w.get('what')})")


def markdown(rows: list[dict], summary: dict) -> str:
    s = summary
    out = [f"**Clean runs: {s['false_alarms']} false alarms of {s['clean_runs']}** ({s['clean_triaged']} nodes triaged, "
           f"ensemble run on {s['clean_ensemble_steps']} steps, {s['clean_judged']} deviations judged; deviation/spread "
           f"p50 {s['clean_ratio_quantiles']['p50']}, p99 {s['clean_ratio_quantiles']['p99']}, max "
           f"{s['clean_ratio_quantiles']['max']}). **Faulty runs: {s['detected']} of {s['faulty_runs']} detected, "
           f"{s['located']} at the step where the fault first acts, {s['faulty_nodes_triaged']} faulty nodes triaged.**",
           *_temperature_line(s),
           "", "| run | kind | dtype | verdict | fail / triaged | ensemble steps | first finding | fault first acts | located |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        loc = {True: "yes", False: "**no**", None: "-"}[r.get("located")] if r["kind"] == "fault" else ""
        if r["kind"] == "fault" and r.get("located") and not r.get("located_node"):
            loc += " (other node)"
        bad = (r["kind"] == "clean") == (r["verdict"] == "fail")
        verdict = f"**{r['verdict']}**" if bad else r["verdict"]
        out.append(f"| {r['name']} | {r['kind']} | {r['dtype']} | {verdict} | {r['fail_findings']} / {r['triaged']} | "
                   f"{r['ensemble_steps']} | {_cell(r['first_finding'])} | {_cell(r.get('first_change'))} | {loc} |")
    curves = detectability(rows)
    if curves:
        sizes = sorted({size for pts in curves.values() for size, _ in pts})
        out += ["", "Detectability (graded faults; x = detected, . = not, blank = not run):", "",
                "| fault (dtype) | " + " | ".join(f"{size:g}" for size in sizes) + " |", "|---" * (1 + len(sizes)) + "|"]
        for fam, pts in curves.items():
            got = dict(pts)
            out.append(f"| {fam} | " + " | ".join({True: "x", False: ".", None: " "}[got.get(size)] for size in sizes) + " |")
    return "\n".join(out) + "\n"
