"""Whether capture changed an SGLang run's tokens: the untraced passes' differences, judged at near-ties.

Contract: the engine process (:mod:`refcheck.sglang.child`) records where each untraced pass
(the warm-up before the captured one, the timing repeats after it) first leaves the captured pass's
output, per request: ``settings.untraced_diffs`` = {pass: [[request index, output position, captured
token, untraced token], ...]}. :func:`judge_untraced` holds each first difference against the fp32
reference target at the captured prefix: where the two tokens' log-probs are closer than the engine
dtype's tie margin (the free run's near-tie rule), the engine's choice there is a rounding choice that
a different batch (staggered arrivals meet the engine at other times when it runs slower under
capture) can flip in bf16; anywhere else the untraced pass disagrees with the captured one about a
token the target decides clearly, which capture must not cause. The result says which, with the places.
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree_reference.compat import full_forward_logits
from ddtree_reference.target import Target
from refcheck.diff.tolerance import calibration_for, engine_numerics


def judge_untraced(trace: Any, target: Target) -> dict[str, Any] | None:
    """The untraced passes' first differences from the captured one, each with the reference's log-prob margin
    between the captured and the untraced token, and whether all of them are near-ties; None without any."""
    diffs: dict[str, list[list[int]]] = trace.prov.settings.get("untraced_diffs") or {}
    if not diffs:
        return None
    tie = calibration_for(*engine_numerics(trace.provenance)).tolerance.tie_margin
    places = []
    for name, entries in sorted(diffs.items()):
        for i, k, captured, untraced in entries:
            req = trace.requests[i] if i < len(trace.requests) else None
            margin = None
            if req is not None and captured >= 0 and untraced >= 0 and k < len(req.output_ids) \
                    and req.output_ids[k] == captured:  # (a length difference, or another request: no margin)
                seq = torch.tensor(list(req.prompt_ids) + list(req.output_ids[:k]), device=target.device)
                logp = torch.log_softmax(full_forward_logits(target.model, seq)[-1], dim=-1)  # [V]
                margin = abs(float(logp[captured] - logp[untraced]))
            places.append({"pass": name, "request": req.request_id if req is not None else str(i), "index": k,
                           "captured": captured, "untraced": untraced, "margin": margin})
    ties = sum(1 for p in places if p["margin"] is not None and p["margin"] < tie)
    return {"differences": len(places), "at_near_ties": ties, "tie_margin": tie, "all_near_ties": ties == len(places),
            "places": places[:20]}


def untraced_text(row: dict[str, Any]) -> str:
    """The matrix column: the untraced passes against the captured one."""
    if row.get("tokens_unchanged_by_capture") is None:
        return "—"
    judged = row.get("untraced_judged")
    if row["tokens_unchanged_by_capture"] or not judged:
        return "same" if row["tokens_unchanged_by_capture"] else "differ (not judged)"
    first = judged["places"][0]
    where = f"first {first['request']} token {first['index']}"
    if judged["all_near_ties"]:
        return f"differ at {judged['differences']} near-tie(s) ({where})"
    return f"DIFFER: {judged['differences'] - judged['at_near_ties']} not at a near-tie ({where})"
