"""refcheck inside an engine's own pytest suite: a ``refcheck`` fixture and ``pytest --refcheck-gate DIR``.

Contract:

* Registered as the ``pytest11`` entry point ``refcheck`` (or loaded with ``-p refcheck.pytest_plugin``).
* Fixture ``refcheck`` (:class:`RefcheckFixture`): ``diff(trace_or_path, *, mode, ref_dtype, ref_device)``
  diffs a trace file or a :class:`refcheck.trace.io.Trace` against the reference as ``refcheck diff
  --against`` does (no golden manifest rules) and returns its :class:`refcheck.diff.findings.Report`;
  ``assert_passes`` (same arguments) returns the report when it passes, as ``refcheck diff`` would exit 0
  (:func:`passes`), else raises an AssertionError saying the verdict, the counts, the first failing
  finding (request, step, node, layer, category, message) and the CLI's own ``refcheck explain`` command
  for it (:func:`failure_message`).
* ``--refcheck-gate DIR`` adds one :class:`GoldenCaseItem` per case of ``DIR/MANIFEST.json``, named by the
  case and marked ``refcheck_gate`` (``-m refcheck_gate`` keeps only them), to what the session collects;
  a manifest that cannot be read is a collection error. Each item checks its own trace against the
  manifest (missing: the gate's GoldenError; hash mismatch: its CorruptTraceError), then judges it with
  the gate's per-case judgement :func:`refcheck.goldens.judge.gate_case` (stale models fail with its
  GoldenError); the item passes when ``refcheck gate`` would pass that case (an expected failure caught
  included). Items hold only the directory and the case name, so pytest-xdist workers collect and run
  them on their own.
* One :class:`refcheck.pool.ReferencePool` per process (:func:`shared_pool`, built on first
  use; under pytest-xdist with the worker's share of the cores as torch threads): the models load once
  per test session and per xdist worker, and the fixture and the gate items share it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from refcheck.diff.findings import Report
    from refcheck.pool import ReferencePool
    from refcheck.trace.io import Trace

GATE_MARKER = "refcheck_gate"

_POOL: ReferencePool | None = None


def shared_pool() -> ReferencePool:
    """This process's reference pool, built on first use (module docstring)."""
    global _POOL
    if _POOL is None:
        from refcheck.pool import ReferencePool

        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
        if workers.isdigit():
            from refcheck.parallel import worker_setup

            worker_setup(int(workers))
        _POOL = ReferencePool()
    return _POOL


def passes(report: Report) -> bool:
    """Whether ``refcheck diff`` / ``refcheck gate`` exits 0 on this report alone (an inconclusive
    statistical verdict or nothing compared does not pass)."""
    from refcheck.errors import EXIT_PASS

    return report.exit_code == EXIT_PASS and not report.inconclusive


def explain_command(report: Report, path: str) -> str | None:
    """The ``explain it: refcheck explain ...`` line the CLI prints after its table (None: no node to explain)."""
    from refcheck.cli.diff import explain_line

    return explain_line(report, path)


def _finding_line(report: Report) -> str | None:
    from refcheck.cli.notes import headline

    f = headline(report)
    if f is None:
        return None
    shown = {"request": f.request_id, "step": "prefill" if f.step == -1 else f.step, "node": f.node,
             "layer": f.layer if f.layer_type is None else f"{f.layer} ({f.layer_type})", "category": f.category}
    return ("first failing finding: " + ", ".join(f"{k} {'-' if v is None else v}" for k, v in shown.items())
            + f": {f.message}")


def failure_message(report: Report, path: str) -> str:
    """A failing report in words: verdict and counts, the first failing finding and the command that
    explains it (``path``: the trace file the command names)."""
    counts = ", ".join(f"{n} {k}" for k, n in report.counts.items())
    lines = [f"refcheck {report.case} ({report.mode}): verdict {report.verdict}; checks: {counts}"]
    if report.expect_failure is not None:
        lines.append(f"expected failure: {report.expect_failure}"
                     + (f" first at {report.expect_first}" if report.expect_first else ""))
    first = _finding_line(report)
    lines.append(first or "no failing finding")
    lines += [f"inconclusive: {why}" for why in report.inconclusive]
    hint = explain_command(report, path)
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def _trace_and_path(trace_or_path: Trace | str | os.PathLike[str]) -> tuple[Trace, str]:
    from refcheck.trace.io import read_trace

    if isinstance(trace_or_path, (str, os.PathLike)):
        return read_trace(Path(trace_or_path)), str(trace_or_path)
    return trace_or_path, trace_or_path.source or "TRACE"


class RefcheckFixture:
    """What the ``refcheck`` fixture gives a test (module docstring)."""

    def __init__(self, pool: ReferencePool | None = None) -> None:
        self._pool = pool

    @property
    def pool(self) -> ReferencePool:
        return self._pool or shared_pool()

    def _diff(self, trace_or_path: Trace | str | os.PathLike[str], mode: str, ref_dtype: str,
              ref_device: str) -> tuple[Report, str]:
        from refcheck.diff.judge import judge

        trace, path = _trace_and_path(trace_or_path)
        return judge(trace, self.pool, Path(path).stem, mode, ref_dtype=ref_dtype, ref_device=ref_device), path

    def diff(self, trace_or_path: Trace | str | os.PathLike[str], *, mode: str = "both",
             ref_dtype: str = "float32", ref_device: str = "cpu") -> Report:
        """The report ``refcheck diff --against TRACE --mode MODE`` makes (``mode``: replay, free or both)."""
        __tracebackhide__ = True
        return self._diff(trace_or_path, mode, ref_dtype, ref_device)[0]

    def assert_passes(self, trace_or_path: Trace | str | os.PathLike[str], *, mode: str = "both",
                      ref_dtype: str = "float32", ref_device: str = "cpu") -> Report:
        """:meth:`diff`, then an AssertionError (:func:`failure_message`) unless the report passes."""
        __tracebackhide__ = True
        report, path = self._diff(trace_or_path, mode, ref_dtype, ref_device)
        if not passes(report):
            raise AssertionError(failure_message(report, path))
        return report


@pytest.fixture(scope="session")
def refcheck() -> RefcheckFixture:
    """Diff engine traces against the reference: ``refcheck.diff(...)``, ``refcheck.assert_passes(...)``."""
    return RefcheckFixture()


# -- the golden gate as test items --------------------------------------------------------------------
class GateCaseFailure(Exception):
    """A golden case the gate would fail (its message: :func:`failure_message`)."""


def _verified_entry(golden_dir: Path, case: str) -> Any:
    """``case``'s manifest entry after the gate's hash check of its trace alone (``refcheck.goldens.verify``)."""
    from refcheck.goldens.verify import verify

    return verify(golden_dir, case).cases[case]


class GoldenCaseItem(pytest.Item):
    """One golden case, judged as ``refcheck gate DIR --case NAME`` judges it."""

    def runtest(self) -> None:
        from refcheck.goldens.judge import gate_case

        golden_dir = self.path.parent
        entry = _verified_entry(golden_dir, self.name)
        report = gate_case(self.name, entry, golden_dir, shared_pool())
        if not passes(report):
            raise GateCaseFailure(failure_message(report, str(golden_dir / entry.file)))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str | Any:
        from refcheck.errors import RefcheckError

        if isinstance(excinfo.value, (GateCaseFailure, RefcheckError)):
            return f"golden case {self.name}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Path, None, str]:
        return self.path, None, f"refcheck gate {self.path.parent} --case {self.name}"


class GoldenManifest(pytest.File):
    """A golden directory's ``MANIFEST.json``: one :class:`GoldenCaseItem` per case, in name order."""

    def collect(self) -> Iterator[GoldenCaseItem]:
        from refcheck.errors import GoldenError
        from refcheck.goldens import load_manifest, store

        with store.reading(self.path.parent):
            cases = sorted(load_manifest(self.path.parent).cases)
        if not cases:
            raise GoldenError(f"{self.path.parent}: the manifest lists no golden traces")
        for case in cases:
            item = GoldenCaseItem.from_parent(self, name=case)
            item.add_marker(GATE_MARKER)
            yield item


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refcheck")
    group.addoption("--refcheck-gate", metavar="DIR", default=None,
                    help="Add one test per golden case of DIR (its MANIFEST.json), judged as `refcheck gate DIR` judges it.")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{GATE_MARKER}: a golden case added by --refcheck-gate DIR")


def _node_id(session: pytest.Session, path: Path) -> str:
    try:
        return path.relative_to(session.config.rootpath).as_posix()
    except ValueError:
        return path.as_posix()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Append the ``--refcheck-gate`` cases (before ``-m`` / ``-k`` select, so both apply to them)."""
    option = config.getoption("refcheck_gate")
    if not option:
        return
    path = (Path(option) / "MANIFEST.json").absolute()
    collector = GoldenManifest.from_parent(session, path=path, nodeid=_node_id(session, path))
    items.extend(session.genitems(collector))
