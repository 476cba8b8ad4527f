"""List the functions in refcheck/ longer than a limit (default 60 lines): total span, and code without
the docstring. ``python scripts/long_functions.py [LIMIT]`` from the repository root."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def long_functions(root: Path, limit: int) -> list[tuple[int, int, str, str]]:
    """(span, code lines, where, name) of every function under ``root`` spanning more than ``limit`` lines."""
    rows = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            span = (node.end_lineno or node.lineno) - node.lineno + 1
            first = node.body[0] if node.body else None
            is_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                      and isinstance(first.value.value, str))
            doc = (first.end_lineno or first.lineno) - first.lineno + 1 if is_doc and first is not None else 0
            if span > limit:
                rows.append((span, span - doc, f"{p}:{node.lineno}", node.name))
    return sorted(rows, reverse=True)


if __name__ == "__main__":
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    print("span code  where name")
    for span, code, where, name in long_functions(Path("refcheck"), limit):
        print(f"{span:4d} {code:4d}  {where} {name}")
