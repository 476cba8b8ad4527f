"""How many bytes of records one scheduler process may write into the capture directory.

Contract: ``REFCHECK_CAPTURE_MAX_BYTES=N`` (:data:`ENV_MAX_BYTES`, set by the runner from ``--capture-max-mb``)
bounds the bytes of the record frames each scheduler process writes (batch, prefill and error records, headers
included), so a capture left on for a long run cannot fill its disk. :func:`parse` reads the value (None or
empty: no bound) and refuses anything but an integer in 1..:data:`MAX_BYTES` with :class:`CaptureBudgetError`.
A :class:`ByteBudget` is charged with each record before it is written. The first record that would cross the
bound is refused, and the budget is *spent* from then on: every later record is refused too, however small. So
the capture directory holds a prefix of the process's records, and the hooks pass every later batch over as if no
capture were loaded. The refusals are counted (the counters file's ``over_budget`` for batch records and
``unwritten_errors`` for error records: :mod:`refcheck.sglang.capture.shipper`) and the reader reports both: a
step past the budget is a declared gap, never a silently missing one.

A *rolling* budget (``REFCHECK_CAPTURE_ROLL=1`` beside it, :data:`ENV_ROLL`; the runner's ``--capture-roll``) is
never spent: a record that would cross the bound first has the oldest batch records deleted (the caller's ``evict``,
a segment of them at a time, counted ``rolled_out``) until it fits, so the directory holds the process's latest
records, nearly as many as the bound takes, for as long as the engine runs. Error records are never deleted. A
record larger than the bound itself is refused (nothing deleted for it) and counted as above, and the records after
it are written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

ENV_MAX_BYTES = "REFCHECK_CAPTURE_MAX_BYTES"
ENV_ROLL = "REFCHECK_CAPTURE_ROLL"
MAX_BYTES = 1 << 50  # 1 PiB: a bound past any disk


class CaptureBudgetError(ValueError):
    """A capture byte budget that is not a whole number of bytes in range."""


class BudgetSpent(Exception):
    """A record refused: its process's byte budget is spent."""


class ByteBudget:
    """One process's byte budget (``limit`` None: unbounded, still counting what was charged)."""

    def __init__(self, limit: int | None = None, roll: bool = False) -> None:
        if limit is not None and not 1 <= limit <= MAX_BYTES:
            raise CaptureBudgetError(f"a capture byte budget is 1..{MAX_BYTES} bytes, got {limit}")
        if roll and limit is None:
            raise CaptureBudgetError(f"{ENV_ROLL} rolls the records within a byte budget: it needs {ENV_MAX_BYTES}")
        self.limit, self.roll = limit, roll
        self.used = 0  # bytes of the records charged and admitted
        self.spent = False  # a record was refused: every later one is (read without the lock by the hooks)
        self._lock = threading.Lock()  # the engine's thread (error records) and the writer's (batch records) charge

    def charge(self, nbytes: int, evict: Callable[[], int | None] | None = None) -> bool:
        """Admit a record of ``nbytes`` (True) or refuse it (False): past a plain budget, it and every later one; a
        rolling one first frees the bytes of the oldest records through ``evict`` (each call deletes one and returns
        its bytes; None: none is left) and refuses only a record the bound cannot hold."""
        with self._lock:
            if self.spent:
                return False
            if self.limit is not None:
                while self.roll and evict is not None and self.used + nbytes > self.limit >= nbytes:
                    freed = evict()
                    if freed is None:
                        break
                    self.used -= freed
                if self.used + nbytes > self.limit:
                    self.spent = not self.roll
                    return False
            self.used += nbytes
            return True


def parse(text: str | None) -> int | None:
    """The budget in bytes from ``REFCHECK_CAPTURE_MAX_BYTES``'s text (None or empty: no bound)."""
    if text is None or not str(text).strip():
        return None
    try:
        value = int(str(text).strip())
    except ValueError:
        raise CaptureBudgetError(f"a capture byte budget is a whole number of bytes, got {text!r}") from None
    ByteBudget(value)  # the range check
    return value


def rolls(text: str | None) -> bool:
    """Whether ``REFCHECK_CAPTURE_ROLL``'s text asks for a rolling budget (``1``, ``on``, ``yes``, ``true``)."""
    return str(text or "").strip().lower() in ("1", "on", "yes", "true")


def from_megabytes(mb: int | None, roll: bool = False) -> int | None:
    """``--capture-max-mb``'s MiB as bytes (None: no bound), with ``--capture-roll`` (``roll``); out of range, or a
    roll without a bound, is a :class:`CaptureBudgetError`."""
    if roll and mb is None:
        raise CaptureBudgetError("--capture-roll rolls the records within a byte budget: give --capture-max-mb MB")
    if mb is None:
        return None
    if not 1 <= mb <= MAX_BYTES >> 20:
        raise CaptureBudgetError(f"--capture-max-mb takes 1..{MAX_BYTES >> 20} MiB, got {mb}")
    return mb << 20
