"""refcheck.sglang.start_lock: engines sharing REFCHECK_SGLANG_START_LOCK start one at a time."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time

from refcheck.sglang.start_lock import ENV_START_LOCK, reported_stage, start_serialized


def _child(result, delay_s: float, then_s: float, stage: str | None = "started") -> subprocess.Popen[bytes]:
    write = f"open({str(result)!r}, 'w').write('{{\"stage\": \"{stage}\"}}')" if stage else "pass"
    code = f"import time; time.sleep({delay_s}); {write}; time.sleep({then_s})"
    return subprocess.Popen([sys.executable, "-c", code])


def _free(lock) -> bool:
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def test_without_the_variable_the_engine_is_launched_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_START_LOCK, raising=False)
    t0 = time.monotonic()
    proc = start_serialized(lambda: _child(tmp_path / "r.json", 1.0, 0.0), tmp_path / "r.json", 30)
    assert time.monotonic() - t0 < 0.8 and proc.poll() is None
    proc.wait()


def test_the_lock_is_held_until_the_engine_reports_a_stage_and_no_longer(tmp_path):
    lock, result = tmp_path / "start.lock", tmp_path / "r.json"
    proc = start_serialized(lambda: _child(result, 0.5, 3.0), result, 30, poll_s=0.05, lock_path=str(lock))
    assert reported_stage(result) == "started"
    assert proc.poll() is None  # returned at the report, not at the exit
    assert _free(lock)
    proc.kill()
    proc.wait()


def test_a_second_engine_waits_for_the_first_to_start(tmp_path):
    lock = tmp_path / "start.lock"
    launched: dict[str, float] = {}

    def first() -> None:
        p = start_serialized(lambda: _child(tmp_path / "a.json", 1.0, 0.0), tmp_path / "a.json", 30, poll_s=0.05,
                             lock_path=str(lock))
        launched["first_started"] = time.monotonic()
        p.wait()

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.3)

    def second() -> subprocess.Popen[bytes]:
        launched["second"] = time.monotonic()
        return _child(tmp_path / "b.json", 0.0, 0.0)

    start_serialized(second, tmp_path / "b.json", 30, poll_s=0.05, lock_path=str(lock)).wait()
    t.join()
    assert launched["second"] >= launched["first_started"] - 0.1


def test_an_engine_that_exits_without_a_report_releases_the_lock(tmp_path):
    lock, result = tmp_path / "start.lock", tmp_path / "r.json"
    proc = start_serialized(lambda: _child(result, 0.2, 0.0, stage=None), result, 30, poll_s=0.05, lock_path=str(lock))
    assert proc.poll() is not None and reported_stage(result) is None and _free(lock)
