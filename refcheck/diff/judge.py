"""Judging one engine trace against the reference: replay and/or free run, merged into one report.

Contract: :func:`judge` takes a trace and a :class:`~refcheck.pool.ReferencePool` and returns the
:class:`~refcheck.diff.findings.Report` of the diff in one of :data:`MODES` (an unknown mode: a
:class:`~refcheck.errors.UsageError` before any reference work). The pool gives the runner the trace is judged
against (after its input checks: an id outside the target's vocabulary, or a prompt plus the token limit beyond the
target's context, is a corrupt trace), the target's greedy or sampled continuations and the reference's own runs;
this module loads no model and runs no reference itself. The verdict is held to the calibration of the engine's
numerics (:func:`refcheck.diff.tolerance.calibration_for`) unless the caller passes one; the same trace and
settings give the same report whichever pool, fresh or shared with other cases, serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refcheck.diff.findings import Report
from refcheck.diff.freerun import free_run
from refcheck.diff.replay import replay
from refcheck.diff.sampling import cdf_tolerance
from refcheck.diff.tolerance import Calibration, Tolerance, calibration_for, engine_numerics
from refcheck.errors import UsageError
from refcheck.profile import phase
from refcheck.trace.rows import Trace

if TYPE_CHECKING:
    from refcheck.pool import ReferencePool
    from refcheck.reference_runner import ReferenceRunner

#: the diff's modes: re-verify every step at the engine's prefix, compare the outputs, or both
MODES = ("replay", "free", "both")


def judge(trace: Trace, pool: ReferencePool, case: str, mode: str = "both", strict_acceptance: bool = False,
          ref_dtype: str = "float32", ref_device: str = "cpu", calibration: Calibration | None = None) -> Report:
    """Diff ``trace`` against the reference ``pool`` serves in ``ref_dtype`` on ``ref_device``, judged by the
    calibration of the engine's numerics (``calibration`` overrides it: ``refcheck calibrate`` measuring candidate
    bounds); ``case`` names the report. ``strict_acceptance`` holds the engine's acceptance to the reference's own
    run, at equal numerics only."""
    if mode not in MODES:
        raise UsageError(f"unknown diff mode {mode!r} (choose from {', '.join(MODES)})")
    runner = pool.runner_for(trace, case, ref_dtype, ref_device)
    spec = runner.spec
    eng_dtype, eng_device = engine_numerics(trace.provenance)
    cal = calibration or calibration_for(eng_dtype, eng_device)
    same_numerics = eng_dtype == ref_dtype and eng_device.split(":")[0] == ref_device.split(":")[0]
    strict_acceptance = strict_acceptance and same_numerics
    # The scripted drafter proposes the target's own greedy continuation: its drafts depend on the
    # target's dtype, so they are only comparable at equal numerics.
    check_draft = same_numerics or spec.drafter != "scripted"
    report = Report(case=case, mode=mode)
    if mode in ("replay", "both"):
        with phase("replay.other"):
            report.merge(replay(trace, runner.target, runner.drafter, cal, case, spec.stop_token_ids, check_draft,
                                eng_dtype))
    if mode in ("free", "both"):
        fr = _free(trace, pool, runner, cal.tolerance, strict_acceptance, case)
        report.merge(fr)
        report.stats.update(fr.stats)
    return report


def _free(trace: Trace, pool: ReferencePool, runner: ReferenceRunner, tol: Tolerance, strict_acceptance: bool,
          case: str) -> Report:
    """The free run of ``trace``: its outputs beside the target-only oracle's and, where one is run, the reference's
    own DDTree run's."""
    spec = runner.spec
    # An engine without a drafter (target-only, NGRAM) runs no DDTree: the reference's own run (its drafter
    # the scripted stand-in) has no acceptance to set beside the engine's, and at T > 0 that stand-in costs a
    # greedy continuation at every sampled prefix. Only a strict comparison of acceptance needs it.
    ref_runs = None if trace.prov.drafter == "none" and not strict_acceptance else {
        r.request_id: pool.reference_decode(runner, list(r.prompt_ids), max(r.rng_request, 0),
                                            r.token_limit(spec.max_new_tokens))
        for r in trace.requests}
    greedy: dict[str, list[int] | None] = {}
    margins: dict[str, list[float] | None] = {}
    for r in trace.requests:
        # the oracle's guesses: the engine's output, then the reference's own (lossless) run where there is
        # one, which settles what follows a rounding choice of the engine's (the result is the oracle's)
        guesses = [list(r.output_ids)] + ([list(ref_runs[r.request_id].output_ids)] if ref_runs else [])
        if r.sampled:
            got = pool.sampled_oracle(runner, r, guesses)
            greedy[r.request_id] = None if got is None else got[0]
            margins[r.request_id] = None if got is None else got[1]
        else:
            greedy[r.request_id] = pool.greedy(runner, list(r.prompt_ids), r.token_limit(spec.max_new_tokens),
                                               guesses=guesses)
    cdf_tol = (cdf_tolerance(tol.logprob_abs, spec.sampling.temperature)
               if spec.sampled and spec.sampling is not None else 0.0)
    with phase("free.check"):
        return free_run(trace, runner.target.model, greedy, tol, ref_runs, strict_acceptance, case, margins, cdf_tol)
