"""Which steps of its requests a scheduler process records: each request's step count and the sampling clocks.

Contract: a :class:`StepClock` belongs to one scheduler process. It counts that process's decode batches that
hold traced requests (``batches``: the sampling rule's clock g). It also counts, per request by rid, the decode or
verify steps the process has run for it. :meth:`StepClock.take` advances both for one decode batch. It returns the
batch rows to record and their step numbers. Row b is taken when its rid's rule takes batch g:
:func:`~refcheck.sglang.capture.sample_rule.rule_for`, the rid's mark or else the clock's default rule, read once
per request. Every row's count advances. Prefill batches run on a clock of their own (``prefills``):
:meth:`StepClock.take_prefill` takes row b of the p-th prefill batch when its rid's rule takes p, so a sampled
capture records one prefill batch in ``every`` as it does decode batches, and a full capture every one. Every
``sweep_every`` decode batches, and every ``sweep_every`` prefill batches, the counts of requests SGLang has let
go of are dropped: the clock holds a weak reference to each request object, so a request no batch can hold again
is gone. A request that is only waiting (retracted, preempted) keeps its count. A request class that takes no weak
reference is kept for the process's life. So a serving run with capture left on holds as many counts as it has
live requests. ``on_enter``, when given, is called once for each request the clock meets (the hooks count them in
the process's ledger: a request whose batches the rule all passed over is counted there, not silently absent).
Beside its count the clock keeps how many of a request's context tokens its records have carried
(:meth:`StepClock.context`, :mod:`refcheck.sglang.capture.contexts`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from refcheck.sglang.capture.contexts import delta, params_of
from refcheck.sglang.capture.sample_rule import SampleRule, rule_for

SWEEP_EVERY = 1024  # decode batches between sweeps


class StepClock:
    """One process's sampling clock and per-request step counts (module docstring)."""

    def __init__(self, default: SampleRule, sweep_every: int = SWEEP_EVERY,
                 on_enter: Callable[[], None] | None = None) -> None:
        self.default, self.sweep_every, self.on_enter = default, sweep_every, on_enter
        self.batches = 0
        self.prefills = 0
        #: rid -> [steps run, its rule's every, its rule's phase, a weak reference to the request or None, context
        #: tokens its records carried]
        self._seen: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, rid: str) -> bool:
        return rid in self._seen

    def steps(self, rid: str) -> int:
        """The decode or verify steps counted for ``rid`` (0 for one never seen, or swept)."""
        clock = self._seen.get(rid)
        return 0 if clock is None else int(clock[0])

    def take(self, rids: list[str], reqs: list[Any]) -> tuple[list[int], list[int]]:
        """One decode batch of requests ``reqs`` (their rids ``rids``): (rows taken, their step numbers)."""
        g = self.batches
        self.batches += 1
        if g % self.sweep_every == self.sweep_every - 1:
            self._sweep()
        take: list[int] = []
        steps: list[int] = []
        for b, rid in enumerate(rids):  # every decode batch, every request: SampleRule.takes inlined
            clock = self._seen.get(rid)
            if clock is None:
                clock = self._enter(rid, reqs[b])
            k = clock[0]
            clock[0] = k + 1
            if (g + clock[2]) % clock[1] == 0:
                take.append(b)
                steps.append(k)
        return take, steps

    def take_prefill(self, rids: list[str], reqs: list[Any]) -> list[int]:
        """One prefill batch of requests ``reqs`` (their rids ``rids``): the rows taken (no step count advances)."""
        p = self.prefills
        self.prefills += 1
        if p % self.sweep_every == self.sweep_every - 1:  # a run of prefills only sweeps too
            self._sweep()
        take: list[int] = []
        for b, rid in enumerate(rids):
            clock = self._seen.get(rid)
            if clock is None:
                clock = self._enter(rid, reqs[b])
            if (p + clock[2]) % clock[1] == 0:
                take.append(b)
        return take

    def _enter(self, rid: str, req: Any) -> list[Any]:
        """``rid``'s entry, new: no step run, its rule's every and phase, a weak reference to its request."""
        rule = rule_for(rid, self.default)
        clock = self._seen[rid] = [0, rule.every, rule.phase, _weak(req), 0]
        if self.on_enter is not None:
            self.on_enter()
        return clock

    def context(self, rid: str, req: Any) -> tuple[list[Any], dict[str, Any] | None]:
        """The piece of ``rid``'s context its next record carries ([start, tokens, prompt length]: :func:`~refcheck.
        sglang.capture.contexts.delta` of the scheduler's ``req``), counted as carried, and its sampling parameters when
        no record carried any of it before."""
        clock = self._seen.get(rid)
        if clock is None:
            clock = self._enter(rid, req)
        known = clock[4]
        tokens = delta(known, req.origin_input_ids, req.output_ids)
        clock[4] = known + len(tokens)
        return [known, tokens, len(req.origin_input_ids)], (params_of(req) if known == 0 else None)

    def _sweep(self) -> None:
        for rid in [rid for rid, clock in self._seen.items() if clock[3] is not None and clock[3]() is None]:
            del self._seen[rid]


def _weak(req: Any) -> Any:
    try:
        return weakref.ref(req)
    except TypeError:  # a request class that takes no weak references: its count is kept for the process's life
        return None
