"""The page's inline stylesheet and script: nothing is fetched, everything the page needs is here.

Contract: :data:`CSS` colours every verdict class of :mod:`.verdicts` (cells, tree nodes, badges,
table rows) the same way: pass green, benign tie yellow, triaged orange, fail red, unsupported and
skipped grey; an accepted tree node has a thick blue outline and its edges are blue. :data:`SCRIPT`
only filters a findings list by verdict (the rows of the ``table.findings`` in the select's own
section, so each case of a page of several has its own filter); the page reads the same without it.
"""

from __future__ import annotations

COLOURS = {"pass": "#2da44e", "benign_tie": "#e3c341", "triaged": "#e8853d", "fail": "#cf222e",
           "unsupported": "#8c959f", "skipped": "#c9d1d9"}


def _verdict_rules() -> str:
    rules = []
    for verdict, colour in COLOURS.items():
        rules.append(f".cell.{verdict},.badge.{verdict},.dot.{verdict}{{background:{colour}}}")
        rules.append(f".node.{verdict} rect{{fill:{colour}}}")
        rules.append(f"tr.{verdict} td.v{{color:{colour};font-weight:600}}")
    return "\n".join(rules)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
main{max-width:1360px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de}
h3{font-size:15px;margin:18px 0 6px}
section.card,div.step{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px 14px;margin:10px 0}
table{border-collapse:collapse}td,th{padding:2px 10px 2px 0;text-align:left;vertical-align:top}
th{color:#57606a;font-weight:600}
.badge{color:#fff;border-radius:12px;padding:2px 10px;font-weight:600;display:inline-block}
.badge.benign_tie,.badge.skipped{color:#1f2328}
.dot{display:inline-block;width:10px;height:10px;border-radius:5px;margin-right:4px}
.counts td{font-variant-numeric:tabular-nums;padding-right:18px}
.strip{display:flex;flex-wrap:wrap;gap:2px;margin:4px 0 10px}
.cell{display:inline-block;width:24px;height:24px;line-height:24px;text-align:center;color:#fff;
font-size:12px;font-weight:600;border-radius:3px;text-decoration:none}
.cell.benign_tie,.cell.skipped{color:#1f2328}.cell:hover{outline:2px solid #0969da}
.mono,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.tree{overflow-x:auto}.tree svg{display:block}
.node rect{stroke:#57606a;stroke-width:1}.node.accepted rect{stroke:#0969da;stroke-width:3.5}
.node text{font:11px ui-monospace,Menlo,Consolas,monospace;fill:#1f2328;pointer-events:none}
.node.fail text,.node.unsupported text{fill:#fff}
.edge{stroke:#8c959f;stroke-width:1.2;fill:none}.edge.acc{stroke:#0969da;stroke-width:3}
.bars rect.bar{fill:#8c959f}.bars rect.bar.over{fill:#e8853d}.bars rect.bar.first{fill:#cf222e}
.bars line.tol{stroke:#0969da;stroke-dasharray:4 3}.bars text{font:10px system-ui,sans-serif;fill:#57606a}
.brief{color:#57606a;margin:2px 0}.brief a{color:inherit}
.note{color:#57606a;font-style:italic}
.findings td{border-top:1px solid #eaeef2;padding:3px 10px 3px 0}.findings td.msg{max-width:760px}
a{color:#0969da}
.legend span{margin-right:14px}#requests td:first-child,#requests th{white-space:nowrap}
section.case{border-top:4px solid #8c959f;margin-top:36px;padding-top:4px}
.casenav{color:#57606a;font-weight:600;margin:4px 0}
.cases td{border-top:1px solid #eaeef2;padding:3px 14px 3px 0;font-variant-numeric:tabular-nums}
.cases td:first-child{white-space:nowrap}
"""

SCRIPT = """
function filterFindings(sel){
  var v = sel.value;
  sel.closest('section').querySelectorAll('table.findings tbody tr').forEach(function(r){
    r.style.display = (v === '' || r.classList.contains(v)) ? '' : 'none';
  });
}
"""


def stylesheet() -> str:
    return CSS + _verdict_rules()
