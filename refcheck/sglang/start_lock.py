"""One SGLang engine starting at a time on a shared GPU, and its process session ended as one.

Contract: :func:`start_serialized` launches an engine's process and, when ``REFCHECK_SGLANG_START_LOCK``
names a file, holds an exclusive ``flock`` on it from before the launch until the engine reports a
stage in its result file (``started`` or ``failed``), the process exits, or ``timeout_s`` passes.
SGLang sizes its KV pool from the GPU memory free when it starts; two engines that start at the same
moment on one GPU both count memory the other is about to take, and the later one then refuses to
start ("Loaded weights leave no GPU memory for the KV cache"). Processes that share the lock file
start one after another and run side by side afterwards. Without the variable the process is launched
at once (nothing is locked). :func:`end_session` kills an engine process started in a session of its own
together with every process of its group (SGLang's schedulers), and reaps it.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ENV_START_LOCK = "REFCHECK_SGLANG_START_LOCK"


def reported_stage(result: Path) -> str | None:
    """The stage the engine's child last wrote to ``result`` (None: nothing readable yet)."""
    try:
        stage = json.loads(result.read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return str(stage) if stage else None


def start_serialized(launch: Callable[[], subprocess.Popen[bytes]], result: Path, timeout_s: float,
                     poll_s: float = 0.2, lock_path: str | None = None) -> subprocess.Popen[bytes]:
    """``launch()`` under the start lock (module docstring); returns the process, still running unless it failed."""
    path = lock_path if lock_path is not None else os.environ.get(ENV_START_LOCK)
    if not path:
        return launch()
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            proc = launch()
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and reported_stage(result) is None and time.monotonic() < deadline:
                time.sleep(poll_s)
            return proc
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def end_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the process group ``proc`` leads (it was started with ``start_new_session``), then reap ``proc``;
    a group already gone is not an error."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
