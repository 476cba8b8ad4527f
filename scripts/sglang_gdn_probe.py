#!/usr/bin/env python
"""Check the GDN probe's records of an SGLang run against the reference and against isolated kernels.

    # on the GPU machine: a run with the probe on (layer 0), its trace saved
    REFCHECK_GDN_PROBE=/tmp/probe REFCHECK_GDN_PROBE_LAYERS=0 scripts/sglang_bundle.sh run \\
        python3 -m refcheck diff --engine sglang --sglang-algorithm REFCHECK_DDTREE --budget 64 --save-trace run.arrow
    # then, there (--kernels sglang) or anywhere (--kernels reference):
    scripts/sglang_gdn_probe.py /tmp/probe run.arrow [--kernels sglang|reference] [--json OUT.json]

Per probed verify forward and request (refcheck/sglang/capture/gdn_probe_check.py): the engine's kernel
inputs and committed state against the reference's, the engine's core output against the reference's,
and against the isolated replay of the engine's own inputs. Exit 0 when no node's core output is over
--threshold from the reference, 1 when some are (the lines name them and say whether their inputs or
the in-engine execution explain it), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch


def _over(errs: list[float], threshold: float) -> list[int]:
    return [i for i in sorted(range(len(errs)), key=lambda i: -errs[i]) if errs[i] > threshold]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe_dir", type=Path)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--ref-dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernels", choices=("sglang", "reference"), default="reference")
    ap.add_argument("--threshold", type=float, default=0.05)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from refcheck.errors import RefcheckError
    from refcheck.pool import ReferencePool, reference_spec_for
    from refcheck.sglang.capture.gdn_probe_check import check_probe, read_probes
    from refcheck.sglang.capture.gdn_replay import ReferenceKernels, SGLangKernels
    from refcheck.trace.io import read_trace

    checks = []
    try:
        trace = read_trace(args.trace)
        target = ReferencePool().runner(reference_spec_for(trace, args.ref_dtype, args.device)).target
        kernels = SGLangKernels() if args.kernels == "sglang" else ReferenceKernels()
        for rec in read_probes(args.probe_dir):
            for r in range(len(rec["seq_lens"])):
                c = check_probe(rec, r, trace, target, kernels)
                checks.append(c)
                ref_over = _over(c.core_vs_ref, args.threshold)
                iso_over = _over(c.core_vs_isolated, args.threshold)
                inp_over = _over(c.mixed_qkv_rel, args.threshold)
                if not (ref_over or iso_over or inp_over or c.notes or not c.parents_agree):
                    continue
                print(f"{c.file} row {c.row}/{c.batch_size}: {c.request_id} step {c.step} layer {c.layer}: "
                      + " ".join(f"{k} {v:.4f}" for k, v in c.inputs.items())
                      + f"; core off the reference at {[(i, round(c.core_vs_ref[i], 3)) for i in ref_over[:6]]}"
                      + f"; off its isolated replay at {[(i, round(c.core_vs_isolated[i], 3)) for i in iso_over[:6]]}"
                      + (f"; inputs off at {inp_over[:6]}" if inp_over else "")
                      + ("" if c.parents_agree else "; the conv kernel's parent links DIFFER")
                      + "".join(f"; {n}" for n in c.notes))
    except (RefcheckError, ValueError) as exc:
        print(f"sglang_gdn_probe: {exc}", file=sys.stderr)
        return 2
    n_ref = sum(len(_over(c.core_vs_ref, args.threshold)) for c in checks)
    n_iso = sum(len(_over(c.core_vs_isolated, args.threshold)) for c in checks)
    print(f"{len(checks)} request rows checked ({args.kernels} kernels for the isolated replay): "
          f"{n_ref} nodes off the reference, {n_iso} off their isolated replay (rel L2 > {args.threshold:g})")
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in checks]))
    return 1 if n_ref else 0


if __name__ == "__main__":
    sys.exit(main())
