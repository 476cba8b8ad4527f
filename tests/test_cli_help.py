"""``refcheck --help`` and every subcommand's help load no model library (torch, transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import contextlib, io, json, sys
import click
from refcheck.cli import main

def walk(cmd, path):
    yield path
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from walk(sub, path + [name])

helped = []
for path in walk(main, []):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main.main(path + ["--help"], standalone_mode=False, prog_name="refcheck")
        except SystemExit:
            pass
    assert "Usage: refcheck" in out.getvalue(), (path, out.getvalue()[:200])
    helped.append(" ".join(path))
heavy = sorted(m for m in ("torch", "transformers", "pyarrow", "numpy", "safetensors") if m in sys.modules)
print(json.dumps({"helped": helped, "heavy": heavy}))
"""


def test_every_help_is_free_of_model_libraries():
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [], f"help imported {got['heavy']}"
    # every command and group of the CLI was asked, sub-groups included
    assert {"", "diff", "gate", "golden", "golden regen", "golden add", "trace show", "explain", "run"} <= set(got["helped"])
    assert time.perf_counter() - t0 < 20  # generous on a loaded 2-core machine; it takes well under a second alone


def test_console_help_exits_zero_without_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "refcheck", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "Usage:" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "transformers" not in imported
