"""The acceptance account: the engine's τ against the reference running the same algorithm, step by step, with
every difference given its cause.

Contract: at each replayed step of a greedy request the replay sets the engine's τ beside the reference's at the
engine's own committed prefix, running the engine's drafting rule (:attr:`refcheck.provenance.Provenance.draft_rule`:
``chain`` for DFLASH at its block, ``ddtree`` at the budget for DDTree engines, ``none`` for target-only decoding):
the reference drafter's draft, the tree the rule builds from it, the reference's greedy walk of that tree. A
step where the two differ gets one cause (:data:`CAUSES`), from what the step's checks found:

* ``verify``: a verify-side check failed at the step (node log-probs, the walk, τ, the bonus, the state...);
* ``draft`` / ``tree``: the engine's drafter or its tree builder failed its check;
* ``rounding``: nothing failed, and the two sides parted at a near-tie: a draft within the rounding the engine's
  dtype explains gave another tree, or the walk left the reference's at a benign tie;
* ``unrecorded``: the engine recorded no draft, so its tree cannot be told from a wrong one (reported, not judged);
* ``unexplained``: none of the above: the step fails the ``acceptance`` check (the replay adds the finding).

:class:`Account` sums the per-step differences by cause (each cause's share of the mean τ difference) and words the
line the report prints ("τ engine 2.49 vs reference 2.61 (chain): -0.10 rounding, -0.02 draft").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class DraftRule:
    """The drafting rule a replay holds an engine's trees and τ to."""

    name: str  # "ddtree" | "chain" | "none" | "other" (refcheck.provenance.DRAFT_RULES)
    budget: int | None  # ddtree: the node budget
    vocab: int
    #: the reference's drafts are comparable with the engine's (not a scripted drafter at other numerics)
    comparable: bool = True


CAUSES = ("verify", "draft", "tree", "rounding", "unrecorded", "unexplained")

#: the categories whose failure at a step makes it a verify fault
VERIFY_CATEGORIES = frozenset({"alignment", "logits", "accepted_path", "accept_length", "bonus", "output", "logprobs",
                               "kv", "conv", "recurrent", "unmatched", "sampling"})


@dataclass(frozen=True, slots=True)
class StepAccount:
    request: str
    step: int
    tau_engine: int
    tau_reference: int
    cause: str | None  # None: the same τ

    @property
    def delta(self) -> int:
        return self.tau_engine - self.tau_reference


def cause_of(failed: set[str], trees_differ: bool, rounding: bool, draft_recorded: bool) -> str:
    """The cause of a τ difference at a step (module docstring): ``failed`` the categories that failed there;
    ``trees_differ`` the engine verified another tree than the reference's rule builds from the reference's draft;
    ``rounding`` the step's parting is at a near-tie the checks excused (a draft within rounding, a benign tie)."""
    if failed & VERIFY_CATEGORIES:
        return "verify"
    if "draft" in failed:
        return "draft"
    if "tree" in failed:
        return "tree"
    if rounding:
        return "rounding"
    if trees_differ and not draft_recorded:
        return "unrecorded"
    return "unexplained"


@dataclass
class Account:
    rule: str  # the drafting rule both sides ran
    steps: list[StepAccount] = field(default_factory=list)
    unrecorded: int = 0  # steps not accounted: the engine recorded no draft to rebuild its tree from

    def add(self, step: StepAccount) -> None:
        self.steps.append(step)

    def by_cause(self) -> dict[str, float]:
        """Each cause's share of the mean τ difference (sum of its steps' differences / all accounted steps)."""
        n = len(self.steps)
        out: dict[str, float] = {}
        for s in self.steps:
            if s.cause is not None and s.delta:
                out[s.cause] = out.get(s.cause, 0.0) + s.delta / n
        return {c: out[c] for c in CAUSES if c in out}

    def to_json(self) -> dict[str, Any]:
        if not self.steps:
            return {"rule": self.rule, "steps": 0, "unrecorded_steps": self.unrecorded}
        eng = statistics.fmean(s.tau_engine for s in self.steps)
        ref = statistics.fmean(s.tau_reference for s in self.steps)
        per_req: dict[str, dict[str, Any]] = {}
        for s in self.steps:
            r = per_req.setdefault(s.request, {"steps": 0, "tau_engine": 0.0, "tau_reference": 0.0, "by_cause": {}})
            r["steps"] += 1
            r["tau_engine"] += s.tau_engine
            r["tau_reference"] += s.tau_reference
            if s.cause is not None and s.delta:
                r["by_cause"][s.cause] = r["by_cause"].get(s.cause, 0) + s.delta
        for r in per_req.values():
            n = r["steps"]
            r["tau_engine"], r["tau_reference"] = r["tau_engine"] / n, r["tau_reference"] / n
            r["by_cause"] = {c: v / n for c, v in r["by_cause"].items()}
        return {"rule": self.rule, "steps": len(self.steps), "tau_engine": eng, "tau_reference": ref,
                "delta": eng - ref, "by_cause": self.by_cause(),
                "steps_differing": sum(1 for s in self.steps if s.delta), "unrecorded_steps": self.unrecorded,
                "requests": per_req}

    def line(self) -> str:
        return account_line(self.to_json())


def account_line(j: dict[str, Any]) -> str:
    """An account's JSON in words: ``τ engine 2.49 vs reference 2.61 (chain, same prefixes, 120 steps): -0.10
    rounding, -0.02 draft``."""
    if not j.get("steps"):
        n = j.get("unrecorded_steps", 0)
        why = f"the engine recorded no draft at {n} steps" if n else "no greedy step"
        return f"τ account ({j.get('rule')}): nothing accounted ({why})"
    causes = ", ".join(f"{v:+.3f} {c}" for c, v in j["by_cause"].items()) or "every step the same"
    return (f"τ engine {j['tau_engine']:.3f} vs reference {j['tau_reference']:.3f} ({j['rule']}, same prefixes, "
            f"{j['steps']} steps): {causes}")


def merge_json(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two accounts' JSON (of parts of one trace, e.g. replayed by several workers) as one."""
    if not a or not a.get("steps"):
        return {**b, "unrecorded_steps": b.get("unrecorded_steps", 0) + (a or {}).get("unrecorded_steps", 0)}
    if not b.get("steps"):
        return {**a, "unrecorded_steps": a.get("unrecorded_steps", 0) + b.get("unrecorded_steps", 0)}
    n = a["steps"] + b["steps"]
    out = {"rule": a["rule"], "steps": n,
           "tau_engine": (a["tau_engine"] * a["steps"] + b["tau_engine"] * b["steps"]) / n,
           "tau_reference": (a["tau_reference"] * a["steps"] + b["tau_reference"] * b["steps"]) / n,
           "steps_differing": a["steps_differing"] + b["steps_differing"],
           "unrecorded_steps": a.get("unrecorded_steps", 0) + b.get("unrecorded_steps", 0),
           "requests": {**a["requests"], **b["requests"]}}
    out["delta"] = out["tau_engine"] - out["tau_reference"]
    causes: dict[str, float] = {}
    for part in (a, b):
        for c, v in part["by_cause"].items():
            causes[c] = causes.get(c, 0.0) + v * part["steps"] / n
    out["by_cause"] = {c: causes[c] for c in CAUSES if c in causes}
    return out
