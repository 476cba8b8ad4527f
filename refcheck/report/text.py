"""Text on the page: escaping, numbers, and a finding's details in one line.

Contract: :func:`esc` escapes any text for HTML (attributes included); :func:`num` prints a number
in 4 significant digits (integers as they are, None as ``-``); :func:`details_line` writes a
finding's details as ``key value`` pairs (deviation, spread, margin, tokens, ...), lists shortened
to their first :data:`LIST_SHOWN` items and per-layer series left to the layer chart.
"""

from __future__ import annotations

import html
from typing import Any

LIST_SHOWN = 5
#: details keys drawn elsewhere (the per-layer chart), not repeated as text
CHARTED = ("per_layer_rel_l2",)


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(num(v) for v in value[:LIST_SHOWN])
        return f"[{shown}{', …' if len(value) > LIST_SHOWN else ''}]"
    return str(value)


def details_line(details: dict[str, Any]) -> str:
    """``details`` as ``key value · key value`` (plain text: escape it where it goes)."""
    return " · ".join(f"{k} {num(v)}" for k, v in details.items() if k not in CHARTED)


def finding_line(f: Any) -> str:
    """A finding in one plain line: verdict, category, where, message, details."""
    where = [f"step {f.step}" if f.step is not None else "", f"node {f.node}" if f.node is not None else "",
             f"layer {f.layer}" if f.layer is not None else ""]
    place = ", ".join(w for w in where if w)
    details = details_line(f.details)
    return (f"{f.verdict.value} {f.category}" + (f" ({place})" if place else "") + f": {f.message}"
            + (f" [{details}]" if details else ""))
