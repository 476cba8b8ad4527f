"""Findings, verdicts and the diff report.

Contract: a comparison emits a :class:`Finding` only when a check does not pass; every check is
counted in :attr:`Report.checks`, so ``pass = checks - non-pass findings`` per category. Verdicts:
pass, benign tie (an argmax flip at a reference near-tie, with its margin), fail (with category),
unsupported (the engine did not record the quantity), skipped. The report's exit code: 1 on any
fail, 5 when nothing was compared or when a statistical verdict is INCONCLUSIVE (the sample cannot
reach the stated power; :attr:`Report.inconclusive` says why), else 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from refcheck.diff.acceptance import merge_json
from refcheck.errors import EXIT_MISMATCH, EXIT_NOTHING, EXIT_PASS


class Verdict(str, Enum):
    PASS = "pass"
    BENIGN_TIE = "benign_tie"
    TRIAGED = "triaged"  # explained: consistent with rounding (the calibrated rule) or reviewed (golden manifests)
    FAIL = "fail"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"


#: verdicts that mark a step, most severe first (a step with none of them passed)
STEP_SEVERITY = (Verdict.FAIL, Verdict.TRIAGED, Verdict.BENIGN_TIE)


def worst_verdict(verdicts: Iterable[Verdict]) -> Verdict | None:
    """The most severe of ``verdicts`` that marks a step (FAIL > TRIAGED > BENIGN_TIE), else None (pass)."""
    present = set(verdicts)
    return next((v for v in STEP_SEVERITY if v in present), None)


def step_counts(findings: Iterable[Finding], total_steps: int) -> dict[str, int]:
    """Verify steps by their worst finding: {pass, benign_tie, [triaged,] fail} summing to ``total_steps``."""
    per_step: dict[tuple[str | None, int], list[Verdict]] = {}
    for f in findings:
        if f.step is not None and f.step >= 0:
            per_step.setdefault((f.request_id, f.step), []).append(f.verdict)
    counts = {"pass": 0, "benign_tie": 0, "fail": 0}
    for verdicts in per_step.values():
        worst = worst_verdict(verdicts)
        if worst is not None:
            counts[worst.value] = counts.get(worst.value, 0) + 1
    counts["pass"] = total_steps - sum(counts.values())
    return counts


@dataclass(frozen=True, slots=True)
class Category:
    name: str
    scope: str  # "run" | "request" | "step" | "node" | "state" (committed KV / conv / recurrent state after a step)
    checks: str  # what a finding of this category says is wrong


#: every category a finding can have, in the order a reader should care about them: the one list the
#: report, the golden manifests' rules (``--triage``, ``--allow-unsupported``) and the sharded merge use
CATEGORY_TABLE: tuple[Category, ...] = (
    Category("engine", "run", "the engine's run itself: crashed, incomplete capture, or a trace that cannot be compared"),
    Category("alignment", "step", "the engine's steps do not line up with the reference's (committed length, root token)"),
    Category("tree", "step", "the draft tree is malformed or is not the tree the reference builds from the same drafts"),
    Category("draft", "step", "the drafter's top-k log-probs differ from the reference drafter's"),
    Category("logits", "node", "a tree node's target log-probs or argmax differ from the reference's at that node"),
    Category("sampling", "node", "at temperature > 0: a node's draw is not what the engine's own uniform gives from the "
                                 "reference's tempered distribution (exact replay)"),
    Category("accepted_path", "step", "the accepted nodes are not the walk of the tree (greedy, or by the draws at T > 0)"),
    Category("accept_length", "step", "the accepted length differs from what the tree and the target's argmaxes give"),
    Category("bonus", "step", "the bonus token is not the target's argmax (or draw, at T > 0) at the last accepted node"),
    Category("output", "request", "the emitted tokens differ from the accepted path and bonus"),
    Category("logprobs", "step", "the emitted tokens' log-probs differ from the reference's"),
    Category("kv", "state", "committed attention KV rows differ from the reference's"),
    Category("conv", "state", "committed conv (short convolution) windows differ from the reference's"),
    Category("recurrent", "state", "committed recurrent (Gated DeltaNet) state differs from the reference's"),
    Category("unmatched", "state", "a recorded state entry the reference has no counterpart for"),
    Category("ar_tokens", "request", "free run: the output differs from target-only greedy decoding (not lossless)"),
    Category("acceptance", "step", "the accepted length differs from the reference's under the same drafting rule at the "
             "same prefix, and no check of the step explains it (free run, strict: per-step τ of the reference's own "
             "run)"),
    Category("distribution", "run", "at temperature > 0 with no draws recorded: the emitted tokens are not draws from the "
                                    "target's tempered distribution (statistical test)"),
    Category("temperature", "run", "at temperature > 0 with the engine's uniforms known: the draws that differ from the "
                                   "reference's lean to one side of the request's temperature (sign test over the steps)"),
)
CATEGORIES: tuple[str, ...] = tuple(c.name for c in CATEGORY_TABLE)
STATE_CATEGORIES: tuple[str, ...] = tuple(c.name for c in CATEGORY_TABLE if c.scope == "state")


def check_category(name: str, where: str) -> str:
    """``name`` if it is a category, else a UsageError naming ``where`` it was given and every category
    (a typo in a manifest rule would otherwise never match anything)."""
    if name not in CATEGORIES:
        from refcheck.errors import UsageError

        raise UsageError(f"{where}: unknown category {name!r} (categories: {', '.join(CATEGORIES)})")
    return name


@dataclass(slots=True)
class Finding:
    verdict: Verdict
    category: str
    request_id: str | None  # None: about the whole trace (the engine, the sampler)
    step: int | None = None  # verify step (None = request level, -1 = prefill)
    node: int | None = None
    layer: int | None = None
    layer_type: str | None = None  # "attention" | "linear_attention" (layer bisection)
    position: int | None = None
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d


@dataclass(slots=True)
class Report:
    case: str
    mode: str
    findings: list[Finding] = field(default_factory=list)
    checks: Counter[str] = field(default_factory=Counter)  # category -> checks made
    stats: dict[str, Any] = field(default_factory=dict)
    expect_failure: str | None = None  # golden of a known-buggy engine: "fail" or "fail:CATEGORY"
    #: ... and where its first failure must be: {request_id, step, node, layer} (None: any)
    expect_first: dict[str, Any] | None = None
    #: statistical verdicts that could not reach their stated power (exit 5 when nothing fails)
    inconclusive: list[str] = field(default_factory=list)

    def check(self, category: str, n: int = 1) -> None:
        self.checks[category] += n

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)

    def merge(self, other: Report) -> None:
        self.findings += other.findings
        self.checks.update(other.checks)
        self.inconclusive += other.inconclusive
        for key, value in other.stats.items():
            if key == "steps":  # per-step verdict counts add up
                mine = self.stats.setdefault("steps", {})
                for k, v in value.items():
                    mine[k] = mine.get(k, 0) + v
            elif key == "ensemble_steps":  # counts add up
                self.stats[key] = self.stats.get(key, 0) + value
            elif key in ("rounding_ratios", "tree_parting_margins"):  # the judged deviations of both
                self.stats[key] = self.stats.get(key, []) + value
            elif key == "acceptance_account":  # accounts of parts of one trace
                self.stats[key] = merge_json(self.stats.get(key), value)
            elif key == "shadow":  # sums
                mine = self.stats.setdefault(key, {k: 0 for k in value})
                for k, v in value.items():
                    mine[k] = mine.get(k, 0) + v
            elif key.startswith("max_"):  # largest deviations: the larger wins
                self.stats[key] = max(self.stats.get(key, value), value)
            else:
                self.stats.setdefault(key, value)

    @property
    def counts(self) -> dict[str, int]:
        non_pass = Counter(f.verdict.value for f in self.findings)
        total = sum(self.checks.values())
        counted = sum(non_pass.values())
        return {"pass": max(total - counted, 0), **{v.value: non_pass.get(v.value, 0) for v in Verdict if v != Verdict.PASS}}

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == Verdict.FAIL]

    def first_divergence(self) -> dict[str | None, Finding]:
        """request -> its first failing finding (earliest step). Outright failures rank before deviations that
        were within rounding at their node and failed only because the request fails ("not triaged"): the
        first divergence is where the engine is first shown wrong, not where rounding stopped being presumed."""
        out: dict[str | None, Finding] = {}
        def order(f: Finding) -> tuple[str, bool, int, int, int, bool, int]:
            step = 1 << 30 if f.step is None else f.step  # request-level summaries come last
            rank = CATEGORIES.index(f.category) if f.category in CATEGORIES else len(CATEGORIES)
            return (f.request_id or "", "not_triaged" in f.details, step, rank, f.node if f.node is not None else -1,
                    f.layer is None, f.layer or 0)

        for f in sorted(self.failures, key=order):
            out.setdefault(f.request_id, f)
        return out

    @property
    def expected_failure_met(self) -> bool | None:
        """For a known-buggy engine: was the expected failure (category) found? None otherwise."""
        if self.expect_failure is None:
            return None
        wanted = self.expect_failure.split(":", 1)[1] if ":" in self.expect_failure else None
        found = {f.category for f in self.failures}
        return bool(found) and (wanted is None or wanted in found) and self.expected_first_met is not False

    @property
    def expected_first_met(self) -> bool | None:
        """Is the request's first failure where ``expect_first`` says (None when nothing is expected)?"""
        want = self.expect_first
        if not want:
            return None
        got = self.first_divergence().get(want["request_id"])
        return got is not None and all(want.get(k) is None or getattr(got, k) == want[k] for k in ("step", "node", "layer"))

    @property
    def exit_code(self) -> int:
        if self.expect_failure is not None:
            return EXIT_PASS if self.expected_failure_met else EXIT_MISMATCH
        if self.failures:
            return EXIT_MISMATCH
        if sum(self.checks.values()) == 0 or self.inconclusive:
            return EXIT_NOTHING
        return EXIT_PASS

    @property
    def verdict(self) -> str:
        if self.expect_failure is not None:
            return "expected failure caught" if self.expected_failure_met else "expected failure NOT caught"
        if self.failures:
            return "fail"
        return "nothing compared" if not self.checks else ("inconclusive" if self.inconclusive else "pass")

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "mode": self.mode,
            "verdict": self.verdict,
            "expect_failure": self.expect_failure,
            "expect_first": self.expect_first,
            "counts": self.counts,
            "checks": dict(self.checks),
            "fail_categories": dict(Counter(f.category for f in self.failures)),
            "first_divergence": {k: v.to_json() for k, v in self.first_divergence().items()},
            "findings": [f.to_json() for f in self.findings],
            "stats": self.stats,
            **({"inconclusive": self.inconclusive} if self.inconclusive else {}),
        }
