"""How the processes refcheck starts end with it.

Contract: :func:`ended_on_signal` runs ``end()`` (ending the processes this one started) when SIGTERM or SIGINT
reaches this process while its block runs in the main thread. The signal then takes the course the handler
before this one gives it: SIGTERM's default ends the process (exit 143), SIGINT raises ``KeyboardInterrupt``.
The signal is raised again even when ``end()`` fails. Only the main thread can set handlers; elsewhere, and for
a signal set to be ignored (an inherited ``SIG_IGN``, as under ``nohup``), nothing changes. Python runs a
handler in the main thread only, and a signal the kernel hands to another thread does not wake an untimed
wait, so a main thread that waits inside the block waits in steps of at most :data:`POLL_S`.
:func:`watch_parent` is the other half, for a process refcheck started: a daemon thread that calls ``leave()``
as soon as its parent is gone, whatever ended it (SIGKILL included), within :data:`POLL_S`. A refcheck command
that another refcheck process starts (the settings matrix's diffs) is told so by :data:`ENV_END_WITH`, the
starting process's pid (:func:`end_with`), and leaves with it (:func:`end_with_parent_if_asked`, at the command
line's entry); a process the variable does not name as its parent (a grandchild that inherited it, a command run
by hand) ignores it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

ENV_END_WITH = "REFCHECK_END_WITH"
POLL_S = 0.5  # longest untimed stretch of a main thread that waits inside ended_on_signal; the parent watch's period
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def ended_on_signal(end: Callable[[], None]) -> Iterator[None]:
    """While the block runs: SIGTERM / SIGINT to this process call ``end()`` first, then take their course
    (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in _ENDING_SIGNALS}
    mine = [sig for sig, old in previous.items() if old is not signal.SIG_IGN and old is not None]  # None: set outside Python

    def restore() -> None:
        for sig in mine:
            signal.signal(sig, previous[sig])

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        try:
            end()
        finally:  # the signal takes its course whatever ending the processes met
            restore()
            signal.raise_signal(signum)

    for sig in mine:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        restore()


def watch_parent(leave: Callable[[], None], parent: int | None = None) -> None:
    """Start a daemon thread that calls ``leave()`` once this process's parent is not ``parent`` (default: the
    parent now), then ends the process if ``leave()`` returned."""
    expected = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(POLL_S)
        try:
            leave()
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="refcheck-parent-watch", daemon=True).start()


def end_with() -> dict[str, str]:
    """The environment entry that makes a refcheck command this process starts leave when this process is gone."""
    return {ENV_END_WITH: str(os.getpid())}


def end_with_parent_if_asked() -> None:
    """Leave when the parent is gone, if :data:`ENV_END_WITH` names this process's parent (module docstring); leave at
    once if the process it names is gone already (it died before this one got here)."""
    named = os.environ.get(ENV_END_WITH)
    if not named:
        return
    if named == str(os.getppid()):
        watch_parent(lambda: None)
        return
    try:
        os.kill(int(named), 0)  # alive (this is a grandchild that inherited the variable): nothing to do
    except ProcessLookupError:
        os._exit(1)
    except (ValueError, PermissionError, OverflowError):
        pass
