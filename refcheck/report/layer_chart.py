"""A failing node's per-layer deviation as a small inline SVG bar chart.

Contract: :func:`layer_chart` draws one bar per layer from a layer-bisection finding's
``per_layer_rel_l2`` (the relative L2 distance between the engine's and the reference's sketch of the
node's output at every layer; :mod:`refcheck.diff.node_checks`) on a log scale, the ``tolerance`` as
a dashed line, bars over it orange and the first failing layer (the finding's ``layer``) red and
labelled; every bar has a ``<title>`` with its number. A finding without the series gives None.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from refcheck.report.text import esc, num

if TYPE_CHECKING:
    from refcheck.diff.findings import Finding

BAR, GAP, HEIGHT, LEFT, BOTTOM, TOP = 14, 3, 90, 60, 18, 14
FLOOR = 1e-9


def _scale(values: list[float], tol: float | None) -> tuple[float, float]:
    logs = [math.log10(max(v, FLOOR)) for v in values if math.isfinite(v)]
    if tol:
        logs.append(math.log10(tol))
    lo, hi = (min(logs), max(logs)) if logs else (-3.0, 0.0)
    return math.floor(lo) - 0.5, max(hi, lo + 1.0) + 0.2


def _bar_height(v: float, lo: float, hi: float) -> float:
    if not math.isfinite(v):
        return HEIGHT
    return max(1.0, (math.log10(max(v, FLOOR)) - lo) / (hi - lo) * HEIGHT)


def layer_chart(f: Finding) -> str | None:
    """The chart of ``f``'s per-layer series, or None when its details have none."""
    series: Any = f.details.get("per_layer_rel_l2")
    if not isinstance(series, list) or not series:
        return None
    values = [float(v) for v in series]
    tol = f.details.get("tolerance")
    tol = float(tol) if isinstance(tol, (int, float)) and tol > 0 else None
    lo, hi = _scale(values, tol)
    width = LEFT + len(values) * (BAR + GAP) + 8
    parts = []
    for i, v in enumerate(values):
        h = _bar_height(v, lo, hi)
        x, y = LEFT + i * (BAR + GAP), TOP + HEIGHT - h
        cls = "bar first" if i == f.layer else ("bar over" if tol is not None and v > tol else "bar")
        parts.append(f'<rect class="{cls}" x="{x}" y="{y:.1f}" width="{BAR}" height="{h:.1f}">'
                     f'<title>layer {i}: rel L2 {esc(num(v))}</title></rect>')
        if i == f.layer:
            parts.append(f'<text x="{x - 4}" y="{TOP - 3}">first failing: layer {i}</text>')
        if i % 4 == 0 or i == len(values) - 1:
            parts.append(f'<text x="{x + 2}" y="{TOP + HEIGHT + 13}">{i}</text>')
    if tol is not None:
        ty = TOP + HEIGHT - _bar_height(tol, lo, hi)
        parts.append(f'<line class="tol" x1="{LEFT - 4}" x2="{width - 4}" y1="{ty:.1f}" y2="{ty:.1f}">'
                     f'<title>tolerance {esc(num(tol))}</title></line>'
                     f'<text x="0" y="{ty + 3:.1f}">tol {esc(num(tol))}</text>')
    parts.append(f'<text x="0" y="{TOP + 8}">rel L2</text><text x="0" y="{TOP + HEIGHT}">(log)</text>')
    return (f'<svg class="bars" width="{width}" '
            f'height="{TOP + HEIGHT + BOTTOM}" role="img">' + "".join(parts) + "</svg>")
