"""Live SGLang, slice "graphs": REFCHECK_DDTREE under SGLang's CUDA graphs, and target-only decoding
(markers ``sglang`` and ``gpu``; skipped without a GPU and SGLang).

On the H200: ``scripts/sglang_bundle.sh run python3 -m pytest -m sglang tests/test_gpu_sglang_graphs.py``
(``scripts/gpu_tests.sh`` runs every slice). Two engine runs on the built-in hybrid pair, bf16.
"""

from __future__ import annotations

import pytest
from gpu_sglang_kit import diff_on_gpu, hybrid_spec, logits_failures_rare, structural_failures

from refcheck.diff.findings import Verdict
from refcheck.prompts import load_prompts
from refcheck.sglang.runner import SGLangRunner

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]


def test_ddtree_under_cuda_graphs_replays_the_verify_graph_and_passes():
    """REFCHECK_DDTREE with SGLang's CUDA graphs on (budget 15): every verify replays the captured
    TARGET_VERIFY graph (captured with FULL hidden states, which the drafter reads), every step is
    captured, and the replay and free run show no structural or state failure."""
    trace = SGLangRunner(hybrid_spec(), "REFCHECK_DDTREE", cuda_graphs=True).trace(load_prompts())
    cap = trace.provenance["capture"]
    assert not cap["errors"] and not cap["crash"] and not cap["incomplete"], cap
    stats = cap["stats"]
    assert stats["branching_steps"] > 0 and not stats.get("chain_layout_branching_steps")
    assert stats["steps"] > 0 and stats["cuda_graph_steps"] == stats["steps"], stats  # no verify fell back to eager
    rep = diff_on_gpu(trace, "ddtree-b15-graphs", mode="both")
    assert not structural_failures(rep), structural_failures(rep)[:5]
    assert logits_failures_rare(rep)


def test_target_only_equals_reference_greedy_up_to_near_ties():
    trace = SGLangRunner(hybrid_spec(), "NONE").trace(load_prompts())
    rep = diff_on_gpu(trace, "sglang-none", mode="free")
    assert not [f for f in rep.failures if f.category == "ar_tokens"], [f.message for f in rep.failures]
    assert all(f.verdict in (Verdict.BENIGN_TIE,) for f in rep.findings if f.category == "ar_tokens")
