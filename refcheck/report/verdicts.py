"""Verdicts as the page shows them: a CSS class per verdict, the worst of several, findings by place.

Contract: :data:`ORDER` ranks the verdicts a finding can have, most severe first (fail, triaged,
benign tie, unsupported, skipped); :func:`worst` of a set of findings is the first of them present,
else ``"pass"``: a step's or a node's colour. The class names are the verdicts' values
(``fail``, ``benign_tie``, ...), which the stylesheet (:mod:`.style`) colours. :class:`FindingIndex`
groups a report's findings by step and by node once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refcheck.diff.findings import Finding

#: most severe first; a place with none of these passed
ORDER = ("fail", "triaged", "benign_tie", "unsupported", "skipped")
LABELS = {"pass": "pass", "fail": "fail", "triaged": "triaged", "benign_tie": "benign tie",
          "unsupported": "unsupported", "skipped": "skipped"}


def worst(findings: Iterable[Finding]) -> str:
    """The most severe verdict among ``findings`` (:data:`ORDER`), else ``"pass"``."""
    present = {f.verdict.value for f in findings}
    return next((v for v in ORDER if v in present), "pass")


def rank(finding: Finding) -> int:
    value = finding.verdict.value
    return ORDER.index(value) if value in ORDER else len(ORDER)


class FindingIndex:
    """A report's findings by (request, step) and by (request, step, node)."""

    def __init__(self, findings: Iterable[Finding]) -> None:
        self.by_step: dict[tuple[str | None, int], list[Finding]] = {}
        self.by_node: dict[tuple[str | None, int, int], list[Finding]] = {}
        for f in findings:
            if f.step is None or f.step < 0:
                continue
            self.by_step.setdefault((f.request_id, f.step), []).append(f)
            if f.node is not None:
                self.by_node.setdefault((f.request_id, f.step, f.node), []).append(f)

    def step(self, request_id: str, step: int) -> list[Finding]:
        return self.by_step.get((request_id, step), [])

    def node(self, request_id: str, step: int, node: int) -> list[Finding]:
        return self.by_node.get((request_id, step, node), [])
