"""Where a diff's time goes, and how much work it does: phase timings and work counts.

Contract: a :class:`Profile` collects, while it is active (``with profile.active():``),

* per **phase** the wall and CPU seconds spent *exclusively* in it (a phase entered inside another
  pauses the outer one, so the phases of one run add up to its total), and
* **counts** of the work done: events code reports with :func:`count` (steps replayed, greedy
  oracle tokens, reference decodes, ...) and, per phase, the target forwards (``forwards.PHASE``:
  every call of a watched model's ``lm_head``, i.e. every target or drafter forward that produced
  logits, whichever code ran it).

Code marks phases with :func:`phase` (a context manager) or :func:`timed` (a decorator); both cost
one context-variable lookup when no profile is active, so they stay in place in normal runs. Counts
are deterministic for a given input and code (they do not depend on the machine), which makes them
usable as a work budget in tests; seconds are not. Profiles of several cases merge with
:meth:`Profile.merge`, and travel between processes as plain dicts (:meth:`to_json` /
:meth:`from_json`).
"""

from __future__ import annotations

import contextvars
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])
_ACTIVE: contextvars.ContextVar[Profile | None] = contextvars.ContextVar("refcheck_profile", default=None)


@dataclass(slots=True)
class Profile:
    wall: dict[str, float] = field(default_factory=dict)  # phase -> exclusive wall seconds
    cpu: dict[str, float] = field(default_factory=dict)  # phase -> exclusive CPU seconds (this process)
    counts: Counter = field(default_factory=Counter)
    _stack: list[list] = field(default_factory=list)  # [phase, wall start, cpu start] of open phases

    # -- collecting ---------------------------------------------------------------------------
    @contextmanager
    def active(self) -> Iterator[Profile]:
        """Make this the profile that :func:`phase`, :func:`timed` and :func:`count` report to."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def _close_top(self) -> None:
        name, w0, c0 = self._stack[-1]
        w, c = time.perf_counter(), time.process_time()
        self.wall[name] = self.wall.get(name, 0.0) + (w - w0)
        self.cpu[name] = self.cpu.get(name, 0.0) + (c - c0)

    def enter(self, name: str) -> None:
        if self._stack:
            self._close_top()  # the outer phase pauses
        self._stack.append([name, time.perf_counter(), time.process_time()])

    def leave(self) -> None:
        self._close_top()
        self._stack.pop()
        if self._stack:  # the outer phase resumes
            self._stack[-1][1:] = [time.perf_counter(), time.process_time()]

    @property
    def current(self) -> str:
        return self._stack[-1][0] if self._stack else "other"

    # -- results --------------------------------------------------------------------------------
    def merge(self, other: Profile) -> None:
        for mine, theirs in ((self.wall, other.wall), (self.cpu, other.cpu)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
        self.counts.update(other.counts)

    @property
    def forwards(self) -> int:
        """Every forward that produced logits, over all phases."""
        return sum(v for k, v in self.counts.items() if k.startswith("forwards."))

    def to_json(self) -> dict:
        return {"wall_s": {k: round(v, 4) for k, v in sorted(self.wall.items())},
                "cpu_s": {k: round(v, 4) for k, v in sorted(self.cpu.items())},
                "counts": dict(sorted(self.counts.items()))}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(dict(d.get("wall_s", {})), dict(d.get("cpu_s", {})), Counter(d.get("counts", {})))


def current() -> Profile | None:
    """The active profile, or None."""
    return _ACTIVE.get()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed code as ``name`` (exclusive of phases nested in it)."""
    prof = _ACTIVE.get()
    if prof is None:
        yield
        return
    prof.enter(name)
    try:
        yield
    finally:
        prof.leave()


def timed(name: str, counter: str | None = None) -> Callable[[F], F]:
    """Decorator: every call runs as phase ``name``; ``counter`` (if given) counts the calls."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            prof = _ACTIVE.get()
            if prof is None:
                return fn(*args, **kwargs)
            if counter:
                prof.counts[counter] += 1
            prof.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                prof.leave()

        return inner  # type: ignore[return-value]

    return wrap


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to the active profile's count ``name`` (nothing when no profile is active)."""
    prof = _ACTIVE.get()
    if prof is not None:
        prof.counts[name] += n


def watch_forwards(model: torch.nn.Module) -> None:
    """Count every call of ``model.lm_head`` into the active profile as ``forwards.<phase>``
    (idempotent; the hook does nothing while no profile is active)."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "_refcheck_counted", False):
        return

    def hook(_module, _inputs) -> None:
        prof = _ACTIVE.get()
        if prof is not None:
            prof.counts[f"forwards.{prof.current}"] += 1

    head.register_forward_pre_hook(hook)
    head._refcheck_counted = True


#: the per-case table's columns: phase groups (every phase not named here counts as "other")
GROUPS = {"load": ("load_trace", "load_models", "stale_check", "cache"), "oracle": ("greedy_oracle",),
          "replay": ("replay.verify", "replay.prefill", "replay.drafter", "replay.state", "replay.bisect", "replay.other"),
          "ensemble": ("ensemble",), "free": ("free.reference_decode", "free.check")}


def _group(phase_name: str) -> str:
    return next((g for g, members in GROUPS.items() if phase_name in members), "other")


def total(profiles: dict[str, Profile]) -> Profile:
    out = Profile()
    for prof in profiles.values():
        out.merge(prof)
    return out


def case_rows(profiles: dict[str, Profile]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) per case and a total: wall seconds per phase group, wall, CPU, steps, forwards."""
    cols = ["case", *GROUPS, "other", "wall", "cpu", "steps", "forwards"]
    rows = []
    for case, prof in [*profiles.items(), ("total", total(profiles))]:
        by_group: dict[str, float] = {}
        for name, sec in prof.wall.items():
            by_group[_group(name)] = by_group.get(_group(name), 0.0) + sec
        rows.append([case, *(f"{by_group.get(g, 0.0):.2f}" for g in [*GROUPS, "other"]),
                     f"{sum(prof.wall.values()):.2f}", f"{sum(prof.cpu.values()):.2f}",
                     str(prof.counts.get("steps_replayed", 0)), str(prof.forwards)])
    return cols, rows


def phase_rows(profiles: dict[str, Profile]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) per phase over all cases, costliest first: wall and CPU seconds, forwards."""
    tot = total(profiles)
    cols = ["phase", "wall", "cpu", "forwards"]
    rows = [[name, f"{tot.wall[name]:.2f}", f"{tot.cpu.get(name, 0.0):.2f}", str(tot.counts.get(f"forwards.{name}", 0))]
            for name in sorted(tot.wall, key=lambda n: -tot.wall[n])]
    return cols, rows
