#!/usr/bin/env python3
"""End-to-end false alarms and fault detection of the sampled checks on the built-in models (CPU).

Contract: two measurements, written as JSON (docs/sampling.md quotes them):

* ``clean``: ``--seeds`` clean sampled runs of the reference (built-in hybrid pair, DFlash drafter,
  budget 15, T = 1.0, ``--prompts`` prompts x ``--tokens`` tokens, one seed each), each diffed in
  replay mode: exact-replay false alarms (any failing finding) and the distributional test's
  p-value (the same evidence whether or not the draws are exposed), and the fraction of runs
  under several levels;
* ``faults``: each sampling fault of ``SAMPLING_FAULTS`` at the selftest's T = 0.7, top-p 0.9, on
  ``--fault-requests`` requests (the built-in prompts repeated under distinct request ids) x
  ``--tokens`` tokens, recorded once: whether the exact replay catches it (first category, step) and,
  with its randomness hidden, the distributional verdict on the first k requests for growing k (the
  smallest sample that fails at alpha = 1e-3).

    python scripts/sampling_calibration.py --out docs/results/sampling-calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_reference.decode import DDTreeDecoder  # noqa: E402
from ddtree_reference.sampling import Sampling  # noqa: E402
from refcheck.diff.distribution import COMPONENTS, Evidence, judge  # noqa: E402
from refcheck.diff.replay import replay  # noqa: E402
from refcheck.diff.tolerance import calibration_for  # noqa: E402
from refcheck.pool import ReferencePool  # noqa: E402
from refcheck.prompts import Prompt, load_prompts  # noqa: E402
from refcheck.reference_runner import EngineSpec  # noqa: E402
from refcheck.selftest.sampling_faults import SAMPLING_FAULTS, SELFTEST_SAMPLING, hide_randomness  # noqa: E402


def clean_runs(seeds: int, n_prompts: int, tokens: int) -> dict:
    pool = ReferencePool()
    prompts = load_prompts()[:n_prompts]
    cal = calibration_for("float32", "cpu")
    rows = []
    for seed in range(seeds):
        spec = EngineSpec(pair="hybrid", budget=15, max_new_tokens=tokens, sampling=Sampling(1.0, 0, 1.0, 1000 + seed))
        runner = pool.runner(spec)
        trace, _ = runner.trace(prompts)
        rep = replay(trace, runner.target, runner.drafter, cal, f"seed{seed}")
        d = rep.stats["distribution"]
        rows.append({"seed": 1000 + seed, "exact_failures": len(rep.failures),
                     "fail_categories": sorted({f.category for f in rep.failures}), "p_value": d["p_value"],
                     "p_values": d["p_values"], "n_tokens": d["n_tokens"], "n_walk_nodes": d["n_walk_nodes"],
                     "mean_tau": sum(s.accept_length for s in trace.steps) / max(len(trace.steps), 1)})
        print(f"clean seed {1000 + seed}: {rows[-1]['exact_failures']} failures, p = {d['p_value']:.3g}, "
              f"{d['n_tokens']} tokens", flush=True)
    ps = [r["p_value"] for r in rows]
    comps = {k: [r["p_values"][k] for r in rows if k in r["p_values"]] for k in COMPONENTS}
    return {"runs": rows, "seeds": seeds, "prompts": n_prompts, "tokens": tokens,
            "runs_with_exact_failures": sum(r["exact_failures"] > 0 for r in rows),
            "distribution_false_alarms_at_1e-3": sum(p < 1e-3 for p in ps),
            "fraction_p_below": {str(a): sum(p < a for p in ps) / len(ps) for a in (0.01, 0.05, 0.1, 0.5)},
            "component_fraction_below_0.1": {k: sum(p < 0.1 for p in v) / len(v) for k, v in comps.items() if v}}


def fault_runs(n_requests: int, tokens: int, names: list[str]) -> dict:
    pool = ReferencePool()
    base = load_prompts()
    prompts = [Prompt(f"{base[i % len(base)].id}-{i}", base[i % len(base)].prompt_ids, base[i % len(base)].kind)
               for i in range(n_requests)]
    spec = EngineSpec(pair="hybrid", budget=15, max_new_tokens=tokens, sampling=SELFTEST_SAMPLING)
    runner = pool.runner(spec)
    cal = calibration_for("float32", "cpu")
    out = {}
    for name in ["clean", *names]:
        t0 = time.time()
        cls = DDTreeDecoder if name == "clean" else SAMPLING_FAULTS[name][0]
        trace, _ = runner.trace(prompts, cls=cls)
        exposed = replay(trace, runner.target, runner.drafter, cal, name)
        firsts = sorted((f.step if f.step is not None else 1 << 30, f.category) for f in exposed.failures
                        if f.request_id == prompts[0].id)
        ev = Evidence()
        hidden = replay(hide_randomness(trace), runner.target, runner.drafter, cal, name, evidence=ev)
        growth = []
        for k in range(1, n_requests + 1):
            v = judge(ev.first_requests(k))
            growth.append({"requests": k, "tokens": v.n_tokens, "walk_nodes": v.n_walk_nodes, "verdict": v.verdict,
                           "p_value": v.p_value})
        detected_at = next((g for g in growth if g["verdict"] == "fail"), None)
        out[name] = {"exact_categories": sorted({f.category for f in exposed.failures}),
                     "hidden_exact_categories": sorted({f.category for f in hidden.failures if f.category != "distribution"}),
                     "first_in_request_0": firsts[0] if firsts else None,
                     "hidden_full": growth[-1], "hidden_first_fail": detected_at,
                     "hidden_p_by_requests": [(g["tokens"], g["p_value"]) for g in growth],
                     "seconds": round(time.time() - t0, 1)}
        print(f"{name}: exact {out[name]['exact_categories']} first {out[name]['first_in_request_0']}; hidden "
              f"{growth[-1]['verdict']} p = {growth[-1]['p_value']:.3g} on {growth[-1]['tokens']} tokens; first fail "
              f"at {detected_at['tokens'] if detected_at else '-'} tokens", flush=True)
    return {"requests": n_requests, "tokens": tokens, "sampling": SELFTEST_SAMPLING.to_json(), "faults": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fault-requests", type=int, default=12)
    ap.add_argument("--faults", default=",".join(SAMPLING_FAULTS))
    ap.add_argument("--skip-clean", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    result = {"command": " ".join(sys.argv)}
    if not args.skip_clean:
        result["clean"] = clean_runs(args.seeds, args.prompts, args.tokens)
    result["faults"] = fault_runs(args.fault_requests, args.tokens, [f for f in args.faults.split(",") if f])
    result["seconds"] = round(time.time() - t0, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
