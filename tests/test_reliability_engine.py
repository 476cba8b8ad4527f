"""An SGLang engine process never outlives the refcheck that started it (refcheck/sglang/engine_process.py,
refcheck/sglang/child.py, refcheck/lifetime.py). The engine runs in a session of its own, so a signal to
refcheck's process group does not reach it; instead SIGTERM or SIGINT to refcheck ends the engine's whole
session (its schedulers included) before taking its course, and SIGKILL, which refcheck cannot answer, is
answered by the engine itself, which watches its parent. Each test runs the runner in a real subprocess against
the stand-in SGLang (tests/fake_sglang, mode ``hang``: a stand-in scheduler process in the engine's group, and a
generate that never returns) and watches the engine's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_kit import alive, children, end_group, ended, group_members, wait_for  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fake_sglang"
START_S = 120.0  # the runner and the engine process import torch: slow on a loaded 2-core machine
GONE_S = 10.0  # the parent watch's period (0.5 s) and the kernel's own time, with room for a loaded machine

SCRIPT = '''
import os, sys
from pathlib import Path

fake, out = sys.argv[1], Path(sys.argv[2])
sys.path.insert(0, fake)
os.environ["PYTHONPATH"] = os.pathsep.join([fake, os.environ.get("PYTHONPATH", "")])  # the engine's sglang
os.environ["FAKE_SGLANG_MODE"] = "hang"
os.environ["FAKE_SGLANG_SCHEDULER_PID"] = str(out / "scheduler.pid")
import torch

torch.cuda.is_available = lambda: True  # the stand-in needs no GPU
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.runner import SGLangRunner

SGLangRunner(EngineSpec(dtype="bfloat16", device="cuda", max_new_tokens=3), "NONE", capture=False,
             capture_dir=out / "capture", timeout_s=600).trace(load_prompts()[:1])
'''


def _start(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    """The runner's process (its own session), its engine process (which leads the engine's group) and the
    stand-in scheduler, once the engine is generating."""
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "script.py"), str(FAKE), str(tmp_path)], cwd=ROOT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pid_file = tmp_path / "scheduler.pid"
    wait_for(lambda: (pid_file.is_file() and pid_file.read_text().strip() != "") or proc.poll() is not None, START_S,
             "the engine to generate")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    engines = [c for c in children(proc.pid) if b"refcheck.sglang.child" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, engines
    assert os.getpgid(engines[0]) == engines[0] != os.getpgid(proc.pid), "the engine leads a group of its own"
    scheduler = int(pid_file.read_text())
    assert os.getpgid(scheduler) == engines[0]
    return proc, engines[0], scheduler


def _clean(proc: subprocess.Popen, engine: int) -> None:
    end_group(proc)
    try:
        os.killpg(engine, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_engine_and_its_schedulers_end_with_the_runner(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or SIGINT: the runner ends the engine's session, then ends by the signal (SIGINT: by its
    KeyboardInterrupt). SIGKILL: the engine sees its parent gone and ends its own session."""
    proc, engine, scheduler = _start(tmp_path)
    try:
        proc.send_signal(sig)
        code = ended(proc, GONE_S + 10)
        assert code == -sig or (sig == signal.SIGINT and code == 1), code  # 1: KeyboardInterrupt's traceback
        wait_for(lambda: not group_members(engine), GONE_S, f"the engine's group {engine} to end")
        assert not alive(scheduler) and not alive(engine)
    finally:
        _clean(proc, engine)
