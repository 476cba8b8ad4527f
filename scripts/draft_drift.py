"""Where a low-precision engine's draft log-probs drift from the float32 reference's: its target's features or its
drafter's own computation.

Usage::

    python scripts/draft_drift.py TRACE --request ID [--every 3] [--dtype bfloat16] [--model DIR --draft DIR]

For every ``--every``-th verify step of request ``ID`` in the engine trace ``TRACE``, at the engine's committed
tokens and draft top-k ids, the largest absolute difference from the float32 reference (float32 target features
into the float32 drafter) of: the engine's recorded draft log-probs; the reference in ``--dtype`` throughout; the
float32 drafter fed the ``--dtype`` target's features (the features' share); the ``--dtype`` drafter fed the
float32 target's features (the drafter's share); and the max relative L2 of the ``--dtype`` features. Prints one
row per step. Models: the trace's built-in pair unless ``--model`` / ``--draft`` name checkpoint directories.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_reference.drafter import DFlashDrafter  # noqa: E402
from ddtree_reference.target import Target  # noqa: E402
from refcheck.models import builtin_pair  # noqa: E402
from refcheck.trace.io import read_trace  # noqa: E402
from refcheck.trace.rows import StepRow  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class Pair:
    """A target and its drafter in one dtype."""

    def __init__(self, target_dir: Path, draft_dir: Path, dtype: torch.dtype) -> None:
        self.target = Target.load(target_dir, dtype)
        self.drafter = DFlashDrafter.load(draft_dir, self.target)
        self.layers = tuple(self.drafter.target_layer_ids)

    def features(self, tokens: list[int]) -> torch.Tensor:
        """The target's features of ``tokens`` that the drafter reads, [n, c*H]."""
        return self.target.prefill(torch.tensor(tokens), capture=self.layers)[1].context

    def draft(self, features: torch.Tensor, tokens: list[int], s: StepRow) -> torch.Tensor:
        """Draft log-probs at the step's draft ids [L, k], float32 (for the comparison), from ``features``."""
        d = self.drafter
        d.reset()
        d.extend(features.to(d.fc.weight.dtype), torch.arange(len(tokens)), torch.tensor(tokens))  # the drafter's dtype
        ids = torch.tensor(s.draft_topk_ids)  # [L, k]
        return d.propose(s.tree_tokens[0], len(tokens), ids.shape[0]).gather(1, ids).float()


def step_row(ref: Pair, low: Pair, tokens: list[int], s: StepRow) -> str:
    f32, flow = ref.features(tokens), low.features(tokens)
    base = ref.draft(f32, tokens, s)

    def off(x: torch.Tensor) -> float:
        return float((x - base).abs().max())

    feat = float(((flow.float() - f32).norm(dim=-1) / f32.norm(dim=-1)).max())  # float32 for the norm
    engine = off(torch.tensor(s.draft_topk_logprobs, dtype=torch.float32))
    return (f"| {s.step} | {len(tokens)} | {engine:.3f} | {off(low.draft(flow, tokens, s)):.3f} | "
            f"{off(ref.draft(flow.float(), tokens, s)):.3f} | {off(low.draft(f32, tokens, s)):.3f} | {feat:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--request", required=True)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--draft", type=Path)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    trace = read_trace(a.trace)
    req = next((r for r in trace.requests if r.request_id == a.request), None)
    if req is None:
        sys.exit(f"draft_drift: no request {a.request!r} in {a.trace}")
    pair = builtin_pair(trace.provenance.get("model", "builtin:hybrid").removeprefix("builtin:")) \
        if a.model is None else (a.model, a.draft)
    ref, low = Pair(*pair, torch.float32), Pair(*pair, DTYPES[a.dtype])
    tokens = list(req.prompt_ids) + list(req.output_ids)
    print(f"| step | context | engine | {a.dtype} reference | {a.dtype} features -> float32 drafter | "
          f"float32 features -> {a.dtype} drafter | features rel L2 |\n|---|---|---|---|---|---|---|")
    for s in trace.steps_of(a.request)[:: a.every]:
        if s.draft_topk_ids:
            print(step_row(ref, low, tokens[: s.committed_len], s), flush=True)


if __name__ == "__main__":
    main()
