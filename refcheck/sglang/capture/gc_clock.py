"""The process's garbage collections, timed as they happen.

Contract: a :class:`CollectionClock` is a ``gc.callbacks`` entry. It reads the clock when a collection starts and
hands each finished collection's nanoseconds to :meth:`CollectionClock.collected`, which a subclass books where it
needs them (the capture's cost ledger, a timing pass's total). It runs in whichever thread collects, possibly one
holding a lock, so what ``collected`` does must not wait on a lock. Collections never overlap, so one clock serves
the whole process. No torch, no SGLang.
"""

from __future__ import annotations

import time


class CollectionClock:
    """Times each garbage collection of the process while installed in ``gc.callbacks`` (module docstring)."""

    def __init__(self) -> None:
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self._t0:
            self.collected(time.perf_counter_ns() - self._t0)
            self._t0 = 0

    def collected(self, ns: int) -> None:
        """One collection took ``ns`` nanoseconds."""
        raise NotImplementedError
