#!/usr/bin/env python3
"""Power and false-alarm rate of refcheck's distributional lossless test (docs/sampling.md).

Contract: simulates an engine emitting ``n`` tokens, each from next-token distributions of a fixed
synthetic family (vocabulary ``--vocab``, logits N(0, 1) x a per-token scale in {1.5, 2.5, 3.5}, so
entropies range from peaked to broad), judged by :func:`refcheck.diff.distribution.judge` exactly as
a replay judges a trace (tokens dealt into requests of 64, walks of 3 tokens per verify step).
The reference distribution is T = 0.7, top-p 0.9. Each bias is one way an engine departs from it:

* ``T x (1+eps)``: the engine samples at 0.7 (1 + eps) (temperature applied twice at 0.7: eps = -0.3);
* ``argmax``: every token is the argmax; ``greedy bonus``: every 3rd token (the bonus of a 3-token walk);
* ``top-p after walk``: the 2 drafted tokens of each walk without top-p, the bonus with it;
* ``shared uniform``: one uniform for the 3 tokens of a walk;
* ``draft prob > u``: the draft's top token (the reference logits + N(0, 1) noise) is taken when its
  draft probability exceeds the uniform, else a target draw.

For each bias and sample size it reports the fraction of ``--reps`` runs judged FAIL at alpha = 1e-3
(detection rate), and for the unbiased engine the false-alarm rate over ``--null-reps`` runs.
Deterministic: a fixed torch seed. Runs on CPU in about 10 minutes (2 shared cores).

    python scripts/sampling_power.py --out docs/results/sampling-power.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_reference.sampling import inverse_cdf, tempered_probs  # noqa: E402
from refcheck.diff.distribution import ALPHA, Evidence, judge, n_required, pit_values  # noqa: E402

T, TOP_P, WALK, REQUEST = 0.7, 0.9, 3, 64
SIZES = (50, 100, 200, 500, 1000, 2000, 5000)


def family(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Logits ``[n, V]`` of the synthetic family."""
    scale = torch.tensor([1.5, 2.5, 3.5])[torch.randint(0, 3, (n,), generator=gen)]  # [n]
    return torch.randn(n, vocab, generator=gen) * scale[:, None]


def engine_tokens(bias: str, logits: torch.Tensor, ref: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The tokens ``[n]`` an engine with ``bias`` emits at these prefixes (``ref``: the reference's
    distribution ``[n, V]``)."""
    n = logits.shape[0]
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    pos = torch.arange(n) % WALK  # place of each token in its walk; WALK - 1 = the bonus
    if bias == "none":
        return inverse_cdf(ref, u)
    if bias.startswith("T x"):
        eps = float(bias.split("(1")[1].rstrip(")"))
        return inverse_cdf(tempered_probs(logits, T * (1 + eps), 0, TOP_P), u)
    if bias == "argmax":
        return ref.argmax(dim=1)
    if bias == "greedy bonus":
        return torch.where(pos == WALK - 1, ref.argmax(dim=1), inverse_cdf(ref, u))
    if bias == "top-p after walk":
        return torch.where(pos == WALK - 1, inverse_cdf(ref, u), inverse_cdf(tempered_probs(logits, T), u))
    if bias == "shared uniform":
        shared = u[torch.arange(n) - pos]  # the walk's first uniform for all its tokens
        return inverse_cdf(ref, shared)
    if bias == "draft prob > u":
        draft = tempered_probs(logits + torch.randn(logits.shape, generator=gen), T)  # [n, V]
        top = draft.max(dim=1)
        return torch.where(top.values > u, top.indices, inverse_cdf(ref, torch.rand(n, generator=gen, dtype=torch.float64)))
    raise ValueError(bias)


def verdict(bias: str, n: int, vocab: int, gen: torch.Generator) -> tuple[str, float]:
    logits = family(n, vocab, gen)
    ref = tempered_probs(logits, T, 0, TOP_P)  # [n, V]
    tokens = engine_tokens(bias, logits, ref, gen)
    ev = Evidence()
    ok = ref.gather(1, tokens[:, None])[:, 0] > 0
    if not bool(ok.all()):
        ev.impossible_by_request["all"] = int((~ok).sum())
    w = torch.rand(int(ok.sum()), generator=gen, dtype=torch.float64)
    v = pit_values(ref[ok], tokens[ok], w).tolist()
    vid = pit_values(ref[ok], tokens[ok], w, "id").tolist()
    for i in range(0, len(v), REQUEST):
        ev.pits[f"r{i // REQUEST}"] = v[i:i + REQUEST]
        ev.pits_id[f"r{i // REQUEST}"] = vid[i:i + REQUEST]
    j = judge(ev)
    return j.verdict, j.p_value


BIASES = ("T x (1-0.3)", "T x (1-0.1)", "T x (1-0.05)", "T x (1+0.05)", "T x (1+0.1)", "argmax", "greedy bonus",
          "top-p after walk", "shared uniform", "draft prob > u")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--null-reps", type=int, default=1000)
    ap.add_argument("--null-n", type=int, default=1000)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(20)
    t0 = time.time()
    null = [verdict("none", args.null_n, args.vocab, gen) for _ in range(args.null_reps)]
    alarms = sum(v == "fail" for v, _ in null)
    below = {a: sum(p < a for _, p in null) / len(null) for a in (1e-3, 1e-2, 5e-2)}
    rows = {}
    for bias in BIASES:
        rows[bias] = {}
        for n in SIZES:
            got = [verdict(bias, n, args.vocab, gen)[0] for _ in range(args.reps)]
            rows[bias][n] = sum(v == "fail" for v in got) / args.reps
    result = {"alpha": ALPHA, "n_required_for_stated_power": n_required(), "temperature": T, "top_p": TOP_P,
              "vocab": args.vocab, "reps": args.reps,
              "null": {"runs": args.null_reps, "tokens_per_run": args.null_n, "false_alarms": alarms,
                       "rate": alarms / args.null_reps, "fraction_p_below": below},
              "detection_rate": rows, "seconds": round(time.time() - t0, 1)}
    print(f"false alarms: {alarms} of {args.null_reps} clean runs of {args.null_n} tokens "
          f"(p < 0.01: {below[1e-2]:.3f}, p < 0.05: {below[5e-2]:.3f})")
    print("| bias | " + " | ".join(f"n={n}" for n in SIZES) + " |")
    print("|---|" + "---|" * len(SIZES))
    for bias, r in rows.items():
        print(f"| {bias} | " + " | ".join(f"{r[n]:.2f}" for n in SIZES) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
