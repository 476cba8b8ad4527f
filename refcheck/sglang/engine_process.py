"""The SGLang engine's process, from refcheck's side: its job written, the process started and waited on, each part's
outcome read.

Contract: :func:`run_job` writes one job file per part (a workload's requests, rids, passes and result path,
:meth:`refcheck.sglang.runner.SGLangRunner._job`; the first part's job also holds the engine's arguments and the
other parts' job files, ``more``, each of which names the first's, ``engine_job``), starts
``python -m refcheck.sglang.child`` on the first under the start lock (:mod:`refcheck.sglang.start_lock`), in a
session of its own with its output in the capture directory's ``engine.log``, waits for it at most ``timeout_s``,
and ends its whole session (SGLang's schedulers with it) when it did not exit cleanly or refcheck is interrupted.
It returns each part's outcome (:func:`outcome`): its ``result.json`` as the child last wrote it, or a failure
naming the stage it reached and the scheduler's own error (:func:`log_error`) where the log holds one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_job(cdir: Path, env: dict[str, str], engine_kwargs: dict[str, Any], parts: list[tuple[Path, dict[str, Any]]],
            timeout_s: float) -> list[dict[str, Any]]:
    """The engine's process over ``parts`` (each a directory for its ``job.json`` and the part's job, whose
    ``result`` lies in that directory), run in turn on one engine; each part's outcome, in order."""
    from refcheck.lifetime import ended_on_signal
    from refcheck.sglang.start_lock import end_session, start_serialized

    jobs = [d / "job.json" for d, _ in parts]
    results = [Path(job["result"]) for _, job in parts]
    log = cdir / "engine.log"
    for k, ((_, job), path, result) in enumerate(zip(parts, jobs, results)):
        result.unlink(missing_ok=True)
        # the first part's job starts the engine and names the others; each other part names the first's
        more = {"engine_kwargs": engine_kwargs, "more": [str(j) for j in jobs[1:]]} if k == 0 else {"engine_job": str(jobs[0])}
        path.write_text(json.dumps({**more, **job}))
    started: list[subprocess.Popen[bytes]] = []

    def launch() -> subprocess.Popen[bytes]:
        # a session of its own: the engine's schedulers go down with it (end_session), and a signal to refcheck's
        # process group does not reach SGLang before refcheck has decided
        started.append(subprocess.Popen([sys.executable, "-m", "refcheck.sglang.child", str(jobs[0])], env=env,
                                        stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        return started[-1]

    with log.open("w") as f, ended_on_signal(lambda: [end_session(p) for p in started]):
        proc = start_serialized(launch, results[0], timeout_s)
        rc: int | None = None
        try:
            rc = proc.wait(timeout=timeout_s)  # subprocess's timed wait polls: handlers run
        except subprocess.TimeoutExpired:
            pass
        finally:  # a hang, an exception leaving refcheck, or a child that died and may have left schedulers
            if rc != 0:
                end_session(proc)
    reason = f"timed out after {timeout_s:.0f} s" if rc is None else f"engine process exited with code {rc}"
    first = outcome(results[0], reason, log, timed_out=rc is None)
    return [first, *(outcome(r, reason, log, first, k, rc is None) for k, r in enumerate(results[1:], 1))]


def outcome(result: Path, reason: str, log: Path, first: dict[str, Any] | None = None, part: int = 0,
            timed_out: bool = False) -> dict[str, Any]:
    """Part ``part``'s last reported stage (its ``result.json``): ``done`` as written; else ``failed``, at the stage
    it reached, with the scheduler's own error (it says more than the main process's), else ``reason``. The error is
    the last of the part's stretch of the log: an earlier part's error is not this one's, so a part that hung reports
    its timeout. Where the engine's process died (not ``timed_out``) and the stretch holds none, the schedulers may have
    printed the cause before the part's marker: the log's last error is taken. A later part the engine never began (``first``: the first part's outcome) failed where the first did, or,
    once that one ran, while generating: the engine process ended before it (the log's last error, else
    ``reason``, says why)."""
    run = json.loads(result.read_text()) if result.is_file() else {}
    stage = run.get("stage")
    if stage == "done":
        return run
    lines = _lines(log)  # read once: the part's stretch and the whole log's last error both come from it
    last_error = _last_error(lines)
    scheduler_error = _last_error(_stretch(lines, part)) or (None if timed_out else last_error)
    if stage is None and first is not None:
        if first.get("failed_at") in ("import", "start"):
            return first
        return {"stage": "failed", "failed_at": "generate", "start_s": first.get("start_s"),
                "sglang": first.get("sglang"),
                "error": f"the engine process ended before this part began ({last_error or reason})"}
    if stage == "started":  # died or hung while generating
        return {**run, "stage": "failed", "failed_at": "generate", "error": scheduler_error or reason}
    if stage == "failed" and run.get("failed_at") == "generate":
        return run
    detail = scheduler_error or run.get("error") or reason
    return {**run, "stage": "failed", "failed_at": run.get("failed_at", "start"), "error": detail}


def log_error(log: Path, limit: int = 600, part: int | None = None) -> str | None:
    """The last error line of an engine log (SGLang's schedulers print tracebacks there); with ``part``, of that part's
    stretch of it: from the line the child printed as it began (:data:`refcheck.sglang.child.PART_MARKER`; the
    first part's from the log's start) to the next part's (none for a later part that never began)."""
    lines = _lines(log)
    return _last_error(lines if part is None else _stretch(lines, part), limit)


def _lines(log: Path) -> list[str]:
    """The engine log's lines, stripped (none where there is no log)."""
    return [ln.strip() for ln in log.read_text(errors="replace").splitlines()] if log.is_file() else []


def _last_error(lines: list[str], limit: int = 600) -> str | None:
    """The last error line among ``lines`` (:func:`log_error`), cut to ``limit`` characters."""
    hits = [ln for ln in lines if ln and (ln.split(":", 1)[0].endswith(("Error", "Exception")) or "Error:" in ln)]
    if not hits:
        return None
    return hits[-1] if len(hits[-1]) <= limit else hits[-1][: limit - 3] + "..."


def _stretch(lines: list[str], part: int) -> list[str]:
    """Part ``part``'s lines of the engine's log (:func:`log_error`)."""
    from refcheck.sglang.child import PART_MARKER

    begins, ends = (PART_MARKER.format(k) for k in (part, part + 1))
    at = {mark: next((i for i, ln in enumerate(lines) if ln.endswith(mark)), None) for mark in (begins, ends)}
    if part and at[begins] is None:
        return []  # the engine never began it
    start = at[begins] if part else 0  # the first part's stretch holds the engine's start-up too
    end = at[ends]
    return lines[start:len(lines) if end is None else end]
