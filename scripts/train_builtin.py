#!/usr/bin/env python
"""Train the built-in model pairs (target + DFlash drafter), seeded; write them in checkpoint layout.

    python scripts/train_builtin.py --out /tmp/models --device cuda        # the real run (H200: minutes)
    python scripts/train_builtin.py --out /tmp/m --quick                   # smoke test on CPU

    python scripts/train_builtin.py --out build/models --pairs wide          # the calibration corpus's wide hybrid (GPU)

Writes OUT/<pair>/{target,draft}/ and OUT/<pair>/training.json (config, corpus hash, losses, wall
time). Install into refcheck/models/ by copying the pair directories, then regenerate the goldens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from refcheck.models import BUILTIN_PAIRS, MODELS_DIR
from refcheck.models.train import TrainConfig, train_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairs", default=",".join(BUILTIN_PAIRS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a few steps of everything (smoke test)")
    ap.add_argument("--target-steps", type=int)
    ap.add_argument("--draft-steps", type=int)
    args = ap.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # training only; the reference never enables TF32
    summary = {}
    for name in args.pairs.split(","):
        cfg = TrainConfig.for_pair(name, args.seed)
        _adjust(cfg, args)
        t0 = time.time()
        info = train_pair(name, args.out / name, MODELS_DIR / "tokenizer.json", cfg, args.device,
                          log=lambda m, n=name: print(f"[{n}] {m}", flush=True))
        summary[name] = {"wall_s": time.time() - t0, "target_loss": info["final_target_loss"],
                         "draft_loss": info["final_draft_loss"]}
    print(json.dumps(summary, indent=2))


def _adjust(cfg: TrainConfig, args: argparse.Namespace) -> None:
    """The command line's overrides: --quick, --target-steps, --draft-steps."""
    if args.quick:
        cfg.target_steps, cfg.draft_steps, cfg.distill_prompts, cfg.distill_new = 3, 3, 16, 24
        cfg.target_batch = cfg.draft_batch = 4
    if args.target_steps is not None:
        cfg.target_steps = args.target_steps
    if args.draft_steps is not None:
        cfg.draft_steps = args.draft_steps


if __name__ == "__main__":
    main()
