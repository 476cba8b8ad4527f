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


def test_the_installed_wheel_sees_the_goldens_fresh(tmp_path: Path) -> None:
    """Build the wheel, install it (no dependencies: this environment's) into a directory of its own and,
    from outside the repository, hash the built-in models as an installed refcheck does: the hashes the
    goldens were recorded with (a file missing from the wheel would make every built-in golden stale)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from refcheck.golden import REPO_GOLDEN
    from refcheck.trace.io import read_trace
    from refcheck.trace.manifest import load_manifest

    wheels, site, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    for part in ("refcheck", "reference"):  # built from a copy: setuptools' build/ and egg-info stay out of the repo
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run = dict(check=True, capture_output=True, text=True, timeout=600)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], cwd=tmp_path, **run)
    (wheel,) = wheels.glob("refcheck-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   cwd=tmp_path, **run)
    probe = ("import json, refcheck; from refcheck.models import builtin_pair; from refcheck.provenance import dir_sha256\n"
             "print(json.dumps({'where': refcheck.__file__, **{p: [dir_sha256(d) for d in builtin_pair(p)] "
             "for p in ('hybrid', 'attention')}}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    out = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, **run).stdout)
    assert out["where"].startswith(str(site))  # the installed copy, not the repository's
    recorded = {}
    for entry in load_manifest(REPO_GOLDEN).cases.values():
        prov = read_trace(REPO_GOLDEN / entry.file).prov
        if prov.model.startswith("builtin:") and prov.drafter == "dflash" and prov.draft_sha256:
            recorded[prov.model.split(":", 1)[1]] = [prov.model_sha256, prov.draft_sha256]
    assert recorded and all(out[pair] == shas for pair, shas in recorded.items()), (out, recorded)
