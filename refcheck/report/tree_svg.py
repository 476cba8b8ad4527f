"""One verify step's draft tree as inline SVG.

Contract: :func:`tree_svg` draws the step's nodes left to right by depth (the root, the last
committed token, at the left; siblings stacked; a node's first child on its row, so chains are
straight lines). Each node is a ``<g class="node VERDICT [accepted]" id=...>`` (:mod:`.anchors`)
whose colour is its worst finding (:func:`.verdicts.worst`), holding its index, token id, the
token's text when a tokenizer is known, and a ``<title>`` tooltip: the node's token, depth, target
argmax (its draw and uniform at T > 0), and every finding at it with the numbers in its details (deviation, spread, margin, ...).
The engine's accepted path has blue edges and outlines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refcheck.report.text import esc, finding_line
from refcheck.report.verdicts import worst

if TYPE_CHECKING:
    from refcheck.diff.findings import Finding
    from refcheck.report.tokens import TokenText
    from refcheck.trace.rows import StepRow

DX, DY, W, H, PAD = 116, 44, 96, 34, 8


def layout(parents: list[int]) -> dict[int, int]:
    """node -> row: a leaf takes the next free row, a parent its first child's row."""
    children: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    rows: dict[int, int] = {}
    next_row = 0
    stack: list[tuple[int, bool]] = [(0, False)] if parents else []
    while stack:
        node, done = stack.pop()
        if done:
            rows[node] = rows[children[node][0]]
            continue
        if not children[node]:
            rows[node] = next_row
            next_row += 1
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return rows


def _tooltip(s: StepRow, i: int, accepted: bool, found: list[Finding], text: str | None) -> str:
    lines = [f"node {i} · token {s.tree_tokens[i]}" + (f" {text!r}" if text is not None else "")
             + f" · depth {s.tree_depths[i]} · parent {s.tree_parents[i]}",
             f"target argmax {s.target_argmax[i]}" + (" · on the accepted path" if accepted else "")]
    if i < len(s.node_draws):
        uniform = f" (uniform {s.node_uniforms[i]:.4g})" if i < len(s.node_uniforms) else ""
        lines.append(f"engine's draw {s.node_draws[i]}{uniform}")
    lines += [finding_line(f) for f in found] or ["all checks at this node pass"]
    return "\n".join(lines)


def _node(s: StepRow, i: int, row: int, found: list[Finding], accepted: bool, node_id: str | None,
          tokens: TokenText | None) -> str:
    x, y = PAD + s.tree_depths[i] * DX, PAD + row * DY
    text = tokens.text(s.tree_tokens[i]) if tokens is not None else None
    cls = "node " + worst(found) + (" accepted" if accepted else "")
    ident = f' id="{esc(node_id)}"' if node_id else ""
    label = f"#{i} · {s.tree_tokens[i]}"
    second = f'<text x="{x + 6}" y="{y + 27}">{esc(text)}</text>' if text is not None else ""
    return (f'<g class="{cls}"{ident} data-node="{i}"><title>{esc(_tooltip(s, i, accepted, found, text))}</title>'
            f'<rect x="{x}" y="{y}" width="{W}" height="{H}" rx="4"/>'
            f'<text x="{x + 6}" y="{y + 13}">{esc(label)}</text>{second}</g>')


def tree_svg(s: StepRow, node_findings: dict[int, list[Finding]], node_id: dict[int, str | None],
             tokens: TokenText | None) -> str:
    """The step's tree; ``node_findings`` and ``node_id`` by node index."""
    rows = layout(s.tree_parents)
    on_path = set(s.accepted)
    edges = []
    for i, p in enumerate(s.tree_parents):
        if p < 0:
            continue
        x1, y1 = PAD + s.tree_depths[p] * DX + W, PAD + rows[p] * DY + H / 2
        x2, y2 = PAD + s.tree_depths[i] * DX, PAD + rows[i] * DY + H / 2
        cls = "edge acc" if i in on_path and p in on_path else "edge"
        edges.append(f'<path class="{cls}" d="M{x1} {y1} C{x1 + 10} {y1} {x2 - 10} {y2} {x2} {y2}"/>')
    nodes = [_node(s, i, rows[i], node_findings.get(i, []), i in on_path, node_id.get(i), tokens)
             for i in range(len(s.tree_tokens))]
    width = PAD * 2 + (max(s.tree_depths, default=0)) * DX + W
    height = PAD * 2 + (max(rows.values(), default=0) + 1) * DY - (DY - H)
    return (f'<svg class="treesvg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img">' + "".join(edges) + "".join(nodes) + "</svg>")
