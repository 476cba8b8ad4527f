"""The timing plugin of scripts/bench_sglang_verify.py: CUDA-event spans inside SGLang's scheduler.

Contract: :func:`register_timing` is an ``sglang.srt.plugins`` entry point (declared by
:func:`install_timing_plugin` in a throw-away ``.dist-info``); in a scheduler process, with
``ENV_TIMES`` set, it wraps ``ModelRunner.forward`` (TARGET_VERIFY forwards: ``verify_forward``, with
whether the CUDA graph replayed) and ``NGRAMWorker.forward_batch_generation`` (decode steps:
``spec_step``) and appends each finished span to the ``ENV_TIMES`` file as a JSON line. Timing never
raises into SGLang and records nothing during graph capture. :func:`attribute_times` groups the spans
by the pass whose wall-clock window holds them; :func:`span_stats` summarises a list of spans.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV_TIMES = "BENCH_SGLANG_VERIFY_TIMES"  # the plugin appends its JSON lines here (unset: inert)
PLUGIN = "bench_sglang_verify_timing"

_pending: list[tuple[str, float, Any, Any, bool | None]] = []
_lock = threading.Lock()
_times_path: str | None = None


def _new_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def flush_times() -> None:
    """Append every finished span (its end event has completed) to the times file, one JSON line each."""
    if _times_path is None:
        return
    with _lock:
        done = [p for p in _pending if p[3].query()]
        if not done:
            return
        finished = {id(p) for p in done}
        _pending[:] = [p for p in _pending if id(p) not in finished]
    with open(_times_path, "a") as f:
        for kind, t, start, end, graphed in done:
            f.write(json.dumps({"kind": kind, "t": t, "ms": start.elapsed_time(end), "graphed": graphed}) + "\n")


def _safe_flush() -> None:
    try:
        flush_times()
    except Exception:  # noqa: BLE001 - timing must never break SGLang
        pass


def timed(kind: str, call: Any, graphed_of: Any = None) -> Any:
    """``call()`` between two CUDA events on the current stream; never raises for the timing itself."""
    try:
        events = None if _capturing() else (_new_event(), _new_event())
    except Exception:  # noqa: BLE001 - timing must never break SGLang
        events = None
    if events is None:
        return call()
    t = time.time()
    events[0].record()
    out = call()
    try:
        events[1].record()
        graphed = bool(graphed_of(out)) if graphed_of is not None else None
        with _lock:
            _pending.append((kind, t, events[0], events[1], graphed))
    except Exception:  # noqa: BLE001
        pass
    return out


def _verify_forward_hook(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    def call() -> Any:
        return original(runner, forward_batch, *args, **kwargs)

    _safe_flush()  # every forward, the prompt's too: spans of the steps before are written out
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return call()
    return timed("verify_forward", call, lambda out: getattr(out, "can_run_graph", False))


def _spec_step_hook(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    def call() -> Any:
        return original(worker, batch, *args, **kwargs)

    _safe_flush()
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_decode():  # the prompt's extend batch goes through here too
        return call()
    return timed("spec_step", call)


def register_timing() -> None:
    """The plugin entry point: AROUND hooks in SGLang's scheduler processes when ENV_TIMES is set."""
    global _times_path
    import multiprocessing

    if not os.environ.get(ENV_TIMES) or multiprocessing.parent_process() is None:
        return  # not asked for, or the engine's main process (no model runs there)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _times_path = os.environ[ENV_TIMES]
    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.forward", _verify_forward_hook,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.speculative.ngram_worker.NGRAMWorker.forward_batch_generation",
                          _spec_step_hook, HookType.AROUND)


def install_timing_plugin(root: Path) -> dict[str, str]:
    """A minimal distribution declaring :func:`register_timing`; returns the child's environment
    (its directory and scripts/ first on PYTHONPATH: SGLang's spawned schedulers import the entry point)."""
    info = root / f"{PLUGIN}-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PLUGIN} = bench_sglang_timing:register_timing\n")
    env = dict(os.environ)
    path = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in (str(HERE), str(ROOT)) if p not in path])
    return env


def attribute_times(path: Path, windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, list]]:
    """The plugin's spans grouped by the pass whose wall-clock window holds their start."""
    out: dict[str, dict[str, list]] = {name: {"verify_forward": [], "spec_step": [], "graphed": []}
                                       for name in windows}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        name = next((n for n, (a, b) in windows.items() if a <= rec["t"] <= b), None)
        if name is None or rec["kind"] not in ("verify_forward", "spec_step"):
            continue
        out[name][rec["kind"]].append(rec["ms"])
        if rec["kind"] == "verify_forward":
            out[name]["graphed"].append(rec["graphed"])
    return out



def span_stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "n": len(xs)}
