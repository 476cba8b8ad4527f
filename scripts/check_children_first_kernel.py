#!/usr/bin/env python
"""SGLang's tree sampler kernel against refcheck's restatement of its rule (ddtree_reference/children_first.py).

    python scripts/check_children_first_kernel.py [--batches 200] [--out result.json]

Runs ``sgl_kernel.tree_speculative_sampling_target_only`` (the kernel NGRAM's verify calls at
temperature > 0, thresholds 1) on random trees, target distributions and coins, and replays each
request with :func:`ddtree_reference.children_first.walk` on the same float32 probabilities (in float64).
Prints how many requests agree on the accepted path and the bonus; a disagreement is listed with how
far its coins lie from the rule's edge (``outside``): only edge cases within float32 rounding (the
kernel sums in float32) may differ. Needs a CUDA GPU and sgl_kernel (the SGLang bundle). Exit 0 when
every disagreement lies within 1e-5 of an edge, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_reference import children_first  # noqa: E402
from refcheck.sglang.layout import depths_from_parents, links_from_parents  # noqa: E402

EDGE = 1e-5  # float32 running sums over <= 16 children differ from float64 by far less


def random_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of an n-node tree in index order (each node's parent has a lower index)."""
    return [-1] + [rng.randrange(i) if rng.random() < 0.6 else i - 1 for i in range(1, n)]


def batch(rng: random.Random, gen: torch.Generator, bs: int, n: int, V: int, temperature: float):
    parents = [random_tree(rng, n) for _ in range(bs)]
    logits = torch.randn(bs, n, V, generator=gen) * 3.0  # peaked enough that drafts get accepted
    probs = torch.softmax(logits / temperature, dim=-1).float()  # [bs, n, V] float32, as SGLang hands it over
    tokens = torch.zeros(bs, n, dtype=torch.long)
    for b in range(bs):  # a child's token: often the parent's likeliest tokens, distinct among siblings
        for i in range(1, n):
            sib = {int(tokens[b, j]) for j in range(1, i) if parents[b][j] == parents[b][i]}
            ranked = torch.argsort(probs[b, parents[b][i]], descending=True).tolist()
            free = [t for t in ranked if t not in sib]
            pick = [t for t in free[:6]] if rng.random() < 0.8 else free
            tokens[b, i] = pick[rng.randrange(len(pick))] if rng.random() < 0.5 else pick[0]
    coins = torch.rand(bs, n, generator=gen)  # [bs, n] float32 in [0, 1)
    final = torch.rand(bs, generator=gen)
    return parents, probs, tokens, coins, final


def run_kernel(parents, probs, tokens, coins, final):
    from sgl_kernel import tree_speculative_sampling_target_only

    bs, n, V = probs.shape
    width = max(max(depths_from_parents(p)) for p in parents) + 1
    nt, ns = zip(*(links_from_parents(p) for p in parents))
    dev = "cuda"
    retrive_index = (torch.arange(bs)[:, None] * n + torch.arange(n)[None]).to(dev)  # [bs, n] flat node indices
    predicts = torch.zeros(bs * n, dtype=torch.int32, device=dev)
    accept_index = torch.full((bs, width), -1, dtype=torch.int32, device=dev)
    accept_num = torch.zeros(bs, dtype=torch.int32, device=dev)
    tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
        candidates=tokens.to(dev), retrive_index=retrive_index,
        retrive_next_token=torch.tensor(nt, dtype=torch.long, device=dev),
        retrive_next_sibling=torch.tensor(ns, dtype=torch.long, device=dev),
        uniform_samples=coins.to(dev), uniform_samples_for_final_sampling=final.to(dev),
        target_probs=probs.to(dev).contiguous(), draft_probs=torch.zeros_like(probs, device=dev),
        threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    torch.cuda.synchronize()
    out = []
    acc, num, pred = accept_index.cpu().tolist(), accept_num.cpu().tolist(), predicts.cpu().tolist()
    for b in range(bs):
        path = [a - b * n for a in acc[b][: num[b] + 1]]
        out.append((path, int(pred[b * n + path[-1]])))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    total = agree = accepted = 0
    bad: list[dict] = []
    for k in range(args.batches):
        temperature = (0.5, 1.0, 1.5)[k % 3]
        parents, probs, tokens, coins, final = batch(rng, gen, args.bs, args.nodes, args.vocab, temperature)
        got = run_kernel(parents, probs, tokens, coins, final)
        for b, (path, bonus) in enumerate(got):
            children = [[c for c in range(args.nodes) if parents[b][c] == i] for i in range(args.nodes)]
            toks = tokens[b].tolist()
            want = children_first.walk(probs[b].double(), toks, children, coins[b].double().tolist(), float(final[b]))
            total += 1
            accepted += len(want[0]) - 1
            if (path, bonus) == want:
                agree += 1
                continue
            # where the two part: the last node both walks reached, and how far its coins lie from the kernel's token
            common = next((i for i, (x, y) in enumerate(zip(path, want[0])) if x != y), min(len(path), len(want[0])))
            node = path[common - 1]
            came = toks[path[common]] if common < len(path) else bonus
            kid_tokens = [toks[c] for c in children[node]]
            dist = children_first.outside(probs[b, node].double(), kid_tokens, float(coins[b, node]), float(final[b]), came)
            bad.append({"batch": k, "request": b, "kernel": [path, bonus], "rule": [want[0], want[1]], "node": node,
                        "outside": dist})
    worst = max((d["outside"] for d in bad), default=0.0)
    result = {"requests": total, "agree": agree, "accepted_drafts": accepted, "disagree": len(bad),
              "worst_outside": worst, "edge": EDGE, "examples": bad[:10]}
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
    for d in bad[:10]:
        print(d)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if worst <= EDGE else 1


if __name__ == "__main__":
    raise SystemExit(main())
