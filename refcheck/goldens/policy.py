"""A golden's gate policy: what its manifest entry says the gate must hold it to, typed and applied.

Contract: :meth:`GatePolicy.of` reads a manifest entry's rules — ``expect`` (``pass``, ``fail`` or
``fail:CATEGORY``), ``expect_first`` (where an expected failure must first show: ``{request_id, step,
node, layer}``, node and layer null for any), ``allow_unsupported`` (a list of the categories the engine
cannot record) and ``triaged`` (a list of the findings a person reviewed: ``{request_id, step, node,
category}``) — and refuses what it cannot honour (a value of another shape, a category that does not
exist, the retired per-golden ``triage_rules``) with a :class:`~refcheck.errors.GoldenError` naming
the entry. :func:`policy_problem` is the shape check alone, which the manifest loader applies to every
entry (:mod:`refcheck.goldens.manifest`). :meth:`GatePolicy.apply` turns a diff report
into the gate's: unsupported or skipped checks outside the allowance fail ("the gate is strict about
skips"), reviewed findings become TRIAGED, an expected failure is marked. The entry's file format is
the manifest's (:mod:`refcheck.goldens.manifest`); ``golden add`` parses its command-line forms here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refcheck.diff.findings import Finding, Report, Verdict, check_category
from refcheck.errors import GoldenError, UsageError

POLICY_KEYS = ("expect", "expect_first", "allow_unsupported", "triaged")
_TRIAGED_KEYS = ("request_id", "step", "node", "category")
_FIRST_KEYS = ("request_id", "step", "node", "layer")


def _int(value: object, optional: bool) -> bool:
    return (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _place(value: object, keys: tuple[str, ...], required: tuple[str, ...]) -> bool:
    """A finding's place: an object of ``keys`` (``required`` present) whose request id is text, step an
    integer, node / layer integers or null, and category text."""
    if not isinstance(value, dict) or set(value) - set(keys) or set(required) - set(value):
        return False
    return (isinstance(value.get("request_id", ""), str) and _int(value.get("step", 0), False)
            and all(_int(value.get(k), True) for k in ("node", "layer")) and isinstance(value.get("category", ""), str))


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def policy_problem(settings: dict[str, Any], partial: bool = False) -> str | None:
    """What in a manifest entry's policy keys has the wrong shape, in words naming the key (``triaged[0] is
    1, expected ...``); None when every key present has its shape. A manifest's triaged findings name all
    of request_id, step, node and category; ``partial`` (a policy built in code) needs only the category."""
    expect = settings.get("expect", "pass")
    if not isinstance(expect, str) or not (expect in ("pass", "fail") or expect.startswith("fail:")):
        return f"expect is {_brief(expect)}, expected 'pass', 'fail' or 'fail:CATEGORY'"
    allow = settings.get("allow_unsupported", [])
    if not isinstance(allow, list) or not all(isinstance(c, str) for c in allow):
        return f"allow_unsupported is {_brief(allow)}, expected a list of category names"
    triaged = settings.get("triaged", [])
    if not isinstance(triaged, list):
        return f"triaged is {_brief(triaged)}, expected a list of {{request_id, step, node, category}}"
    for i, t in enumerate(triaged):
        if not _place(t, _TRIAGED_KEYS, ("category",) if partial else _TRIAGED_KEYS):
            return f"triaged[{i}] is {_brief(t)}, expected {{request_id, step, node, category}} (node null for none)"
    first = settings.get("expect_first")
    if first is not None and not _place(first, _FIRST_KEYS, ("request_id", "step")):
        return f"expect_first is {_brief(first)}, expected null or {{request_id, step, node, layer}} (node, layer null for any)"
    return None


def refuse_triage_rules(name: str, settings: dict[str, Any]) -> None:
    """Per-golden triage rules are gone: every engine trace is judged by its dtype's calibrated verdict
    (refcheck/diff/tolerance.py); an entry that still names rules is refused, never half-applied."""
    if settings.get("triage_rules"):
        raise GoldenError(f"golden {name!r} names triage rules {settings['triage_rules']} in the manifest: per-golden "
                          "rules were replaced by the calibrated verdict, which every diff applies; remove "
                          "'triage_rules' from the entry (reviewed findings stay in 'triaged')")


@dataclass(frozen=True, slots=True)
class GatePolicy:
    expect: str = "pass"
    expect_first: dict[str, Any] | None = None  # {request_id, step, node, layer}; node / layer None = any
    allow_unsupported: frozenset[str] = frozenset()
    triaged: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # {request_id, step, node, category}

    @classmethod
    def of(cls, name: str, settings: dict[str, Any]) -> GatePolicy:
        """The policy in a manifest entry's settings; GoldenError naming the entry if it cannot be honoured."""
        refuse_triage_rules(name, settings)
        problem = policy_problem(settings, partial=True)
        if problem:
            raise GoldenError(f"golden {name}: manifest {problem}")
        expect = settings.get("expect", "pass")
        named = [("expect", expect.split(":", 1)[1])] if expect.startswith("fail:") else []
        named += [("allow_unsupported", c) for c in settings.get("allow_unsupported", [])]
        named += [("triaged", t.get("category")) for t in settings.get("triaged", [])]
        for where, cat in named:
            try:
                check_category(cat, f"golden {name}: manifest {where}")
            except UsageError as exc:
                raise GoldenError(str(exc)) from None
        return cls(expect, settings.get("expect_first"), frozenset(settings.get("allow_unsupported", [])),
                   tuple(settings.get("triaged", [])))

    def apply(self, report: Report) -> Report:
        """The gate's report from the diff's (in place; returned for chaining), with the rules that changed
        a verdict listed in words in ``report.stats["manifest_rules"]``."""
        let_through: dict[str, int] = {}
        for f in list(report.findings):
            if f.verdict in (Verdict.UNSUPPORTED, Verdict.SKIPPED):
                if f.category in self.allow_unsupported:
                    let_through[f.category] = let_through.get(f.category, 0) + 1
                else:
                    report.add(Finding(Verdict.FAIL, f.category, f.request_id, f.step,
                                       message=f"gate is strict about skips: {f.verdict.value} {f.category} ({f.message})"))
        triaged = apply_triage(report, list(self.triaged))
        if self.expect != "pass":
            report.expect_failure = self.expect
            report.expect_first = self.expect_first
        report.stats["manifest_rules"] = self.rules_applied(let_through, triaged)
        return report

    def rules_applied(self, let_through: dict[str, int], triaged: list[Finding]) -> list[str]:
        """The rules that changed a verdict, in words: unrecorded categories allowed (with how many checks),
        reviewed failures triaged (where), and an expected failure."""
        rules = [f"allow_unsupported {cat}: {n} {cat} check(s) the engine did not record are allowed (without this "
                 "entry the gate fails them)" for cat, n in sorted(let_through.items())]
        if triaged:
            rules.append(f"triaged: {len(triaged)} reviewed failure(s) reported as triaged, not failed: " + ", ".join(
                f"{f.request_id} step {f.step}" + ("" if f.node is None else f" node {f.node}") + f" {f.category}"
                for f in triaged))
        if self.expect != "pass":
            rules.append(describe_expect(self.expect, self.expect_first))
        return rules


def describe_expect(expect: str, first: dict[str, Any] | None) -> str:
    """``expect fail:logits, first at code-1 step 0 node 6 layer 3: ...`` in words."""
    text = f"expect {expect}: a known-buggy engine's trace; the case passes only when refcheck finds " + (
        f"a {expect.split(':', 1)[1]} failure" if ":" in expect else "a failure")
    if first:
        at = f"{first['request_id']} step {first['step']}" + ("" if first.get("node") is None else f" node {first['node']}") + (
            "" if first.get("layer") is None else f" layer {first['layer']}")
        text += f", first at {at}"
    return text


def parse_triage(keys: list[str]) -> list[dict[str, Any]]:
    """'REQUEST:STEP:NODE:CATEGORY' (NODE '-' for a step-level finding) -> manifest entries."""
    out = []
    for key in keys:
        parts = key.rsplit(":", 3)
        try:
            rid, step, node, cat = parts
            out.append({"request_id": rid, "step": int(step), "node": None if node == "-" else int(node), "category": cat})
        except ValueError:
            raise UsageError(f"--triage {key!r}: expected REQUEST:STEP:NODE:CATEGORY (NODE '-' for none)") from None
        check_category(cat, f"--triage {key!r}")
    return out


def triage_key(f: Finding) -> tuple[str | None, int | None, int | None, str]:
    return (f.request_id, f.step, f.node, f.category)


def apply_triage(report: Report, triaged: list[dict[str, Any]]) -> list[Finding]:
    """Failures listed in the manifest become TRIAGED (marked ``details["triaged_by"] = "manifest"``);
    any other failure still fails the case. Returns the findings it changed."""
    keys = {(t["request_id"], t["step"], t["node"], t["category"]) for t in triaged}
    changed = []
    for f in report.findings:
        if f.verdict == Verdict.FAIL and triage_key(f) in keys:
            f.verdict = Verdict.TRIAGED
            f.details["triaged_by"] = "manifest"
            changed.append(f)
    steps = report.stats.get("steps")
    if steps and changed:  # replayed steps that failed and whose every failure is now triaged
        failing = {(f.request_id, f.step) for f in report.failures if f.step is not None}
        moved = {(f.request_id, f.step) for f in changed if f.step is not None} - failing
        steps["fail"] = steps.get("fail", 0) - len(moved)
        steps["triaged"] = steps.get("triaged", 0) + len(moved)
    return changed


def parse_expect_first(key: str | None) -> dict[str, Any] | None:
    """'REQUEST:STEP:NODE:LAYER' (NODE / LAYER '-' for any) -> the manifest's ``expect_first``."""
    if not key:
        return None
    try:
        rid, step, node, layer = key.rsplit(":", 3)
        return {"request_id": rid, "step": int(step), "node": None if node == "-" else int(node),
                "layer": None if layer == "-" else int(layer)}
    except ValueError:
        raise UsageError(f"--expect-first {key!r}: expected REQUEST:STEP:NODE:LAYER (NODE, LAYER '-' for any)") from None
