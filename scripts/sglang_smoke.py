#!/usr/bin/env python
"""Load a refcheck target checkpoint in SGLang (target-only, greedy) and record its outputs.

    bash .bundle/run_with_bundle.sh python3 scripts/sglang_smoke.py --out sglang.json [--model DIR]

Runs in SGLang's own environment (the bundle shadows transformers); compare the JSON with the
reference afterwards in a plain environment: `python scripts/sglang_smoke.py --compare sglang.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sglang(model: Path, out: Path, max_new: int) -> None:
    import sglang as sgl

    prompts = [json.loads(line) for line in (ROOT / "refcheck/prompts/builtin.jsonl").read_text().splitlines() if line]
    t0 = time.time()
    engine = sgl.Engine(model_path=str(model), skip_tokenizer_init=True, attention_backend="triton",
                        disable_cuda_graph=True, disable_overlap_schedule=True, disable_radix_cache=True,
                        dtype="bfloat16", sampling_backend="pytorch", mem_fraction_static=0.3, page_size=1)
    start = time.time() - t0
    res = engine.generate(input_ids=[p["prompt_ids"] for p in prompts],
                          sampling_params={"temperature": 0.0, "max_new_tokens": max_new})
    gen = time.time() - t0 - start
    engine.shutdown()
    out.write_text(json.dumps({"sglang": sgl.__version__, "start_s": start, "generate_s": gen, "model": str(model),
                               "outputs": {p["id"]: r["output_ids"] for p, r in zip(prompts, res)}}, indent=2))
    print(f"sglang {sgl.__version__}: engine start {start:.1f} s, generate {gen:.1f} s", flush=True)


def compare(path: Path, device: str) -> None:
    import torch

    from ddtree_reference.compat import full_forward_logits
    from ddtree_reference.oracle import greedy_decode
    from ddtree_reference.target import Target
    from refcheck.prompts import load_prompts

    data = json.loads(path.read_text())
    prompts = {p.id: list(p.prompt_ids) for p in load_prompts()}
    t32 = Target.load(data["model"] if Path(data["model"]).is_dir() else ROOT / "refcheck/models/hybrid/target",
                      dtype=torch.float32, device=device)
    summary = {}
    for pid, out in data["outputs"].items():
        ref = greedy_decode(t32.model, prompts[pid], len(out))
        i = next((k for k, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        row = {"equal_fp32_greedy": i is None, "tokens": len(out)}
        if i is not None:
            logp = torch.log_softmax(full_forward_logits(t32.model, torch.tensor(prompts[pid] + ref[:i], device=device))[-1], -1)
            row.update(first_diff=i, sglang=out[i], reference=ref[i], margin=float(logp[ref[i]] - logp[out[i]]))
        summary[pid] = row
        print(pid, row, flush=True)
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=ROOT / "refcheck/models/hybrid/target")
    ap.add_argument("--out", type=Path, default=Path("sglang.json"))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--compare", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.device)
    else:
        run_sglang(args.model, args.out, args.max_new_tokens)


if __name__ == "__main__":
    main()
