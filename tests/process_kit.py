"""Watching processes from a test: whether one runs, waiting on a condition, a process that must end by a
signal (and what it was doing when it did not), and cleaning up a session a test started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def ended(proc: subprocess.Popen, timeout: float) -> int:
    """``proc``'s exit status once it ends within ``timeout``; otherwise a failure that says what it was doing:
    its signal masks (blocked, ignored, caught, pending) and each thread's state and kernel wait channel."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    lines = [f"pid {proc.pid} still runs {timeout:.0f} s after the signal"]
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        lines += [ln for ln in status if ln.startswith(("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk",
                                                        "SigIgn", "SigCgt"))]
        for task in sorted(Path(f"/proc/{proc.pid}/task").iterdir()):
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            lines.append(f"thread {task.name} {(task / 'comm').read_text().strip()} state {stat[0]} "
                         f"wchan {(task / 'wchan').read_text()} blocked {(task / 'status').read_text().split('SigBlk:')[1].split()[0]}")
    except (OSError, IndexError) as exc:
        lines.append(f"(/proc unreadable: {exc})")
    raise AssertionError("\n".join(lines))


def end_group(proc: subprocess.Popen) -> None:
    """Clean up whatever the test left: the session's process group (the script and any worker)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def group_members(pgid: int) -> list[int]:
    """The running processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid and alive(int(d.name)):
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return out


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (of any of its threads)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    return [int(c) for t in tasks for c in (t / "children").read_text().split()]
