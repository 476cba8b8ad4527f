"""What the live-SGLang GPU test slices share (tests/test_gpu_sglang_*.py): the engine spec on the built-in
hybrid pair, the categories that are never a rounding matter, and the diff of a trace against the
reference in fp32 on the GPU.

The slices are files so that each runs in one device call (under 8 minutes on one H200; the README's
"GPU tests" table gives the measured times): ``scripts/gpu_tests.sh`` runs them side by side.
"""

from __future__ import annotations

from refcheck.diff.findings import Report
from refcheck.reference_runner import EngineSpec

STRUCTURAL = {"engine", "alignment", "tree", "accepted_path", "accept_length", "bonus", "output", "kv", "conv",
              "recurrent", "unmatched"}


def hybrid_spec(budget: int = 15, max_new_tokens: int = 32) -> EngineSpec:
    """The built-in hybrid pair in bf16 on CUDA (6 prompts x ``max_new_tokens``)."""
    return EngineSpec(pair="hybrid", dtype="bfloat16", device="cuda", budget=budget, max_new_tokens=max_new_tokens)


def diff_on_gpu(trace, case: str, mode: str) -> Report:
    """``trace`` diffed against the reference in fp32 on CUDA, default options."""
    from refcheck.diff.judge import judge
    from refcheck.pool import ReferencePool

    return judge(trace, ReferencePool(), case, mode=mode, ref_dtype="float32", ref_device="cuda")


def structural_failures(rep: Report) -> list[str]:
    return [f.message for f in rep.failures if f.category in STRUCTURAL]


def logits_failures_rare(rep: Report) -> bool:
    """bf16 node log-probs: isolated deviations beyond the bound are rare (measured 3 of 1600 nodes)."""
    return len([f for f in rep.failures if f.category == "logits"]) <= 0.01 * rep.checks["logits"]
