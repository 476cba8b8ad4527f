#!/usr/bin/env python
"""τ per prompt kind and budget, and how often an accepted path goes through a non-first sibling.

    python scripts/acceptance_table.py [--pair hybrid] [--budgets chain,4,15,64] [--max-new-tokens 64]

Every output is also checked against target-only greedy decoding (the lossless invariant).
"""

from __future__ import annotations

import argparse
import collections
import json

from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec, ReferenceRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="hybrid")
    ap.add_argument("--budgets", default="chain,4,15,64")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default="dflash")
    args = ap.parse_args()
    prompts = load_prompts()
    rows = {}
    for b in args.budgets.split(","):
        budget = None if b == "chain" else int(b)
        runner = ReferenceRunner(EngineSpec(pair=args.pair, budget=budget, max_new_tokens=args.max_new_tokens,
                                            drafter=args.drafter))
        runs = runner.run(prompts, check_ar=True)
        by_kind = collections.defaultdict(list)
        nonfirst = steps = 0
        for r in runs:
            for s in r.result.steps:
                by_kind[r.prompt.kind].append(s.accept_length)
                steps += 1
                nonfirst += any(int(s.tree.ranks[i]) > 0 for i in s.accepted)
        all_taus = [t for v in by_kind.values() for t in v]
        rows[b] = {
            "mean_tau": sum(all_taus) / len(all_taus),
            "tau_by_kind": {k: sum(v) / len(v) for k, v in by_kind.items()},
            "steps": steps,
            "nonfirst_sibling_steps": nonfirst / steps,
            "all_equal_greedy": all(r.ar_match for r in runs),
        }
        print(b, json.dumps(rows[b]), flush=True)


if __name__ == "__main__":
    main()
