"""The per-request step strip: one cell per verify step, coloured by that step's worst verdict.

Contract: :func:`step_strip` gives a request's cells in step order, each an ``<a class="cell
VERDICT">`` linking to the step's detail (``#q<i>-s<step>``, :mod:`.anchors`), showing the step's τ
(accepted length, bonus counted), with a tooltip naming the step, its τ, its verdict and its
findings by category.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from refcheck.report.text import esc
from refcheck.report.verdicts import LABELS, FindingIndex, worst

if TYPE_CHECKING:
    from refcheck.report.anchors import Anchors
    from refcheck.trace.rows import StepRow


def _tooltip(s: StepRow, verdict: str, index: FindingIndex) -> str:
    found = Counter(f"{f.verdict.value} {f.category}" for f in index.step(s.request_id, s.step))
    what = ", ".join(f"{k} ×{n}" for k, n in sorted(found.items())) or "every check passes"
    return f"step {s.step} · τ {s.accept_length} · {LABELS[verdict]}: {what}"


def step_strip(steps: list[StepRow], index: FindingIndex, anchors: Anchors) -> str:
    """The strip of one request's ``steps`` (in step order)."""
    cells = []
    for s in steps:
        verdict = worst(index.step(s.request_id, s.step))
        target = anchors.step(s.request_id, s.step)
        cells.append(f'<a class="cell {verdict}" href="#{esc(target)}" data-step="{s.step}" '
                     f'title="{esc(_tooltip(s, verdict, index))}">{s.accept_length}</a>')
    return f'<div class="strip">{"".join(cells)}</div>'
