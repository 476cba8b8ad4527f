"""Drift between a golden trace and its regeneration: library versions and numbers.

Contract: :func:`version_changes` lists the libraries whose recorded version differs between two
provenances (``transformers 5.23.0 → 5.24.0``). :func:`numeric_drift` compares two traces of one case
step by step where they describe the same thing (same request and step, same tree tokens; same top-k
id at a node rank), and returns a :class:`Drift`: the largest absolute change of the target's top-k
log-probs, of the emitted and output log-probs, the largest relative L2 change of each committed-state
sketch kind, how many steps were compared and how many top-k ids moved. A drift of zero everywhere
means the numbers are bit-identical where they can be compared. Reading the traces is the caller's
job; nothing here runs a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from refcheck.trace.io import StepRow, Trace

#: the provenance ``versions`` keys compared (any other key is compared too, these first)
VERSION_KEYS = ("transformers", "torch", "pyarrow", "python", "refcheck")


def version_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["transformers 5.23.0 → 5.24.0", ...]`` from two provenances' ``versions``."""
    a, b = old.get("versions") or {}, new.get("versions") or {}
    keys = [k for k in VERSION_KEYS if k in a or k in b] + sorted((set(a) | set(b)) - set(VERSION_KEYS))
    return [f"{k} {a.get(k, '-')} → {b.get(k, '-')}" for k in keys if a.get(k) != b.get(k)]


@dataclass(slots=True)
class Drift:
    steps_compared: int = 0
    max_logprob_abs: float = 0.0  # target top-k log-probs at matching ids
    max_emitted_logprob_abs: float = 0.0  # emitted tokens' and outputs' log-probs
    topk_ids_moved: int = 0  # node ranks whose top-k id differs
    max_state_rel_l2: dict[str, float] = field(default_factory=dict)  # sketch kind -> largest relative L2 change

    @property
    def any(self) -> bool:
        return bool(self.max_logprob_abs or self.max_emitted_logprob_abs or self.topk_ids_moved
                    or any(self.max_state_rel_l2.values()))

    def summary(self) -> str:
        """``|Δ log-prob| ≤ 3.1e-06, state rel L2 ≤ 2e-07 (rec), 0 top-k ids moved over 76 steps``."""
        if not self.steps_compared:
            return "no step to compare"
        if not self.any:
            return f"identical over {self.steps_compared} steps"
        parts = [f"|Δ log-prob| ≤ {max(self.max_logprob_abs, self.max_emitted_logprob_abs):.2g}"]
        if self.max_state_rel_l2:
            kind, worst = max(self.max_state_rel_l2.items(), key=lambda kv: kv[1])
            parts.append(f"state rel L2 ≤ {worst:.2g} ({kind})")
        if self.topk_ids_moved:
            parts.append(f"{self.topk_ids_moved} top-k ids moved")
        return ", ".join(parts) + f" over {self.steps_compared} steps"

    def to_json(self) -> dict[str, Any]:
        return {"steps_compared": self.steps_compared, "max_logprob_abs": self.max_logprob_abs,
                "max_emitted_logprob_abs": self.max_emitted_logprob_abs, "topk_ids_moved": self.topk_ids_moved,
                "max_state_rel_l2": dict(self.max_state_rel_l2)}


def _abs_diff(a: list[float], b: list[float]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if math.isnan(x) or math.isnan(y):
            continue  # the engine reports none there (both sides, for a deterministic reference)
        worst = max(worst, abs(x - y))
    return worst


def _step_drift(drift: Drift, o: StepRow, s: StepRow) -> None:
    """Add one step's drift to ``drift``: ``o`` the old row, ``s`` the new one of the same request, step and
    tree tokens."""
    drift.steps_compared += 1
    for ids_o, ids_n, lp_o, lp_n in zip(o.topk_ids, s.topk_ids, o.topk_logprobs, s.topk_logprobs):
        for a, b, x, y in zip(ids_o, ids_n, lp_o, lp_n):
            if a != b:
                drift.topk_ids_moved += 1
            elif not (math.isnan(x) or math.isnan(y)):
                drift.max_logprob_abs = max(drift.max_logprob_abs, abs(x - y))
    if o.emitted == s.emitted:
        drift.max_emitted_logprob_abs = max(drift.max_emitted_logprob_abs,
                                            _abs_diff(o.emitted_logprobs, s.emitted_logprobs))
    states = {e.name: e for e in o.state}
    for e in s.state:
        prev = states.get(e.name)
        if prev is None or prev.sketch.shape != e.sketch.shape:
            continue
        old_t, new_t = prev.sketch.double(), e.sketch.double()
        rel = float((new_t - old_t).norm() / max(float(old_t.norm()), 1e-30))
        drift.max_state_rel_l2[e.kind] = max(drift.max_state_rel_l2.get(e.kind, 0.0), rel)


def numeric_drift(old: Trace, new: Trace) -> Drift:
    """How far ``new``'s numbers moved from ``old``'s where both describe the same step and node."""
    drift = Drift()
    by_key = {(s.request_id, s.step): s for s in old.steps}
    for s in new.steps:
        o = by_key.get((s.request_id, s.step))
        if o is not None and o.tree_tokens == s.tree_tokens:
            _step_drift(drift, o, s)
    outs = {r.request_id: r for r in old.requests}
    for r in new.requests:
        prev = outs.get(r.request_id)
        if prev is not None and prev.output_ids == r.output_ids:
            drift.max_emitted_logprob_abs = max(drift.max_emitted_logprob_abs,
                                                _abs_diff(prev.output_logprobs, r.output_logprobs))
    return drift
