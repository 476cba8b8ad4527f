#!/usr/bin/env python
"""Rebuild the built-in random-weight model pairs into refcheck/models/ (deterministic)."""

from __future__ import annotations

import argparse
from pathlib import Path

from refcheck.models import BUILTIN_PAIRS, MODELS_DIR
from refcheck.models.build import build_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=MODELS_DIR)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in BUILTIN_PAIRS:
        build_pair(name, args.out / name, seed=args.seed)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
