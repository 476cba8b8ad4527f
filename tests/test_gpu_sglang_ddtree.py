"""Live SGLang, slices "ddtree" and "ddtree-wide": refcheck's DDTree inside SGLang (per-node GDN state) at
four budgets, and its leaky chain layout (markers ``sglang`` and ``gpu``; skipped without a GPU and SGLang).

On the H200: ``scripts/sglang_bundle.sh run python3 -m pytest -m sglang tests/test_gpu_sglang_ddtree.py -k SLICE``
with SLICE ``narrow`` (budgets 15 and 16, the leaky layout: three engine runs) or ``wide`` (budgets 32 and
64: two); ``scripts/gpu_tests.sh`` runs every slice.
"""

from __future__ import annotations

import pytest
from gpu_sglang_kit import diff_on_gpu, hybrid_spec

from refcheck.prompts import load_prompts
from refcheck.sglang.runner import SGLangRunner

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]


def _passes_replay(budget: int) -> None:
    """refcheck's DDTree on SGLang at ``budget``: a branching capture, and the replay and free run pass with
    default options (the calibrated verdict, refcheck/diff/tolerance.py)."""
    trace = SGLangRunner(hybrid_spec(budget), "REFCHECK_DDTREE").trace(load_prompts())
    cap = trace.provenance["capture"]
    assert not cap["errors"] and not cap["crash"], cap
    assert cap["stats"]["branching_steps"] > 0 and not cap["stats"].get("chain_layout_branching_steps")
    rep = diff_on_gpu(trace, f"ddtree-b{budget}", mode="both")
    assert not rep.failures, [f.message for f in rep.failures][:5]


@pytest.mark.parametrize("budget", [15, 16])
def test_narrow_ddtree_on_sglang_passes_replay(budget):
    _passes_replay(budget)


@pytest.mark.parametrize("budget", [32, 64])
def test_wide_ddtree_on_sglang_passes_replay(budget):
    _passes_replay(budget)


def test_narrow_ddtree_leaky_chain_layout_is_caught():
    trace = SGLangRunner(hybrid_spec(), "REFCHECK_DDTREE_LEAKY_CHAIN").trace(load_prompts())
    # default options: once a request fails, no rounding ensemble runs for it, so the leak is cheap to judge
    rep = diff_on_gpu(trace, "ddtree-leaky", mode="replay")
    cats = {f.category for f in rep.failures}
    assert "tree" in cats  # branching trees through the chain layout, flagged from the capture
    assert cats & {"recurrent", "logits"}, cats  # and the numerics show the leak
