#!/usr/bin/env python3
"""The temperature check on the built-in models in the engine's dtype: false alarms and tokens to detection.

Contract: every run decodes the built-in prompts (``--prompts`` of them, repeated under distinct request
ids when more are asked for than there are) for ``--tokens`` tokens each with the reference run as an
engine in its dtype (``refcheck diff --engine reference --dtype D``: keyed uniforms, every node's draw
recorded) and diffs it in replay mode with the default calibration of that dtype. Rows, written as JSON
(docs/sampling.md quotes them):

* ``clean``: correct engines over a grid of pairs, drafters, budgets, sampling parameters, dtypes and seeds:
  whether the run fails anywhere (a false alarm), the temperature check's votes and p-value;
* ``faults``: ``temperature-1.1x`` and ``temperature-0.9x`` (refcheck/selftest/sampling_faults.py): the
  verdict on the whole run and the emitted tokens after which the check first fails, requests in order and
  steps in order (the verdict on every prefix of the run).

``--check-only`` replays with the fp32 calibration instead (no rounding ensemble): the temperature check's
votes and verdict are the same (they read the reference's log-probs, the draws and the uniforms, nothing the
ensemble decides), the other checks' verdicts are not those of the engine's dtype, and long runs are cheap.

    python scripts/temperature_check.py --out docs/results/temperature-check.json --workers 2
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
from refcheck.diff.replay import replay  # noqa: E402
from refcheck.diff.temperature import Leans  # noqa: E402
from refcheck.diff.tolerance import calibration_for  # noqa: E402
from refcheck.parallel import run_parallel  # noqa: E402
from refcheck.pool import ReferencePool  # noqa: E402
from refcheck.prompts import Prompt, load_prompts  # noqa: E402
from refcheck.reference_runner import EngineSpec  # noqa: E402
from refcheck.selftest.sampling_faults import SAMPLING_FAULTS  # noqa: E402

SAMPLINGS = {"t1": (1.0, 0, 1.0), "t07-p09": (0.7, 0, 0.9), "t15-k20": (1.5, 20, 1.0), "t05": (0.5, 0, 1.0)}


def prompts_for(n: int) -> list[Prompt]:
    base = load_prompts()
    if n <= len(base):
        return base[:n]
    return [Prompt(f"{base[i % len(base)].id}-{i}", base[i % len(base)].prompt_ids, base[i % len(base)].kind)
            for i in range(n)]


def run(row: dict) -> dict:
    torch.set_num_threads(1)
    t0 = time.time()
    T, k, p = SAMPLINGS[row["sampling"]]
    spec = EngineSpec(pair=row["pair"], drafter=row["drafter"], budget=row["budget"], max_new_tokens=row["tokens"],
                      sampling=Sampling(T, k, p, row["seed"]), dtype=row["dtype"])
    pool = ReferencePool()
    runner = pool.runner(spec)
    prompts = prompts_for(row["prompts"])
    cls = DDTreeDecoder if row["engine"] == "clean" else SAMPLING_FAULTS[row["engine"]][0]
    trace, _ = runner.trace(prompts, cls=cls, engine=row["engine"])
    ref = pool.runner(EngineSpec(pair=row["pair"], drafter=row["drafter"], budget=row["budget"],
                                 max_new_tokens=row["tokens"], sampling=spec.sampling))
    leans = Leans()
    cal = calibration_for("float32" if row.get("check_only") else row["dtype"], "cpu")
    rep = replay(trace, ref.target, ref.drafter, cal, row["engine"],
                 check_draft=row["drafter"] != "scripted", engine_dtype=row["dtype"], leans=leans)
    t = rep.stats.get("temperature", {})
    out = {**row, "emitted": sum(len(r.output_ids) for r in trace.requests), "steps": len(trace.steps),
           "verdict": "fail" if rep.failures else "pass",
           "fail_categories": sorted({f.category for f in rep.failures}),
           "outright_categories": sorted({f.category for f in rep.failures if "not_triaged" not in f.details}),
           "temperature": {key: t.get(key) for key in ("verdict", "p_value", "higher", "lower", "even", "draws_higher",
                                                       "draws_lower", "draws_neither", "keyed_draws", "withdrawn")},
           "tokens_until_fail": t.get("fails_after_tokens"), "seconds": round(time.time() - t0, 1)}
    print(json.dumps({k: out[k] for k in ("engine", "pair", "drafter", "budget", "sampling", "dtype", "seed", "verdict",
                                          "outright_categories", "tokens_until_fail")} | {"t": out["temperature"]}),
          flush=True)
    return out


def grid(args: argparse.Namespace) -> list[dict]:
    base = {"prompts": args.prompts, "tokens": args.tokens, "check_only": args.check_only}
    rows = []
    for seed in range(args.seeds):
        for pair, drafter, budget, sampling, dtype in (
                ("hybrid", "dflash", 15, "t1", "bfloat16"), ("attention", "dflash", 15, "t1", "bfloat16"),
                ("hybrid", "scripted", 15, "t1", "bfloat16"), ("hybrid", "dflash", 64, "t1", "bfloat16"),
                ("hybrid", "dflash", None, "t1", "bfloat16"), ("hybrid", "dflash", 15, "t07-p09", "bfloat16"),
                ("attention", "dflash", 15, "t15-k20", "bfloat16"), ("hybrid", "dflash", 8, "t05", "bfloat16"),
                ("hybrid", "dflash", 15, "t1", "float16")):
            rows.append({**base, "engine": "clean", "pair": pair, "drafter": drafter, "budget": budget,
                         "sampling": sampling, "dtype": dtype, "seed": seed})
    for seed in range(args.fault_seeds):
        for name in ("temperature-1.1x", "temperature-0.9x"):
            for pair, drafter, sampling in (("hybrid", "dflash", "t1"), ("attention", "dflash", "t1"),
                                            ("hybrid", "scripted", "t1"), ("hybrid", "dflash", "t07-p09")):
                rows.append({**base, "engine": name, "pair": pair, "drafter": drafter, "budget": 15,
                             "sampling": sampling, "dtype": "bfloat16", "seed": seed})
    return rows


def summarize(results: list[dict], check_only: bool) -> dict:
    """False alarms over the clean rows (of any check; with ``--check-only`` of the temperature check alone:
    the other checks are judged by the fp32 bounds), the clean steps' votes, and per fault the tokens after
    which the check fails (null: not within the run), smallest first."""
    clean = [r for r in results if r["engine"] == "clean"]
    faults = [r for r in results if r["engine"] != "clean"]
    return {
        "clean_runs": len(clean), "false_alarms": None if check_only else sum(r["verdict"] == "fail" for r in clean),
        "temperature_false_alarms": sum(r["temperature"]["verdict"] == "fail" for r in clean),
        "clean_votes": {"higher": sum(r["temperature"]["higher"] or 0 for r in clean),
                        "lower": sum(r["temperature"]["lower"] or 0 for r in clean)},
        "fault_runs": len(faults), "faults_failed": sum(r["verdict"] == "fail" for r in faults),
        "tokens_until_fail": {name: sorted((r["tokens_until_fail"] for r in faults if r["engine"] == name),
                                           key=lambda x: (x is None, x or 0))
                              for name in sorted({r["engine"] for r in faults})},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="seeds of each clean configuration")
    ap.add_argument("--fault-seeds", type=int, default=2, help="seeds of each fault configuration")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--only", default="", help="run only rows whose engine is one of these (comma-separated)")
    ap.add_argument("--samplings", default="", help="run only rows with these samplings (comma-separated: "
                    + ", ".join(SAMPLINGS) + ")")
    ap.add_argument("--check-only", action="store_true", help="the temperature check alone (module docstring)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.time()
    rows = grid(args)
    if args.only:
        rows = [r for r in rows if r["engine"] in args.only.split(",")]
    if args.samplings:
        rows = [r for r in rows if r["sampling"] in args.samplings.split(",")]
    results = run_parallel(run, [(r,) for r in rows], args.workers)
    summary = summarize(results, args.check_only)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "rows": results,
                                    "seconds": round(time.time() - t0, 1)}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
