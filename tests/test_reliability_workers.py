"""Worker processes end with the process that started them (refcheck/parallel.py: worker_pool): they stay in
its process group, and SIGTERM or SIGINT to it, or its death by SIGKILL, leaves no worker behind, even one
blocked in its task. Each test runs the pool in a real subprocess (its own session, killed as a group after
the test) and watches the worker pids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_kit import alive, children, end_group, ended, wait_for  # tests/ is on sys.path under pytest

from refcheck.errors import EXIT_WORKER
from refcheck.prompts import BUILTIN_PROMPTS

ROOT = Path(__file__).resolve().parents[1]
START_S = 120.0  # spawned workers import torch: slow on a loaded 2-core machine
GONE_S = 8.0  # SIGTERM, then SIGKILL after refcheck.parallel.GRACE_S (3 s), then the kernel's own time

SCRIPT = '''
import os, sys, time
from pathlib import Path


def block(out: str, i: int) -> None:
    """A task that never ends: its pid and process group in out/PID.json, then sleep."""
    Path(out, f"{os.getpid()}.tmp").write_text(f'{{"pgid": {os.getpgid(0)}}}')
    os.replace(Path(out, f"{os.getpid()}.tmp"), Path(out, f"{os.getpid()}.json"))
    while True:
        time.sleep(1)


def idle(out: str, i: int) -> None:
    while True:
        time.sleep(1)


def die(out: str, i: int) -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def slow(out: str, i: int) -> None:  # this process's own jobs: the workers take theirs meanwhile
    time.sleep(1)


if __name__ == "__main__":
    from refcheck import parallel

    out, kind = sys.argv[1], sys.argv[2]
    if kind == "a_worker_dies":  # the workers' jobs end by SIGKILL (as the out-of-memory killer's do)
        parallel.run_queue(die, [(out, i) for i in range(3)], 3, inline=slow)
    elif kind == "signal_in_a_thread":  # SIGTERM handed to a thread other than the main one, 2 s after the workers run
        import signal, threading

        def later() -> None:
            while len(list(Path(out).glob("*.json"))) < 2:
                time.sleep(0.1)
            time.sleep(2)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

        threading.Thread(target=later, daemon=True).start()
        parallel.run_parallel(block, [(out, i) for i in range(2)], 2)
    elif kind == "ending_fails":  # ending the workers raises: the signal still takes its course
        def broken(procs, grace=0.0):
            raise OSError("ending the workers failed")

        parallel.end_processes = broken
        parallel.run_parallel(block, [(out, i) for i in range(2)], 2)
    elif kind == "run_parallel":
        parallel.run_parallel(block, [(out, i) for i in range(2)], 2)
    else:  # run_queue: this process runs one job inline, two workers the others
        parallel.run_queue(block, [(out, i) for i in range(3)], 3, inline=idle)
'''


def _start(tmp_path: Path, kind: str) -> tuple[subprocess.Popen, dict[int, int]]:
    """The pool script running ``kind`` in its own session, and its workers' pid -> process group."""
    script = tmp_path / "pool_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "pids"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(out), kind], cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's refcheck
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: len(list(out.glob("*.json"))) == 2 or proc.poll() is not None, START_S, "two workers")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    return proc, {int(p.stem): json.loads(p.read_text())["pgid"] for p in out.glob("*.json")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["run_parallel", "run_queue"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_parent_ends_every_worker(tmp_path: Path, kind: str, sig: signal.Signals) -> None:
    proc, workers = _start(tmp_path, kind)
    try:
        assert set(workers.values()) == {os.getpgid(proc.pid)}, "the workers are in the parent's process group"
        proc.send_signal(sig)
        ended(proc, GONE_S + 10)
        if sig == signal.SIGTERM:
            assert proc.returncode == -signal.SIGTERM  # killed by the signal: a shell reports exit 143
        else:
            assert proc.returncode in (-signal.SIGINT, 1), proc.returncode  # KeyboardInterrupt
        wait_for(lambda: not any(alive(pid) for pid in workers), GONE_S, f"workers {sorted(workers)} to end")
    finally:
        end_group(proc)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["signal_in_a_thread", "ending_fails"])
def test_a_sigterm_ends_the_parent_whatever_happens_around_its_handler(tmp_path: Path, kind: str) -> None:
    """``signal_in_a_thread``: the kernel may hand a process's SIGTERM to any of its threads (the script sends it to
    one of its own); Python runs the handler in the main thread, which waits on its workers in timed steps
    (refcheck.lifetime.POLL_S), so it still runs. ``ending_fails``: the handler's own failure does not swallow the
    signal; the workers, left running, leave on their own (they watch their parent). Either way the parent ends
    by the signal and no worker stays."""
    proc, workers = _start(tmp_path, kind)
    try:
        if kind == "ending_fails":
            proc.send_signal(signal.SIGTERM)
        assert ended(proc, GONE_S + 10) == -signal.SIGTERM
        wait_for(lambda: not any(alive(pid) for pid in workers), GONE_S, f"workers {sorted(workers)} to end")
    finally:
        end_group(proc)


@pytest.mark.slow
def test_a_worker_killed_in_a_gate_like_queue_is_a_typed_error(tmp_path: Path) -> None:
    """run_queue (the gate's): a worker's death is a WorkerDiedError naming how it ended, not a BrokenProcessPool."""
    script = tmp_path / "pool_script.py"
    script.write_text(SCRIPT)
    (tmp_path / "pids").mkdir()
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "pids"), "a_worker_dies"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=START_S)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("refcheck.errors.WorkerDiedError: a worker process died"), proc.stderr
    assert "killed by SIGKILL" in last and "no verdict was given" in last


@pytest.mark.slow
def test_workers_leave_when_the_parent_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the parent no chance to end its workers: they notice it is gone and leave."""
    proc, workers = _start(tmp_path, "run_parallel")
    try:
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in workers), GONE_S, f"workers {sorted(workers)} to end")
    finally:
        end_group(proc)


def _spawned_workers(pid: int) -> list[int]:
    """The children of ``pid`` that are multiprocessing's spawned workers (not its resource tracker)."""
    out = []
    for child in children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmd:
            out.append(child)
    return out


def _two_long_prompts(tmp_path: Path) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(BUILTIN_PROMPTS.read_text().splitlines(keepends=True)[:2]))
    return ["--engine", "reference", "--drafter", "scripted", "--prompts", str(prompts), "--max-new-tokens", "1500",
            "--workers", "2"]


def _sharded_replay(_tmp_path: Path) -> list[str]:
    return ["--against", str(ROOT / "golden" / "hybrid-b64.arrow"), "--ref-shards", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("args", [_two_long_prompts, _sharded_replay], ids=["workers", "ref-shards"])
def test_a_signal_to_a_diff_with_two_processes_leaves_none(tmp_path: Path, args, sig: signal.Signals) -> None:
    """The real command, ``refcheck diff --workers 2`` (data-parallel: refcheck/parallel.py) or ``--ref-shards 2``
    (the reference split by layers: torch's spawned ranks), signalled as soon as both processes exist (a rank may
    still be importing torch, or be blocked in its process group's rendezvous): it ends by the signal and neither
    process stays. SIGTERM: the command ends them first; SIGKILL leaves it no chance, and each leaves on its own."""
    cmd = [sys.executable, "-m", "refcheck", "diff", "--mode", "replay", *args(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(_spawned_workers(proc.pid)) == 2 or proc.poll() is not None, START_S, "two workers")
        workers = _spawned_workers(proc.pid)
        assert proc.poll() is None and len(workers) == 2
        assert {os.getpgid(w) for w in workers} == {os.getpgid(proc.pid)}
        proc.send_signal(sig)
        ended(proc, GONE_S + 10)
        assert proc.returncode == -sig
        wait_for(lambda: not any(alive(pid) for pid in workers), GONE_S, f"workers {workers} to end")
    finally:
        end_group(proc)


@pytest.mark.slow
@pytest.mark.parametrize("args", [_two_long_prompts, _sharded_replay], ids=["workers", "ref-shards"])
def test_a_diff_whose_worker_is_killed_exits_with_its_own_code(tmp_path: Path, args) -> None:
    """``refcheck diff --workers 2`` or ``--ref-shards 2`` whose first process is SIGKILLed: exit 7 (EXIT_WORKER), one
    line saying which process died and how, no traceback (a failing verdict, exit 1, would blame the engine)."""
    cmd = [sys.executable, "-m", "refcheck", "diff", "--mode", "replay", *args(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: len(_spawned_workers(proc.pid)) == 2 or proc.poll() is not None, START_S, "two workers")
        os.kill(sorted(_spawned_workers(proc.pid))[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=GONE_S + 10)
        last = err.strip().splitlines()[-1]
        assert proc.returncode == EXIT_WORKER and "Traceback" not in err, err
        assert last.startswith("refcheck: error: ") and "died while it ran (" in last and "killed by SIGKILL" in last, err
    finally:
        end_group(proc)


PARENT = """
import os, subprocess, sys, time
from pathlib import Path

out, asked, cmd = Path(sys.argv[1]), sys.argv[2] == "asked", sys.argv[3:]
env = {**os.environ, "REFCHECK_END_WITH": str(os.getpid())} if asked else dict(os.environ)
child = subprocess.Popen([sys.executable, "-m", "refcheck", *cmd], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
(out / "child.pid").write_text(str(child.pid))
time.sleep(3600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("asked", [True, False], ids=["asked", "not-asked"])
def test_a_command_another_refcheck_started_leaves_with_it_when_asked(tmp_path: Path, asked: bool) -> None:
    """A refcheck command whose REFCHECK_END_WITH names its parent (the settings matrix's diffs) leaves within a
    second of that parent's SIGKILL; one not asked (a command run by hand) keeps running."""
    (tmp_path / "parent.py").write_text(PARENT)
    cmd = ["diff", "--mode", "replay", *_two_long_prompts(tmp_path)[:-2]]  # one process: the command itself
    proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path), "asked" if asked else "no",
                             *cmd], cwd=ROOT, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid_file = tmp_path / "child.pid"
    try:
        wait_for(lambda: pid_file.is_file() and pid_file.read_text() != "", START_S, "the command to start")
        child = int(pid_file.read_text())
        time.sleep(3)  # past the command's start (its entry reads the variable first thing)
        assert alive(child), "the command runs (a long diff) until its parent is killed"
        proc.kill()
        proc.wait(timeout=10)
        if asked:
            wait_for(lambda: not alive(child), GONE_S, f"the command {child} to leave")
        else:
            time.sleep(3)
            assert alive(child), "a command not asked to end with its parent keeps running"
    finally:
        end_group(proc)

