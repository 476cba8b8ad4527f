"""The layers, read from the source (every import statement, module level or inside a function):

* ``ddtree_reference/`` never imports ``refcheck``: the reference stands on its own;
* the trace format (``refcheck.trace``), the diff (``refcheck.diff``) and the HTML report (``refcheck.report``)
  never import an engine runner
  (``refcheck.runners``, ``refcheck.engines``, ``refcheck.sglang``): a diff judges a trace, whatever
  recorded it; the trace format does not import the diff either;
* the diff judges with the reference pool it is handed: no module of ``refcheck.diff`` imports the pool
  (``refcheck.pool``) or the reference runner (``refcheck.reference_runner``) at run time (a type-only import
  under ``if TYPE_CHECKING:`` may name them); the pool imports of the diff only :data:`POOL_DIFF` (the reading of a
  request's sampling columns, which the reference's spec is built from);
* the goldens (``refcheck.goldens``: cases, manifest, store, gate) stand on the trace format, the diff and
  the reference, never on an engine runner or the CLI; the trace format and the diff never import the
  goldens (a golden directory is one use of traces, not part of their format or their judgement);
* the SGLang package (``refcheck.sglang``) by its parts: the shared modules (:data:`SGLANG_SHARED`: layouts, the
  drafter's side, the environment names, vocabulary-wide reductions in row chunks) import no other part but each
  other; the capture (``refcheck.sglang.capture``, loaded
  inside SGLang's own processes) and refcheck's DDTree algorithm (``refcheck.sglang.ddtree``) import the shared
  modules and never each other, the plugin entry point, or the parts that drive SGLang from outside
  (:data:`SGLANG_OUTSIDE`); only the plugin (``refcheck.sglang.plugin``) imports both, and nothing imports it
  (SGLang loads it by its entry point); the runner, its engine process and its settings never import the matrix,
  the sweep or the capture-effect judgement built on them. The package imports no CLI, no goldens, no other
  runner, and of the diff only :data:`SGLANG_DIFF` (the capture: only ``diff.explain``, for the GDN replay);
* no import cycles, lazy imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SIDE = ("refcheck.runners", "refcheck.engines", "refcheck.sglang")
SGLANG_SHARED = ("refcheck.sglang.env", "refcheck.sglang.layout", "refcheck.sglang.draft_side",
                 "refcheck.sglang.vocab_rows")
SGLANG_INSIDE = ("refcheck.sglang.capture", "refcheck.sglang.ddtree")
SGLANG_OUTSIDE = ("refcheck.sglang.runner", "refcheck.sglang.engine_process", "refcheck.sglang.pair", "refcheck.sglang.requests", "refcheck.sglang.child",
                  "refcheck.sglang.settings", "refcheck.sglang.matrix",
                  "refcheck.sglang.sweep", "refcheck.sglang.capture_effect")
SGLANG_ON_THE_RUNNER = ("refcheck.sglang.matrix", "refcheck.sglang.sweep", "refcheck.sglang.capture_effect")
#: the diff's modules the SGLang package stands on (the matrix and the sweep judge cells; the GDN replay reads state)
SGLANG_DIFF = ("refcheck.diff.explain", "refcheck.diff.judge", "refcheck.diff.place", "refcheck.diff.tolerance")
#: what loads and runs the reference for others, which the diff only receives
REFERENCE_SIDE = ("refcheck.pool", "refcheck.reference_runner")
#: the diff's modules the reference pool stands on (a request's sampling columns, read for the reference's spec)
POOL_DIFF = ("refcheck.diff.sampling",)


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("refcheck", "ddtree_reference"):
        for p in (ROOT / top).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _named(nodes: list[ast.AST]) -> set[str]:
    """The project modules the import statements among ``nodes`` name (``from a import b`` names a and, if a
    module, a.b)."""
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES}


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` names in an import, type-only imports included."""
    return _named(list(ast.walk(ast.parse(path.read_text()))))


def _type_checking(node: ast.AST) -> bool:
    """``node`` is an ``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``) block."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_imports(path: Path) -> set[str]:
    """The project modules ``path`` imports when it runs: every import statement, lazy ones included, except
    those in the body of an ``if TYPE_CHECKING:`` block (its ``else`` runs)."""
    nodes: list[ast.AST] = []
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if _type_checking(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return _named(nodes)


GRAPH = {name: _imports(path) for name, path in MODULES.items()}
RUNTIME = {name: _runtime_imports(path) for name, path in MODULES.items()}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_reference_never_imports_refcheck():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["ddtree_reference"]) for e in es if _under(e, ["refcheck"]))
    assert not bad, bad


def test_trace_format_and_diff_import_no_engine_runner():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.trace", "refcheck.diff", "refcheck.report"])
                 for e in es if _under(e, ENGINE_SIDE))
    assert not bad, bad


def test_the_trace_format_does_not_import_the_diff():
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, ["refcheck.trace"]) for e in es
                 if _under(e, ["refcheck.diff"]))
    assert not bad, bad


def test_the_diff_imports_no_reference_side_at_run_time():
    bad = sorted((m, e) for m, es in RUNTIME.items() if _under(m, ["refcheck.diff"]) for e in es
                 if _under(e, REFERENCE_SIDE))
    assert not bad, bad


def test_the_pool_imports_of_the_diff_only_what_reads_sampling_columns():
    diff = {e for _, e in _edges(["refcheck.pool"], ["refcheck.diff"])}
    assert diff <= set(POOL_DIFF), diff - set(POOL_DIFF)


def test_the_reference_pool_layer_is_checked():
    """The modules the two checks above name exist, the judge names the pool for its types only (the
    run-time graph leaves that out, the full graph keeps it: a broken reading of ``TYPE_CHECKING`` would make the
    check vacuous or refuse too much), and no module of the diff holds the pool's work (``refcheck.diff.session``
    does not exist)."""
    assert {"refcheck.pool", "refcheck.reference_runner", "refcheck.diff.judge"} <= set(MODULES)
    assert "refcheck.pool" in GRAPH["refcheck.diff.judge"] and "refcheck.pool" not in RUNTIME["refcheck.diff.judge"]
    assert "refcheck.reference_runner" in RUNTIME["refcheck.pool"]
    assert "refcheck.diff.session" not in MODULES


def test_the_runtime_reading_skips_only_type_checking_blocks(tmp_path: Path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n    import refcheck.pool\n"
                   "else:\n    import refcheck.spec\nif typing.TYPE_CHECKING:\n    import refcheck.errors\n"
                   "def f():\n    import refcheck.reference_runner\n")
    assert _runtime_imports(src) == {"refcheck.spec", "refcheck.reference_runner"}
    assert _imports(src) == {"refcheck.pool", "refcheck.spec", "refcheck.errors", "refcheck.reference_runner"}


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


def _edges(importers, imported) -> list[tuple[str, str]]:
    return sorted((m, e) for m, es in GRAPH.items() if _under(m, importers) for e in es if _under(e, imported))


def test_the_sglang_shared_modules_import_no_other_part():
    assert not [(m, e) for m, e in _edges(SGLANG_SHARED, ["refcheck.sglang"]) if not _under(e, SGLANG_SHARED)]


def test_the_capture_and_the_algorithm_never_import_each_other():
    assert not _edges(["refcheck.sglang.capture"], ["refcheck.sglang.ddtree"])
    assert not _edges(["refcheck.sglang.ddtree"], ["refcheck.sglang.capture"])


def test_code_inside_sglang_imports_no_plugin_and_nothing_that_drives_sglang():
    bad = _edges(SGLANG_INSIDE, [*SGLANG_OUTSIDE, "refcheck.sglang.plugin", "refcheck.runners", "refcheck.engines"])
    assert not bad, bad


def test_only_sglang_loads_the_plugin():
    assert not _edges(["refcheck", "ddtree_reference"], ["refcheck.sglang.plugin"])


def test_the_runner_does_not_import_what_stands_on_it():
    bad = _edges(["refcheck.sglang.runner", "refcheck.sglang.child", "refcheck.sglang.settings"], SGLANG_ON_THE_RUNNER)
    assert not bad, bad


def test_the_sglang_package_imports_no_cli_no_goldens_and_only_the_diff_s_public_modules():
    bad = _edges(["refcheck.sglang"], ["refcheck.cli", "refcheck.goldens", "refcheck.runners", "refcheck.engines"])
    assert not bad, bad
    diff = {e for _, e in _edges(["refcheck.sglang"], ["refcheck.diff"])}
    assert diff <= set(SGLANG_DIFF), diff - set(SGLANG_DIFF)
    assert {e for _, e in _edges(SGLANG_INSIDE, ["refcheck.diff"])} <= {"refcheck.diff.explain"}


def test_the_sglang_layers_are_checked():
    """The modules the checks above name exist and import what the layering says (a rename would make them
    vacuous), and the old homes of the SGLang code are gone (no shims)."""
    for name in (*SGLANG_SHARED, *SGLANG_OUTSIDE, "refcheck.sglang.plugin", "refcheck.sglang.capture.hooks",
                 "refcheck.sglang.ddtree.worker"):
        assert name in MODULES, name
    assert {"refcheck.sglang.capture.hooks", "refcheck.sglang.ddtree.algorithm"} <= GRAPH["refcheck.sglang.plugin"]
    for part in SGLANG_INSIDE:
        assert "refcheck.sglang.layout" in {e for _, e in _edges([part], SGLANG_SHARED)}, part
    old = [m for m in MODULES if _under(m, ["refcheck.sglang_capture", "refcheck.sglang_ddtree", "refcheck.matrix",
                                            "refcheck.sweep_sglang", "refcheck.capture_effect"])
           or m.startswith("refcheck.runners.sglang")]
    assert not old, old


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
