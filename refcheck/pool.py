"""The reference pool: the reference models loaded once, and the reference's work that engines and judges share.

Contract: :class:`ReferencePool` is the one place that loads and runs the reference for others. It holds

* the loaded :class:`~refcheck.reference_runner.ReferenceRunner` of each model, numerics, drafter and seed
  (:meth:`ReferencePool.runner`: one load per key, whatever the budget or limits of the spec asking);
* the target's greedy continuations (:class:`ddtree_reference.oracle.GreedyMemo`, one per model and numerics): the
  free run's target-only oracle and the scripted drafter's "true" drafts (the stand-in drafter of engine traces
  without one) are the same plain forwards of the same greedy prefixes, so each distinct sequence is run once,
  whichever case or runner asks;
* the reference's own DDTree run of a prompt (per complete :class:`~refcheck.spec.EngineSpec` and prompt), which
  the free run of every trace recorded with the same settings compares against;
* the target-only sampling oracle of a sampled request (:meth:`ReferencePool.sampled_oracle`).

Everything it returns equals what a fresh runner would compute: sharing a pool over many cases loads each model
once and does shared work once, and changes no result. :func:`reference_spec_for` derives the reference's
:class:`~refcheck.spec.EngineSpec` from a trace's provenance (model, drafter kind, budget, token limits; the
reference's own dtype and device are the caller's choice, fp32 CPU by default). :meth:`ReferencePool.runner_for`
is the runner a trace is judged against, after the trace's input checks: a token id outside the target's
vocabulary (:func:`refcheck.trace.io.check_token_ids`) or a token limit its target's context cannot hold (a prompt
plus ``max_new_tokens`` beyond it: no run of that model recorded it; :func:`check_token_limit`) is a corrupt
trace naming the file. The profile sees the loads (phase ``load_models``, count ``runner_loads``, every forward of
a loaded target), the oracles (phase ``greedy_oracle``, count ``greedy_forwards``) and the reference's own runs
(phase ``free.reference_decode``, count ``reference_decodes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddtree_reference.decode import DecodeResult
from ddtree_reference.oracle import GreedyMemo, sample_decode
from ddtree_reference.scripted import ScriptedDrafter
from refcheck.diff.sampling import SampledRequest
from refcheck.errors import CorruptTraceError, UsageError
from refcheck.models import BUILTIN_PAIRS
from refcheck.profile import count, phase, watch_forwards
from refcheck.reference_runner import ReferenceRunner
from refcheck.spec import EngineSpec
from refcheck.trace.io import check_token_ids
from refcheck.trace.rows import RequestRow, Trace


def reference_spec_for(trace: Trace, dtype: str = "float32", device: str = "cpu") -> EngineSpec:
    """The reference's spec for judging ``trace``: its model, drafter, budget, limits, seed and sampling, in
    ``dtype`` on ``device``; a :class:`UsageError` for a built-in model pair refcheck does not have."""
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
    """Every request's prompt plus its token limit (its own, else the trace's ``max_new_tokens``) fits the target's
    ``context`` (positions); else a :class:`CorruptTraceError` naming ``source`` and the longest request."""
    run = trace.prov.max_new_tokens
    longest = max(trace.requests, key=lambda r: len(r.prompt_ids) + r.token_limit(run), default=None)
    if longest is not None and len(longest.prompt_ids) + (limit := longest.token_limit(run)) > context:
        what = "its max_new_tokens" if longest.max_new_tokens >= 0 else "provenance max_new_tokens"
        raise CorruptTraceError(f"{source}: {what} {limit}: request {longest.request_id!r} has a "
                                f"prompt of {len(longest.prompt_ids)} tokens, and prompt + new tokens exceed the "
                                f"target's context of {context} positions (no run of this model could record it)")


class ReferencePool:
    """Loaded reference runners and the reference's work shared by the engines and judges that use the pool
    (module docstring)."""

    def __init__(self) -> None:
        self._runners: dict[tuple[object, ...], ReferenceRunner] = {}
        self._memos: dict[tuple[object, ...], GreedyMemo] = {}
        self._decodes: dict[tuple[object, ...], DecodeResult] = {}

    def load(self, spec: EngineSpec) -> ReferenceRunner:
        """A freshly loaded runner of ``spec``'s models (:meth:`runner` calls it once per key)."""
        return ReferenceRunner(spec)

    def runner(self, spec: EngineSpec) -> ReferenceRunner:
        """The pool's runner of ``spec``'s models, numerics, drafter and seed, loaded on first use; its ``spec`` is
        set to ``spec`` (budget and limits may differ between callers; the models do not)."""
        key = (spec.model_label, str(spec.draft_dir), spec.dtype, spec.device, spec.drafter, spec.seed)
        if key not in self._runners:
            with phase("load_models"):
                runner = self._runners[key] = self.load(spec)
            count("runner_loads")
            watch_forwards(runner.target.model)
            if isinstance(runner.drafter, ScriptedDrafter):
                runner.drafter.oracle = self.memo(runner)
        runner = self._runners[key]
        runner.spec = spec
        return runner

    def runner_for(self, trace: Trace, case: str, dtype: str = "float32", device: str = "cpu") -> ReferenceRunner:
        """The runner ``trace`` is judged against (:func:`reference_spec_for` in ``dtype`` on ``device``), after its
        input checks: every token id within the target's vocabulary, every prompt plus the token limit within its
        context (errors name ``case``, the limit's the trace's file when it has one)."""
        runner = self.runner(reference_spec_for(trace, dtype, device))
        check_token_ids(trace, runner.target.vocab_size, case)
        check_token_limit(trace, runner.target.max_positions, trace.source or case)
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
        start = memo.forwards
        with phase("greedy_oracle"):
            out = memo.decode(prompt, n, runner.spec.stop_token_ids, guesses=guesses)
        count("greedy_forwards", memo.forwards - start)
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
            return sample_decode(runner.target.model, list(req.prompt_ids), req.token_limit(spec.max_new_tokens), sr.sampling,
                                 sr.rng_request, spec.stop_token_ids, guesses=guesses or [list(req.output_ids)])

    def reference_decode(self, runner: ReferenceRunner, prompt: list[int], request: int = 0,
                         max_new_tokens: int | None = None) -> DecodeResult:
        """The reference's own DDTree run of ``prompt`` under ``runner.spec`` (computed once per spec), to
        ``max_new_tokens`` (default: the spec's); ``request`` keys its sampling (unused when greedy)."""
        spec = runner.spec
        limit = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
        key: tuple[object, ...] = (spec.model_label, str(spec.draft_dir), spec.dtype, spec.device, spec.drafter,
                                   spec.seed, spec.budget, limit, spec.stop_token_ids, tuple(prompt))
        if spec.sampled:
            key += (spec.sampling, request)
        if key not in self._decodes:
            with phase("free.reference_decode"):
                decoder = runner.decoder(limit)
                self._decodes[key] = (decoder.generate(list(prompt), request=request) if spec.sampled
                                      else decoder.generate(list(prompt)))
            count("reference_decodes")
        return self._decodes[key]
