"""Diffing one engine trace against the reference: picks the reference set-up from the trace's
provenance, runs replay and/or free-run, and merges the reports.

Contract: :func:`reference_spec_for` derives the reference's :class:`EngineSpec` from a trace's
provenance (model, drafter kind, budget, token limits; the reference's own dtype/device are the
caller's choice, fp32 CPU by default); a trace whose token limit its target's context cannot hold
(a prompt plus ``max_new_tokens`` beyond it: no run of that model recorded it) is a
:class:`~refcheck.errors.CorruptTraceError` naming the file (:func:`check_token_limit`).
:class:`DiffSession` keeps loaded reference runners, the target's greedy continuations and the
reference's own runs, so a gate over many cases loads each model once and does work the cases share
once (same results as computing it per case).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddtree_reference.decode import DecodeResult
from ddtree_reference.oracle import GreedyMemo, sample_decode
from ddtree_reference.scripted import ScriptedDrafter
from refcheck.diff.findings import Report
from refcheck.diff.freerun import free_run
from refcheck.diff.replay import replay
from refcheck.diff.sampling import SampledRequest, cdf_tolerance
from refcheck.diff.tolerance import Calibration, calibration_for, engine_numerics
from refcheck.errors import CorruptTraceError, UsageError
from refcheck.models import BUILTIN_PAIRS
from refcheck.profile import count, phase, watch_forwards
from refcheck.reference_runner import ReferenceRunner
from refcheck.spec import EngineSpec
from refcheck.trace.io import check_token_ids
from refcheck.trace.rows import RequestRow, Trace

MODES = ("replay", "free", "both")


def reference_spec_for(trace: Trace, dtype: str = "float32", device: str = "cpu") -> EngineSpec:
    prov = trace.prov
    model = prov.model
    # An engine without a drafter (target-only decoding, budget 0) is replayed with root-only trees;
    # the reference then never calls its drafter, so the cheapest one stands in.
    drafter = "scripted" if prov.drafter == "none" else prov.drafter
    # the reference runs the engine's own drafting rule: a chain engine (DFLASH) is set beside the reference's chain
    budget = None if prov.draft_rule == "chain" else prov.budget
    spec = EngineSpec(dtype=dtype, device=device, drafter=drafter, max_new_tokens=prov.max_new_tokens,
                      stop_token_ids=prov.stop_token_ids, seed=prov.seed, budget=budget)
    sampled = next((SampledRequest.from_row(r) for r in trace.requests if r.sampled), None)
    spec.sampling = sampled.sampling if sampled is not None else None
    if model.startswith("builtin:"):
        pair = model.split(":", 1)[1]
        if pair not in BUILTIN_PAIRS:
            raise UsageError(f"trace names unknown built-in model pair {pair!r}")
        spec.pair = pair
    elif model:
        spec.model_dir = Path(model)
        spec.draft_dir = prov.draft_dir
    return spec


def check_token_limit(trace: Trace, context: int, source: str) -> None:
    """Every request's prompt plus the trace's ``max_new_tokens`` fits the target's ``context`` (positions);
    else a :class:`CorruptTraceError` naming ``source`` and the longest prompt."""
    limit = trace.prov.max_new_tokens
    longest = max(trace.requests, key=lambda r: len(r.prompt_ids), default=None)
    if longest is not None and len(longest.prompt_ids) + limit > context:
        raise CorruptTraceError(f"{source}: provenance max_new_tokens {limit}: request {longest.request_id!r} has a "
                                f"prompt of {len(longest.prompt_ids)} tokens, and prompt + new tokens exceed the "
                                f"target's context of {context} positions (no run of this model could record it)")


class DiffSession:
    """Loaded reference runners and the work several diffs share, computed once per session:

    * the target's greedy continuations (:class:`ddtree_reference.oracle.GreedyMemo`, one per model and
      numerics): the free run's target-only oracle and the scripted drafter's "true" drafts (the
      stand-in drafter of engine traces without one) are the same plain forwards of the same greedy
      prefixes, so each distinct sequence is run once, whichever case or runner asks;
    * the reference's own DDTree run of a prompt (per complete :class:`EngineSpec` and prompt), which
      the free run of every trace recorded with the same settings compares against.
    """

    def __init__(self) -> None:
        self._runners: dict[tuple[object, ...], ReferenceRunner] = {}
        self._memos: dict[tuple[object, ...], GreedyMemo] = {}
        self._decodes: dict[tuple[object, ...], DecodeResult] = {}

    def runner(self, spec: EngineSpec) -> ReferenceRunner:
        key = (spec.model_label, str(spec.draft_dir), spec.dtype, spec.device, spec.drafter, spec.seed)
        if key not in self._runners:
            with phase("load_models"):
                runner = self._runners[key] = ReferenceRunner(spec)
            count("runner_loads")
            watch_forwards(runner.target.model)
            if isinstance(runner.drafter, ScriptedDrafter):
                runner.drafter.oracle = self.memo(runner)
        runner = self._runners[key]
        runner.spec = spec  # budget / limits may differ between cases; the models do not
        return runner

    def memo(self, runner: ReferenceRunner) -> GreedyMemo:
        """The greedy-continuation memo of ``runner``'s target (shared by runners of the same model
        and numerics: their targets are loaded from the same files, so their forwards are equal)."""
        key = (runner.spec.model_label, runner.spec.dtype, runner.spec.device)
        if key not in self._memos:
            self._memos[key] = GreedyMemo(runner.target.model)
        return self._memos[key]

    def greedy(self, runner: ReferenceRunner, prompt: list[int], n: int,
               guesses: Sequence[Sequence[int]] = ()) -> list[int]:
        """The target-only greedy continuation of ``prompt``: ``n`` tokens (fewer after a stop token);
        ``guesses`` (the engine's output, the reference's own run) are settled in one forward each where they hold
        (``ddtree_reference.oracle``)."""
        memo = self.memo(runner)
        before = memo.forwards
        with phase("greedy_oracle"):
            out = memo.decode(prompt, n, runner.spec.stop_token_ids, guesses=guesses)
        count("greedy_forwards", memo.forwards - before)
        return out

    def sampled_oracle(self, runner: ReferenceRunner, req: RequestRow, guesses: list[list[int]] | None = None
                       ) -> tuple[list[int], list[float]] | None:
        """Target-only sampling of a sampled request with the engine's own keys (tokens, boundary margins),
        or None when the engine's uniforms are not refcheck's position-keyed ones (not recomputable);
        ``guesses`` (default: the engine's output) are settled in one forward each where they hold."""
        sr = SampledRequest.from_row(req)
        if sr is None or not sr.recomputable or sr.sampling.keying != "position":
            return None
        spec = runner.spec
        with phase("greedy_oracle"):
            return sample_decode(runner.target.model, list(req.prompt_ids), spec.max_new_tokens, sr.sampling,
                                 sr.rng_request, spec.stop_token_ids, guesses=guesses or [list(req.output_ids)])

    def reference_decode(self, runner: ReferenceRunner, prompt: list[int], request: int = 0) -> DecodeResult:
        """The reference's own DDTree run of ``prompt`` under ``runner.spec`` (computed once per spec);
        ``request`` keys its sampling (unused when greedy)."""
        spec = runner.spec
        key: tuple[object, ...] = (spec.model_label, str(spec.draft_dir), spec.dtype, spec.device, spec.drafter,
                                   spec.seed, spec.budget, spec.max_new_tokens, spec.stop_token_ids, tuple(prompt))
        if spec.sampled:
            key += (spec.sampling, request)
        if key not in self._decodes:
            with phase("free.reference_decode"):
                decoder = runner.decoder(spec.max_new_tokens)
                self._decodes[key] = (decoder.generate(list(prompt), request=request) if spec.sampled
                                      else decoder.generate(list(prompt)))
            count("reference_decodes")
        return self._decodes[key]

    def diff(self, trace: Trace, case: str, mode: str = "both", strict_acceptance: bool = False,
             ref_dtype: str = "float32", ref_device: str = "cpu", calibration: Calibration | None = None) -> Report:
        """Diff ``trace`` against the reference, judged by the calibration of the engine's numerics
        (``calibration`` overrides it: ``refcheck calibrate`` measuring candidate bounds)."""
        if mode not in MODES:
            raise UsageError(f"unknown diff mode {mode!r} (choose from {', '.join(MODES)})")
        spec = reference_spec_for(trace, ref_dtype, ref_device)
        runner = self.runner(spec)
        check_token_ids(trace, runner.target.vocab_size, case)  # an id beyond the target's vocabulary: a corrupt trace
        check_token_limit(trace, runner.target.max_positions, trace.source or case)
        eng_dtype, eng_device = engine_numerics(trace.provenance)
        cal = calibration or calibration_for(eng_dtype, eng_device)
        tol = cal.tolerance
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
            # An engine without a drafter (target-only, NGRAM) runs no DDTree: the reference's own run (its drafter
            # the scripted stand-in) has no acceptance to set beside the engine's, and at T > 0 that stand-in costs a
            # greedy continuation at every sampled prefix (61 s of the gate's NGRAM T = 1 golden). Only a strict
            # comparison of acceptance needs it.
            ref_runs = None if trace.prov.drafter == "none" and not strict_acceptance else {
                r.request_id: self.reference_decode(runner, list(r.prompt_ids), max(r.rng_request, 0))
                for r in trace.requests}
            greedy, margins = {}, {}
            for r in trace.requests:
                # the oracle's guesses: the engine's output, then the reference's own (lossless) run where there is
                # one, which settles what follows a rounding choice of the engine's (the result is the oracle's)
                guesses = [list(r.output_ids)] + ([list(ref_runs[r.request_id].output_ids)] if ref_runs else [])
                if r.sampled:
                    got = self.sampled_oracle(runner, r, guesses)
                    greedy[r.request_id] = None if got is None else got[0]
                    margins[r.request_id] = None if got is None else got[1]
                else:
                    greedy[r.request_id] = self.greedy(runner, list(r.prompt_ids), spec.max_new_tokens, guesses=guesses)
            cdf_tol = (cdf_tolerance(tol.logprob_abs, spec.sampling.temperature)
                       if spec.sampled and spec.sampling is not None else 0.0)
            with phase("free.check"):
                fr = free_run(trace, runner.target.model, greedy, tol, ref_runs, strict_acceptance, case, margins, cdf_tol)
            report.merge(fr)
            report.stats.update(fr.stats)
        return report
