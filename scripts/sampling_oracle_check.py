#!/usr/bin/env python3
"""Lossless at T > 0, beyond the unit test: the tree decoder against target-only sampling on 40
configurations (built-in hybrid pair, scripted drafter, budgets chain/0/1/4/15, four (T, top-k, top-p)
settings, 12 tokens each); counts differing runs and draws within 1e-6 of a CDF edge.

    python scripts/sampling_oracle_check.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig  # noqa: E402
from ddtree_reference.oracle import sample_decode  # noqa: E402
from ddtree_reference.sampling import Sampling  # noqa: E402
from ddtree_reference.scripted import ScriptedDrafter  # noqa: E402
from ddtree_reference.target import Target  # noqa: E402
from refcheck.models import builtin_pair  # noqa: E402

PROMPT = [17, 3, 99, 250, 41, 8, 8, 120]
SETTINGS = [(0.6, 0, 1.0), (1.0, 5, 0.9), (1.7, 0, 0.9), (1.0, 0, 1.0)]  # (T, top-k, top-p)
BUDGETS = [None, 0, 1, 4, 15]  # None = chain
NEAR = 1e-6


def main() -> None:
    torch.set_num_threads(1)
    target = Target.load(builtin_pair("hybrid")[0])
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, seed=3)
    near = differing = tokens = 0
    smallest = 1.0
    for seed, (temp, top_k, top_p) in zip(range(40), itertools.cycle(SETTINGS)):
        s = Sampling(temp, top_k, top_p, seed * 7919)
        want, margins = sample_decode(target.model, PROMPT, 12, s, seed)
        cfg = DecodeConfig(budget=BUDGETS[seed % len(BUDGETS)], max_new_tokens=12, sampling=s)
        got = DDTreeDecoder(target, drafter, cfg).generate(PROMPT, request=seed).output_ids
        tokens += len(want)
        near += sum(m < NEAR for m in margins)
        smallest = min(smallest, *margins)
        differing += got != want
    print(f"tokens {tokens}; draws within {NEAR:g} of a CDF edge: {near}; smallest edge distance {smallest:.3g}; "
          f"runs differing from target-only sampling: {differing} of 40")


if __name__ == "__main__":
    main()
