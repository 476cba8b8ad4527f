#!/usr/bin/env python
"""Run refcheck beside SGLang on a GPU for a set of configurations, and collect traces and verdicts.

    scripts/sglang_bundle.sh run python3 scripts/sglang_suite.py --out /tmp/suite [--configs dflash,none,...]

Each configuration is one ``python -m refcheck diff --engine sglang ...`` process (SGLang in-process,
then the reference's replay + free-run diff on the same GPU in fp32), followed by a bf16 replay of the
saved trace (``diff --against``). ``capture-off`` re-runs DFLASH without the capture plugin's hooks and
checks that the tokens are identical (capture must not change what SGLang computes). Everything lands
in OUT: ``<config>.arrow`` (the SGLang trace), ``<config>.fp32.json`` / ``<config>.bf16.json`` (reports),
``<config>.log`` and ``summary.json`` (exit codes, wall times, verdict counts, τ, largest deviations).
A configuration that crashes or times out is recorded as such; the others still run.
``--parallel N`` runs N configurations side by side on the one GPU, their engine starts spaced by
``--stagger`` seconds (SGLang sizes its pools from the memory free at its start; two engines
profiling at once both count the same memory, and a third may then find none): fewer
device minutes, timings under contention.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIGS = {
    "none": ["--sglang-algorithm", "NONE"],
    "dflash": ["--sglang-algorithm", "DFLASH", "--budget", "15"],
    "ngram": ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10"],
    "ngram-b1": ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "1"],
    # refcheck's DDTree on SGLang (refcheck/sglang/ddtree): the four budgets, and the leaky chain layout
    **{f"ddtree-b{b}": ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", str(b)] for b in (15, 16, 32, 64)},
    "ddtree-b15-leaky": ["--sglang-algorithm", "REFCHECK_DDTREE_LEAKY_CHAIN", "--budget", "15"],
    # budget 64's open finding (code-1 step 13 node 32): full state tensors and per-layer sketches to place it
    "ddtree-b64-layers": ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "64", "--layer-sketches", "--full-state"],
    # tensor parallelism 2 (two GPUs): every rank captured, shards combined into the reference's layout
    **{f"{name}-tp2": [*args, "--tp", "2"] for name, args in (
        ("none", ["--sglang-algorithm", "NONE"]),
        ("dflash", ["--sglang-algorithm", "DFLASH", "--budget", "15"]),
        ("ngram", ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10"]),
        ("ddtree-b15", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "15"]),
        ("ddtree-fault-mamba-flat-index", ["--sglang-algorithm", "REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX", "--budget", "15"]))},
    # the calibration corpus (refcheck calibrate --traces): budget 8, CUDA graphs on, one request at a time
    "ddtree-b8": ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "8"],
    **{f"{name}-graphs": [*args, "--cuda-graphs"] for name, args in (
        ("none", ["--sglang-algorithm", "NONE"]),
        ("dflash", ["--sglang-algorithm", "DFLASH", "--budget", "15"]),
        ("ngram", ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10"]),
        ("ddtree-b15", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "15"]),
        ("ddtree-b64", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "64"]))},
    **{f"{name}-bs1": [*args, "--sglang-max-running", "1"] for name, args in (
        ("dflash", ["--sglang-algorithm", "DFLASH", "--budget", "15"]),
        ("ngram", ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10"]),
        ("ddtree-b15", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "15"]))},
    # faults injected into SGLang through refcheck's plugin (refcheck/sglang/ddtree/faults.py): must fail
    **{f"ddtree-fault-{f.lower().replace('_', '-')}": ["--sglang-algorithm", f"REFCHECK_DDTREE_FAULT_{f}", "--budget", "15",
                                                         "--layer-sketches"]
       for f in ("MAMBA_FLAT_INDEX", "KV_MOVE_LAST", "FLAT_POSITIONS", "BONUS_NEIGHBOUR")},
    # temperature > 0 (docs/sampling.md): REFCHECK_DDTREE samples with refcheck's keyed sampler (exact replay, the
    # free run token for token); NGRAM and NONE with SGLang's own generator (the distributional test: run with
    # --max-new-tokens 128 so the 6 prompts reach its stated power); a bonus fault must still be caught
    **{f"{name}-t1": [*args, "--temperature", "1.0", "--seed", "1"] for name, args in (
        ("none", ["--sglang-algorithm", "NONE"]),
        ("ngram", ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10"]),
        ("ngram-graphs", ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10", "--cuda-graphs"]),
        ("ddtree-b15", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "15"]),
        ("ddtree-b64", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "64"]),
        ("ddtree-b15-graphs", ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "15", "--cuda-graphs"]),
        ("ddtree-fault-bonus-neighbour", ["--sglang-algorithm", "REFCHECK_DDTREE_FAULT_BONUS_NEIGHBOUR", "--budget", "15"]),
        ("ddtree-fault-kv-move-last", ["--sglang-algorithm", "REFCHECK_DDTREE_FAULT_KV_MOVE_LAST", "--budget", "15"]))},
    "ddtree-b15-t07": ["--sglang-algorithm", "REFCHECK_DDTREE", "--budget", "15", "--temperature", "0.7", "--top-k", "20",
                       "--top-p", "0.9", "--seed", "2"],
    "ngram-t07": ["--sglang-algorithm", "NGRAM", "--budget", "11", "--ngram-breadth", "10", "--temperature", "0.7",
                  "--top-k", "20", "--top-p", "0.9", "--seed", "2"],
    # SGLang in float32 (the sharp check that tells bf16 numerics from engine bugs) is refused for the
    # built-in Qwen3.5 pair on 0.5.17: its gemma_rmsnorm has no float32 kernel (refcheck/sglang/capture/versions.py)
    "dflash-fp32": ["--sglang-algorithm", "DFLASH", "--budget", "15", "--dtype", "float32"],
}


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float, str]:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        # TimeoutExpired carries bytes even under text=True (the output read so far is not decoded)
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        rc, err = 124, err + f"\ntimed out after {timeout:.0f} s"
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n--- stderr ---\n{err}\n--- rc {rc} ---\n")
    return rc, time.time() - t0, out


def _report_summary(text: str) -> dict:
    try:
        data = json.loads(text)
    except ValueError:
        return {"error": "no JSON report"}
    out = {}
    for r in data.get("reports", []):
        out = {"verdict": r["verdict"], "counts": r["counts"], "fail_categories": r["fail_categories"],
               "steps": r["stats"].get("steps"), "tau_engine": r["stats"].get("mean_tau_engine"),
               "tau_reference": r["stats"].get("mean_tau_reference"),
               **{k: v for k, v in r["stats"].items() if k.startswith("max_")},
               "first_divergence": {k: f"step {v['step']} node {v['node']} layer {v['layer']} {v['category']}: "
                                       f"{v['message'][:160]}" for k, v in list(r["first_divergence"].items())[:6]}}
    return out


def child(args: argparse.Namespace) -> None:
    """One SGLang run without capture: output tokens only (for the capture-does-not-change-tokens check)."""
    from refcheck.prompts import load_prompts
    from refcheck.reference_runner import EngineSpec
    from refcheck.sglang.runner import SGLangRunner

    spec = EngineSpec(pair=args.pair, dtype="bfloat16", device="cuda", budget=args.budget,
                      max_new_tokens=args.max_new_tokens)
    trace = SGLangRunner(spec, args.algorithm, capture=False).trace(load_prompts())
    Path(args.json_out).write_text(json.dumps({r.request_id: r.output_ids for r in trace.requests}))


def main() -> None:
    args = parser().parse_args()
    if args.child:
        child(args)
        return
    run_suite(args)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", default="none,dflash,capture-off,ngram,ngram-b1")
    ap.add_argument("--pair", default="hybrid")
    ap.add_argument("--model", default=None, help="A target directory instead of the built-in --pair (with --draft).")
    ap.add_argument("--draft", default=None, help="The --model target's DFlash draft directory.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0, help="Per process, seconds.")
    ap.add_argument("--parallel", type=int, default=1,
                    help="Configurations run side by side on the one GPU (engine starts spaced by --stagger); saves "
                         "device minutes, but their timings are taken under contention.")
    ap.add_argument("--stagger", type=float, default=45.0,
                    help="With --parallel: seconds between engine starts (each must size its memory pools alone).")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="SGLang's mem_fraction_static for every configuration (lower it to run more side by side).")
    ap.add_argument("--no-bf16-replay", action="store_true",
                    help="Skip the bf16 replay of each saved trace (the fp32 diff is the verdict).")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--algorithm", default="DFLASH", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=15, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    return ap


def run_suite(args: argparse.Namespace) -> None:
    """Every configuration of ``--configs``, one after another or ``--parallel`` side by side; ``capture-off``
    last when parallel (it compares against dflash.arrow). The summary is rewritten as each one finishes."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS and n != "capture-off"]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {', '.join(unknown)} (choose from {', '.join(CONFIGS)}, capture-off)")
    summary: dict = {}
    lock = threading.Lock()
    # Engines side by side: SGLang sizes its KV pool from the memory free when it starts (a share of it,
    # mem_fraction_static), so two engines profiling at once both count the same free memory and the
    # second finds none left. Starts are therefore spaced by --stagger seconds.
    starts = {"next": 0.0}

    def wait_for_start_slot() -> None:
        with lock:
            now = time.time()
            at = max(now, starts["next"])
            starts["next"] = at + args.stagger
        time.sleep(max(0.0, at - now))

    def done(name: str, entry: dict) -> None:
        with lock:
            summary[name] = entry
            print(name, json.dumps(entry), flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))

    def one(name: str) -> None:
        if name == "capture-off":
            done(name, capture_off(args, out))
        else:
            done(name, run_config(name, args, out, wait_for_start_slot if args.parallel > 1 else None))

    if args.parallel > 1:
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(one, [n for n in names if n != "capture-off"]))
        if "capture-off" in names:  # it compares against dflash.arrow: after the others
            one("capture-off")
    else:
        for name in names:
            one(name)


def capture_off(args: argparse.Namespace, out: Path) -> dict:
    log = out / "capture-off.log"
    rc, wall, _ = _run([sys.executable, __file__, "--child", "--out", str(out), "--algorithm", "DFLASH", "--budget", "15",
                        "--pair", args.pair, "--max-new-tokens", str(args.max_new_tokens),
                        "--json-out", str(out / "capture-off.json")], log, args.timeout)
    entry = {"rc": rc, "wall_s": round(wall, 1)}
    if rc == 0 and (out / "dflash.arrow").is_file():
        from refcheck.trace.io import read_trace

        with_cap = {r.request_id: r.output_ids for r in read_trace(out / "dflash.arrow").requests}
        without = json.loads((out / "capture-off.json").read_text())
        entry["tokens_identical"] = with_cap == without
        entry["differing_requests"] = sorted(k for k in without if with_cap.get(k) != without[k])
    return entry


def run_config(name: str, args: argparse.Namespace, out: Path, before_engine=None) -> dict:
    """One configuration: the fp32 diff with the live engine (trace saved), then a bf16 replay of it."""
    py = sys.executable
    model = ["--model", args.model, "--draft", args.draft] if getattr(args, "model", None) else ["--pair", args.pair]
    common = [*model, "--max-new-tokens", str(args.max_new_tokens), "--json"]
    log = out / f"{name}.log"
    trace = out / f"{name}.arrow"
    if before_engine is not None:
        before_engine()
    if getattr(args, "mem_fraction", None) is not None:
        common += ["--sglang-mem-fraction", str(args.mem_fraction)]
    rc, wall, text = _run([py, "-m", "refcheck", "diff", "--engine", "sglang", *CONFIGS[name], *common,
                           "--ref-device", "cuda", "--ref-dtype", "float32", "--mode", "both", "--save-trace", str(trace)],
                          log, args.timeout)
    (out / f"{name}.fp32.json").write_text(text)
    entry = {"rc": rc, "wall_s": round(wall, 1), "fp32": _report_summary(text), "engines_side_by_side": args.parallel}
    if trace.is_file():
        from refcheck.trace.io import read_trace

        prov = read_trace(trace).provenance
        cap = prov.get("capture", {})
        entry["capture"] = {k: cap.get(k) for k in ("stats", "errors", "problems", "incomplete", "crash")}
        entry["engine_start_s"] = prov["engine"]["settings"].get("engine_start_s")
    if trace.is_file() and not getattr(args, "no_bf16_replay", False):
        rc2, wall2, text2 = _run([py, "-m", "refcheck", "diff", "--against", str(trace), "--ref-device", "cuda",
                                  "--ref-dtype", "bfloat16", "--mode", "replay", "--json"], log, args.timeout)
        (out / f"{name}.bf16.json").write_text(text2)
        entry["bf16"] = {"rc": rc2, "wall_s": round(wall2, 1), **_report_summary(text2)}
    return entry

if __name__ == "__main__":
    main()
