"""An opt-in torch-profiler window over a scheduler process's traced batches: where the capture's cost goes.

Contract: with ``REFCHECK_CAPTURE_PROFILE=FIRST:COUNT`` (:data:`ENV_PROFILE`) in the engine's environment,
:func:`tick` (called by the ``run_batch`` hook at every traced batch) starts :mod:`torch.profiler` (CPU and
CUDA activities, every thread) at the FIRST-th traced batch of the process (0-based) and stops it after COUNT
more, writing ``profile-rank{r}-pid{pid}.txt`` into the capture directory: the window's wall time and
batches, then the operator table sorted by device time and by CPU time, in which :func:`section` labels the
hooks' own parts (``refcheck.*``) beside SGLang's, then what the CUDA caching allocator did over the window
(:func:`allocator_text`: retries after a failed ``cudaMalloc``, out-of-memory errors, ``cudaMalloc`` and ``cudaFree``
calls, the memory reserved and free at its ends), read without a device synchronisation of its own. Without the
variable, :func:`tick` returns at once and :func:`section` is a null context: the capture runs as if this module
were absent. A malformed value is reported once as a capture error by the caller (:class:`ValueError`), and the
capture runs unprofiled.
:func:`host_speed` times a clock read and a fixed Python loop, once per process, for its status file.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

ENV_PROFILE = "REFCHECK_CAPTURE_PROFILE"


def window(value: str | None) -> tuple[int, int] | None:
    """``FIRST:COUNT`` -> (first, count); None for no profiling; ValueError for a malformed value."""
    if not value:
        return None
    try:
        first, count = (int(x) for x in value.split(":"))
    except ValueError:
        raise ValueError(f"{ENV_PROFILE}={value!r}: expected FIRST:COUNT (two integers)") from None
    if first < 0 or count < 1:
        raise ValueError(f"{ENV_PROFILE}={value!r}: FIRST must be >= 0 and COUNT >= 1")
    return first, count


class _State:
    def __init__(self) -> None:
        self.window: tuple[int, int] | None = None
        self.read = False
        self.batches = 0
        self.prof: Any = None
        self.t0 = 0.0
        self.allocator: dict[str, int] = {}  # allocator_stats() at the window's start


_state = _State()


def _window() -> tuple[int, int] | None:
    if not _state.read:
        _state.read = True
        _state.window = window(os.environ.get(ENV_PROFILE))
    return _state.window


def tick(out_dir: Path, tp_rank: int) -> None:
    """One traced batch begins: start or stop the window (module docstring)."""
    win = _window()
    if win is None:
        return
    first, count = win
    k = _state.batches
    _state.batches += 1
    if k == first:
        import torch
        import torch.profiler as tp

        acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        _state.allocator = allocator_stats()
        _state.prof = tp.profile(activities=acts)
        _state.prof.__enter__()
        _state.t0 = time.perf_counter()
    elif k == first + count and _state.prof is not None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the window's device work is in its wall time
        wall = time.perf_counter() - _state.t0
        _state.prof.__exit__(None, None, None)
        avg = _state.prof.key_averages()
        text = (f"profiled window: traced batches {first}..{first + count - 1}, {wall:.4f} s wall "
                f"({1000 * wall / count:.3f} ms per batch)\n\n## by device time\n"
                + avg.table(sort_by="self_device_time_total", row_limit=45)
                + "\n\n## by CPU time\n" + avg.table(sort_by="cpu_time_total", row_limit=60)
                + "\n\n" + allocator_text(_state.allocator, allocator_stats(), count))
        (Path(out_dir) / f"profile-rank{tp_rank}-pid{os.getpid()}.txt").write_text(text)
        _state.prof = None


#: the CUDA caching allocator's counters (``torch.cuda.memory_stats`` keys) whose change over a window is reported:
#: allocations retried after freeing the cache (each a device-wide wait), out-of-memory errors, device allocations and
#: frees
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")


def allocator_stats() -> dict[str, int]:
    """The allocator's counters (:data:`ALLOCATOR_COUNTERS`), its reserved and allocated bytes, and the device's free
    and total bytes; empty without CUDA. Host reads only: no device synchronisation."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {**{k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS},
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "free_bytes": int(free), "total_bytes": int(total)}


def allocator_text(before: dict[str, int], after: dict[str, int], batches: int) -> str:
    """What the allocator did between two :func:`allocator_stats` over ``batches`` traced batches: each counter's
    change (and per batch), then the reserved, allocated and free memory at both ends."""
    if not before or not after:
        return "## the device allocator\nno CUDA device: nothing to report\n"
    mib = 2.0 ** 20
    lines = ["## the device allocator over the window"]
    for k in ALLOCATOR_COUNTERS:
        d = after.get(k, 0) - before.get(k, 0)
        lines.append(f"{k}: +{d} ({d / max(batches, 1):.2f} per batch)")
    for k in ("reserved_bytes", "allocated_bytes", "free_bytes"):
        lines.append(f"{k[:-6]} MiB: {before.get(k, 0) / mib:.0f} -> {after.get(k, 0) / mib:.0f}")
    lines.append(f"device total MiB: {after.get('total_bytes', 0) / mib:.0f}")
    return "\n".join(lines) + "\n"


def host_speed(reads: int = 2000, loops: int = 5) -> dict[str, float]:
    """How fast this process's host runs the hooks' kind of work, measured once per process for its status file:
    a clock read (``perf_counter``, the hooks read it several times per batch) in nanoseconds, and a fixed Python
    loop (10 000 additions) in microseconds, each the median of its repeats. The capture's costs in the ledger are
    read against these: the same hooks cost several times more on a slower host."""
    per_read = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(reads):
            time.perf_counter()
        per_read.append((time.perf_counter_ns() - t0) / reads)
    loop = []
    for _ in range(loops):
        t0 = time.perf_counter_ns()
        total = 0
        for i in range(10_000):
            total += i
        loop.append((time.perf_counter_ns() - t0) / 1000)
    return {"clock_read_ns": round(sorted(per_read)[len(per_read) // 2], 1),
            "python_loop_us": round(sorted(loop)[len(loop) // 2], 1)}


_NOTHING = nullcontext()  # reusable: what section gives outside a window, at every batch


def section(name: str) -> AbstractContextManager[Any]:
    """A labelled part of the hooks in the profiler's table while a window is open, else nothing."""
    if _state.prof is None:
        return _NOTHING
    import torch.profiler as tp

    return tp.record_function(f"refcheck.{name}")
