"""The pytest plugin (refcheck/pytest_plugin.py), through inner pytest sessions run in this process
(``pytester``): the ``refcheck`` fixture's ``diff`` and ``assert_passes`` on real goldens, and
``--refcheck-gate DIR`` on a two-case golden directory (one expected pass, one expected failure),
intact, with a corrupt trace, a missing trace and an expectation the trace does not meet.

The inner sessions load exactly the plugins they use (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, then ``-p
refcheck.pytest_plugin`` and ``-p xdist.plugin``), whether or not this environment's refcheck install
registers the ``pytest11`` entry point. The plugin is imported here so that its ReferencePool (the loaded
models) outlives each inner session."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from bad_input_kit import edit_manifest, golden_dir

from refcheck import pytest_plugin
from refcheck.cli.notes import headline
from refcheck.goldens import REPO_GOLDEN

pytest_plugins = ["pytester"]

PASSING = REPO_GOLDEN / "attention-b15.arrow"
LEAKY = REPO_GOLDEN / "sglang-hybrid-ddtree-b15-leaky-chain.arrow"
EXPECT_PASS, EXPECT_FAIL = "attention-b15", "zlab-hybrid-chain"


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "refcheck.pytest_plugin",
                                            "-p", "xdist.plugin", *args)


def _gate_dir(pytester: pytest.Pytester) -> Path:
    return golden_dir(pytester.path, (EXPECT_PASS, EXPECT_FAIL))


@pytest.mark.slow
def test_fixture_diff_and_assert_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_engine=f"""
        from pathlib import Path

        from refcheck.trace.io import read_trace

        def test_passing_golden(refcheck):
            report = refcheck.assert_passes({str(PASSING)!r})
            assert report.verdict == "pass"
            assert refcheck.diff(read_trace(Path({str(PASSING)!r})), mode="replay").mode == "replay"

        def test_failing_golden(refcheck):
            refcheck.assert_passes({str(LEAKY)!r})
    """)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    first = headline(pytest_plugin.RefcheckFixture().diff(LEAKY))
    assert first is not None
    assert f"refcheck {LEAKY.stem} (both): verdict fail; checks: " in out
    assert f"first failing finding: request {first.request_id}, step {first.step}" in out
    assert f"category {first.category}: " in out
    assert re.search(r"explain it: refcheck explain \S*leaky-chain\.arrow --request \S+ --step \d+ --node \d+", out)


@pytest.mark.slow
def test_gate_items_pass_then_corrupt_trace_fails_alone(pytester: pytest.Pytester) -> None:
    gdir = _gate_dir(pytester)
    collected = _run(pytester, "--refcheck-gate", str(gdir), "--collect-only", "-q")
    ids = [line for line in collected.stdout.lines if "::" in line]
    assert ids == [f"g/MANIFEST.json::{EXPECT_PASS}", f"g/MANIFEST.json::{EXPECT_FAIL}"]

    _run(pytester, "--refcheck-gate", str(gdir), "-v").assert_outcomes(passed=2)

    trace = gdir / f"{EXPECT_PASS}.arrow"
    data = bytearray(trace.read_bytes())
    data[len(data) // 2] ^= 0x04
    trace.write_bytes(bytes(data))
    result = _run(pytester, "--refcheck-gate", str(gdir), "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*::{EXPECT_PASS} FAILED*", f"*::{EXPECT_FAIL} PASSED*"])
    result.stdout.fnmatch_lines([f"*golden case {EXPECT_PASS}: golden trace(s) do not match MANIFEST.json*"
                                 "sha256 mismatch*"])


@pytest.mark.slow
def test_gate_under_xdist(pytester: pytest.Pytester) -> None:
    gdir = _gate_dir(pytester)
    result = _run(pytester, "--refcheck-gate", str(gdir), "-n", "2", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"*PASSED*::{EXPECT_PASS}*", f"*PASSED*::{EXPECT_FAIL}*"], consecutive=False)


def test_gate_missing_trace_fails_with_the_gates_message(pytester: pytest.Pytester) -> None:
    gdir = _gate_dir(pytester)
    (gdir / f"{EXPECT_FAIL}.arrow").unlink()
    result = _run(pytester, "--refcheck-gate", str(gdir), "-k", EXPECT_FAIL, "-m", pytest_plugin.GATE_MARKER)
    result.assert_outcomes(failed=1, deselected=1)
    result.stdout.fnmatch_lines([f"*golden case {EXPECT_FAIL}: missing golden trace(s): *is missing*"])


def test_gate_without_a_manifest_is_a_collection_error(pytester: pytest.Pytester) -> None:
    gdir = _gate_dir(pytester)
    (gdir / "MANIFEST.json").unlink()
    result = _run(pytester, "--refcheck-gate", str(gdir))
    result.assert_outcomes(errors=1)


@pytest.mark.slow
def test_gate_item_fails_when_the_expectation_is_not_met(pytester: pytest.Pytester) -> None:
    def expect_pass(manifest: dict) -> None:
        manifest["cases"][EXPECT_FAIL]["provenance"]["expect"] = "pass"

    gdir = edit_manifest(pytester.path, expect_pass)
    result = _run(pytester, "--refcheck-gate", str(gdir))
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert f"refcheck {EXPECT_FAIL} (both): verdict fail; checks: " in out
    assert "first failing finding: request " in out
    assert f"explain it: refcheck explain {gdir / EXPECT_FAIL}.arrow --request " in out


def test_plugin_is_not_active_without_the_option(pytester: pytest.Pytester) -> None:
    shutil.copy(REPO_GOLDEN / "MANIFEST.json", pytester.path / "MANIFEST.json")
    pytester.makepyfile(test_plain="def test_one():\n    pass\n")
    _run(pytester).assert_outcomes(passed=1)
