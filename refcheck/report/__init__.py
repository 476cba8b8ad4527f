"""The self-contained HTML report of diffed traces (``refcheck report``; ``refcheck gate|diff --html``).

Contract: :func:`render_page` turns a :class:`~refcheck.diff.findings.Report` and the
:class:`~refcheck.trace.rows.Trace` it judged into one HTML document that loads nothing from the
network (inline CSS, SVG and a little JS), so it reads offline and attaches to a CI run as it is.
The page's parts are one module each: :mod:`.summary` (verdict, counts, τ, provenance, first
divergences), :mod:`.strip` (a cell per verify step), :mod:`.step_detail` with :mod:`.tree_svg`
and :mod:`.layer_chart` (a step's tree and a failing node's layers), :mod:`.findings_list` (the
findings, capped), assembled by :mod:`.page`; :func:`render_cases` (:mod:`.cases`) puts several diffed
cases on one page (``refcheck gate --html``, ``refcheck diff --html``): an index, then each case as
:func:`render_page` shows it. Names read from the trace are escaped everywhere.
"""

from __future__ import annotations

from refcheck.report.cases import Case, render_cases
from refcheck.report.page import render_page
from refcheck.report.tokens import TokenText

__all__ = ["Case", "TokenText", "render_cases", "render_page"]
