"""The wheel carries every data file the package reads.

A data file missing from ``[tool.setuptools.package-data]`` is missing from an installed refcheck: a
built-in model's tokenizer left out changed the model directory's hash, so every built-in golden read
as stale. Checked from the declared patterns (no wheel build: setuptools' rule is that a package's
data files are its own directory's files matching the patterns given for that package).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _package_data() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def _owning_package(path: Path) -> tuple[str, str]:
    """(dotted package, path relative to it) of the innermost package directory holding ``path``."""
    d = path.parent
    while not (d / "__init__.py").is_file():
        d = d.parent
    return ".".join(d.relative_to(ROOT).parts), path.relative_to(d).as_posix()


def _data_files() -> list[Path]:
    return sorted(p for top in ("refcheck", "reference") for p in (ROOT / top).rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)


def test_every_data_file_is_packaged() -> None:
    data = _package_data()
    missing = []
    for p in _data_files():
        pkg, rel = _owning_package(p)
        if not any(fnmatch.fnmatchcase(rel, pat) and rel.count("/") == pat.count("/") for pat in data.get(pkg, [])):
            missing.append(f"{p.relative_to(ROOT)} (package {pkg}, as {rel})")
    assert not missing, "not in the wheel: " + "; ".join(missing)


def test_every_pattern_matches_a_file() -> None:
    """A stale pattern (a file moved or renamed) is how the tokenizer went missing: each must match."""
    files = [_owning_package(p) for p in _data_files()]
    stale = [f"{pkg}: {pat}" for pkg, pats in _package_data().items() for pat in pats
             if not any(q == pkg and fnmatch.fnmatchcase(rel, pat) and rel.count("/") == pat.count("/")
                        for q, rel in files)]
    assert not stale, stale
