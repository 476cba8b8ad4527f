"""scripts/sglang_bundle.sh fits: whether the working tree and the bundle's parts fit one device call's transfer,
counted as the device tool counts them (tracked and untracked-not-ignored files, .bundle/), before the call is made."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sglang_bundle.sh"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_fits_counts_the_tree_and_the_bundle_and_fails_past_the_limit(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "sglang_bundle.sh")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "tracked.bin").write_bytes(b"x" * 40_000)
    (tmp_path / "ignored.bin").write_bytes(b"x" * 400_000)
    (tmp_path / ".gitignore").write_text("ignored.bin\n/.bundle/\n")
    (tmp_path / ".bundle").mkdir()
    (tmp_path / ".bundle" / "part_00").write_bytes(b"x" * 100_000)
    subprocess.run(["git", "add", "tracked.bin", ".gitignore", "scripts"], cwd=tmp_path, check=True)

    def fits(limit: int) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/sglang_bundle.sh", "fits", str(limit)], cwd=tmp_path,
                              capture_output=True, text=True)

    ok = fits(100_000)
    assert ok.returncode == 0, ok.stderr
    tree = int(ok.stdout.split("tree ")[1].split(" KiB")[0])
    bundle = int(ok.stdout.split(".bundle ")[1].split(" KiB")[0])
    assert 40 <= tree < 400 and 98 <= bundle < 200  # the ignored file is not counted, the bundle is
    assert fits(tree + bundle).returncode == 0 and fits(tree + bundle - 1).returncode == 1
