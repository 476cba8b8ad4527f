"""docs/architecture.md cannot go stale: every path it names exists, and every package of refcheck/ is in it.

Paths are the words of the page that start with ``refcheck/``, ``ddtree_reference/``, ``scripts/``, ``tests/``,
``docs/`` or ``golden/`` (trailing punctuation and a ``: name`` suffix dropped); a package is a directory under
``refcheck/`` with an ``__init__.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"(?<![\w/.])((?:refcheck|reference|scripts|tests|docs|golden)/[\w./-]*)")


def named_paths() -> set[str]:
    return {m.group(1).rstrip(".,:;)") for m in PATH.finditer(PAGE.read_text())}


def test_every_path_the_architecture_page_names_exists():
    missing = sorted(p for p in named_paths() if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_package_of_refcheck_is_on_the_architecture_page():
    text = PAGE.read_text()
    packages = sorted(str(d.relative_to(ROOT)) for d in (ROOT / "refcheck").rglob("*") if (d / "__init__.py").is_file())
    absent = [p for p in packages if f"{p}/" not in text and Path(p).name + "/" not in text]
    assert not absent, f"packages missing from docs/architecture.md: {absent}"
