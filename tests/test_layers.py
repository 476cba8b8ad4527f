"""The layers, read from the source (every import statement, module level or inside a function):

* ``reference/`` never imports ``refcheck``: the reference stands on its own;
* the trace format (``refcheck.trace``), the diff (``refcheck.diff``) and the HTML report (``refcheck.report``)
  never import an engine runner
  (``refcheck.runners``, ``refcheck.engines``, ``refcheck.sglang_*``): a diff judges a trace, whatever
  recorded it; the trace format does not import the diff either;
* the goldens (``refcheck.goldens``: cases, manifest, store, gate) stand on the trace format, the diff and
  the reference, never on an engine runner or the CLI; the trace format and the diff never import the
  goldens (a golden directory is one use of traces, not part of their format or their judgement);
* the SGLang capture (``refcheck.sglang_capture``, loaded inside SGLang's own processes) never imports
  a runner (``refcheck.runners``, which drives SGLang from outside);
* no import cycles, lazy imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SIDE = ("refcheck.runners", "refcheck.engines", "refcheck.sglang_capture", "refcheck.sglang_ddtree")


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("refcheck", "reference"):
        for p in (ROOT / top).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` names in an import (``from a import b`` names a and, if a module, a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_reference_never_imports_refcheck():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["reference"]) for e in es if _under(e, ["refcheck"]))
    assert not bad, bad


def test_trace_format_and_diff_import_no_engine_runner():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.trace", "refcheck.diff", "refcheck.report"])
                 for e in es if _under(e, ENGINE_SIDE))
    assert not bad, bad


def test_the_trace_format_does_not_import_the_diff():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.trace"]) for e in es
                 if _under(e, ["refcheck.diff"]))
    assert not bad, bad


def test_the_goldens_import_no_runner_and_no_cli():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.goldens"])
                 for e in es if _under(e, [*ENGINE_SIDE, "refcheck.cli"]))
    assert not bad, bad


def test_the_trace_format_and_the_diff_do_not_import_the_goldens():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.trace", "refcheck.diff"])
                 for e in es if _under(e, ["refcheck.goldens"]))
    assert not bad, bad


def test_the_goldens_layer_is_checked():
    """The package the two checks above name exists and imports the trace format and the diff (a rename
    would make them vacuous)."""
    goldens = {e for m, es in GRAPH.items() if _under(m, ["refcheck.goldens"]) for e in es}
    assert "refcheck.goldens.store" in MODULES and "refcheck.trace.io" in goldens
    assert any(_under(e, ["refcheck.diff"]) for e in goldens)


def test_the_capture_imports_no_runner():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.sglang_capture"])
                 for e in es if _under(e, ["refcheck.runners", "refcheck.engines"]))
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w == v:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
