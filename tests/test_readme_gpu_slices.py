"""The GPU test slices (scripts/gpu_tests.sh) cover every GPU and live-SGLang test exactly once, and the
README's "GPU tests" table names every slice: what the CPU machine can check of tests it cannot run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_FILES = sorted(p.name for p in (ROOT / "tests").glob("test_gpu*.py") if p.name != "test_gpu_multi.py")

_COLLECT = r"""
import io, json, sys, contextlib
import pytest
out = {}
for name, args in json.loads(sys.argv[1]).items():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args])
    out[name] = [line for line in buf.getvalue().splitlines() if "::" in line]
print(json.dumps(out))
"""


def slices() -> dict[str, list[str]]:
    """Slice -> its pytest arguments, as ``scripts/gpu_tests.sh --list`` prints them."""
    listed = subprocess.run([str(ROOT / "scripts" / "gpu_tests.sh"), "--list"], capture_output=True, text=True,
                            check=True).stdout
    out = {}
    for line in listed.splitlines():
        name, cmd = line.split(None, 1)
        args = cmd.split("-m pytest", 1)[1].split()
        out[name] = [a for a in args if a != "-o" and a != "addopts="]
    return out


def test_every_gpu_test_is_in_exactly_one_slice_and_the_readme_names_every_slice():
    sl = slices()
    everything = {"all": [f"tests/{f}" for f in GPU_FILES]}
    got = json.loads(subprocess.run([sys.executable, "-c", _COLLECT, json.dumps({**sl, **everything})],
                                    capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    per_slice = [t for name in sl for t in got[name]]
    assert sorted(per_slice) == sorted(got["all"]), "a GPU test in no slice, or in two"
    assert len(got["all"]) > 20
    files_in_slices = {a.split("/")[-1] for args in sl.values() for a in args if a.startswith("tests/")}
    assert files_in_slices == set(GPU_FILES)
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"## GPU tests\n(.*?)(?=\n## )", readme, re.S)
    assert table, "README.md has no 'GPU tests' section"
    for name in sl:
        assert f"| `{name}` |" in table.group(1), f"README's GPU tests table lacks slice {name}"
