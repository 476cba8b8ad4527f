#!/usr/bin/env python
"""Replay SGLang's Gated DeltaNet tree-verify kernels on the reference's inputs for one traced step.

    scripts/sglang_bundle.sh run python3 scripts/sglang_gdn_replay.py TRACE.arrow --request code-1 --step 13 \\
        [--layers 0,1] [--ref-dtype bfloat16] [--device cuda] [--kernels sglang|reference] [--json OUT.json]

For each Gated DeltaNet layer asked for, the reference computes that layer's mixer inputs at the step
(refcheck/sglang/capture/gdn_replay.py), SGLang's conv kernel and recurrent kernel run on them (each
on exact inputs), and every node's relative L2 distance from the reference's conv and core outputs is
printed, worst first, with the nodes over --threshold named. ``--kernels reference`` runs the same
harness with the PyTorch stand-ins (anywhere, no SGLang): every node must then be exact. Exit 0 when
no node is over the threshold, 1 when some are, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--request", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--layers", default="0", help="Gated DeltaNet layer ids, comma-separated, or 'all'")
    ap.add_argument("--ref-dtype", default="bfloat16", help="the reference's dtype (the engine's, for like-for-like)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernels", choices=("sglang", "reference"), default="sglang")
    ap.add_argument("--threshold", type=float, default=0.05, help="per-node rel L2 that counts as a deviation")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from refcheck.errors import RefcheckError
    from refcheck.pool import ReferencePool, reference_spec_for
    from refcheck.sglang.capture.gdn_replay import ReferenceKernels, SGLangKernels, gdn_inputs, replay
    from refcheck.trace.io import read_trace

    try:
        trace = read_trace(args.trace)
        target = ReferencePool().runner(reference_spec_for(trace, args.ref_dtype, args.device)).target
        layers = ([i for i in range(len(target.layers)) if target.is_linear(i)] if args.layers == "all"
                  else [int(x) for x in args.layers.split(",")])
        kernels = SGLangKernels() if args.kernels == "sglang" else ReferenceKernels()
        results = {}
        for inp in gdn_inputs(trace, args.request, args.step, target, layers):
            layer = inp.layer
            res = replay(inp, kernels)
            results[layer] = res
            for name, errs in (("conv", res.conv_rel), ("core", res.core_rel)):
                worst = sorted(range(len(errs)), key=lambda i: -errs[i])
                over = [i for i in worst if errs[i] > args.threshold]
                med = sorted(errs)[len(errs) // 2]
                print(f"layer {layer} {name:4s}: {len(errs)} nodes, median rel L2 {med:.4f}; worst "
                      + ", ".join(f"node {i} {errs[i]:.4f}" for i in worst[:5])
                      + (f"; OVER {args.threshold:g}: {over}" if over else ""))
            print(f"layer {layer} conv kernel's parent links {'equal' if res.parents_agree else 'DIFFER FROM'} the tree's")
    except (RefcheckError, ValueError) as exc:
        print(f"sglang_gdn_replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps({str(k): {"conv_rel": v.conv_rel, "core_rel": v.core_rel,
                                                  "parents_agree": v.parents_agree} for k, v in results.items()}, indent=1))
    bad = any(max(r.conv_rel + r.core_rel) > args.threshold or not r.parents_agree for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
