"""A finding's place in words, never ``None``: what every report line, error message and table uses.

Contract: :func:`where` takes a :class:`refcheck.diff.findings.Finding` or its JSON dict and returns
``code-1 step 13 node 32 · logits · layer 0 (linear_attention)``; a step-level finding leaves the node
out, the prefill reads ``prefill``, and a request-level finding reads ``code-1 (whole request, output
token 35) · ar_tokens`` (the output index when the finding names one, else its absolute position).
:func:`earliest` picks the first of several findings by step (a table's "first finding").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _get(f: Any, key: str) -> Any:
    return f.get(key) if isinstance(f, dict) else getattr(f, key)


def earliest(findings: Iterable[Any]) -> Any | None:
    """The finding at the earliest step (request-level ones last), Finding or JSON dict alike; None for none."""
    return min(findings, key=lambda f: (_get(f, "step") if _get(f, "step") is not None else 1 << 30), default=None)


def request_place(f: Any) -> str:
    """A request-level finding's place: the output token it names, or the absolute position."""
    details, pos = _get(f, "details") or {}, _get(f, "position")
    if "index" in details:
        return f"whole request, output token {details['index']}"
    return "whole request" + (f", position {pos}" if pos is not None else "")


def where(f: Any) -> str:
    """Request, prefill or step, node, category and bisected layer of ``f``, with nothing unknown printed."""
    rid, step, node, layer = _get(f, "request_id"), _get(f, "step"), _get(f, "node"), _get(f, "layer")
    parts = [str(rid)]
    if step is None:
        parts.append(f"({request_place(f)})")
    else:
        parts.append("prefill" if step < 0 else f"step {step}")
        if node is not None:
            parts.append(f"node {node}")
    text = " ".join(parts) + f" · {_get(f, 'category')}"
    if layer is not None:
        ltype = _get(f, "layer_type")
        text += f" · layer {layer}" + (f" ({ltype})" if ltype else "")
    return text
