"""A verify step's detail: its tree, its findings, and a failing node's layer chart.

Contract: every verify step has an element with its anchor id (``q<i>-s<step>``), so every strip
cell resolves. :func:`step_detail` is the full detail (heading, accepted path, bonus and emitted
tokens, the tree as SVG, the step's findings, at most :data:`NODE_FINDINGS_SHOWN` listed, and a
per-layer chart for each failing finding whose details carry per-layer numbers);
:func:`step_brief` is one line (τ, tree size, verdict) for a step whose tree is not drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refcheck.report.layer_chart import layer_chart
from refcheck.report.text import esc, finding_line
from refcheck.report.tree_svg import tree_svg
from refcheck.report.verdicts import LABELS, FindingIndex, rank, worst

if TYPE_CHECKING:
    from refcheck.report.anchors import Anchors
    from refcheck.report.tokens import TokenText
    from refcheck.trace.rows import StepRow

NODE_FINDINGS_SHOWN = 40


def _tokens(ids: list[int], tokens: TokenText | None) -> str:
    if tokens is None:
        return " ".join(str(t) for t in ids)
    return " ".join(f"{t} {tokens.text(t)!r}" for t in ids)


def _heading(s: StepRow, verdict: str) -> str:
    return (f'<h3><span class="dot {verdict}"></span>{esc(s.request_id)} · step {s.step} · position '
            f'{s.committed_len} · τ {s.accept_length} · {len(s.tree_tokens)} nodes · {LABELS[verdict]}</h3>')


def _paths(s: StepRow, tokens: TokenText | None) -> str:
    accepted = [s.tree_tokens[i] for i in s.accepted if 0 <= i < len(s.tree_tokens)]
    return (f'<p class="mono">accepted nodes {esc(s.accepted)} (tokens {esc(_tokens(accepted, tokens))}) · bonus '
            f'{esc(_tokens([s.bonus], tokens))} · emitted {esc(_tokens(list(s.emitted), tokens))}</p>')


def _finding_items(s: StepRow, index: FindingIndex) -> str:
    found = sorted(index.step(s.request_id, s.step), key=lambda f: (rank(f), f.node if f.node is not None else -1))
    if not found:
        return '<p class="note">every check of this step passes</p>'
    items = [f'<li class="{f.verdict.value}"><span class="dot {f.verdict.value}"></span>{esc(finding_line(f))}</li>'
             for f in found[:NODE_FINDINGS_SHOWN]]
    more = len(found) - NODE_FINDINGS_SHOWN
    note = f'<p class="note">… and {more} more findings at this step (the findings list has them)</p>' if more > 0 else ""
    return f'<ul class="mono">{"".join(items)}</ul>{note}'


def _charts(s: StepRow, index: FindingIndex) -> str:
    out = []
    for f in index.step(s.request_id, s.step):
        chart = layer_chart(f) if f.verdict.value == "fail" else None
        if chart is not None:
            out.append(f'<div class="chart"><p>node {f.node}: {esc(f.message)}</p>{chart}</div>')
    return "".join(out)


def step_detail(s: StepRow, index: FindingIndex, anchors: Anchors, tokens: TokenText | None) -> str:
    """The full detail of step ``s``: heading, paths, tree, findings, layer charts."""
    found = index.step(s.request_id, s.step)
    per_node = {i: index.node(s.request_id, s.step, i) for i in range(len(s.tree_tokens))}
    ids = {i: anchors.node(s.request_id, s.step, i) for i in range(len(s.tree_tokens))}
    svg = tree_svg(s, per_node, ids, tokens)
    return (f'<div class="step" id="{esc(anchors.step(s.request_id, s.step))}">{_heading(s, worst(found))}'
            f'{_paths(s, tokens)}<div class="tree">{svg}</div>{_finding_items(s, index)}{_charts(s, index)}</div>')


def step_brief(s: StepRow, index: FindingIndex, anchors: Anchors, why: str = "") -> str:
    """One line for step ``s`` (its tree not drawn; ``why`` says why when it has findings)."""
    found = index.step(s.request_id, s.step)
    verdict = worst(found)
    extra = f" · {len(found)} finding(s){why}" if found else ""
    return (f'<p class="brief" id="{esc(anchors.step(s.request_id, s.step))}"><span class="dot {verdict}"></span>'
            f'step {s.step} · position {s.committed_len} · τ {s.accept_length} · {len(s.tree_tokens)} nodes · '
            f'{LABELS[verdict]}{esc(extra)}</p>')
