"""Data-parallel diffs: split prompts (or golden cases) over worker processes, merge the results.

Contract: :func:`split` deals items round-robin over ``n`` shards, keeping their order within each
shard; :func:`merge_traces` puts shard traces back in the original prompt order and checks that
they come from the same engine, models and settings (provenance equal up to the device and the
creation time); :func:`merge_reports` adds findings and check counts. A diff run over ``n`` workers
therefore gives the same trace and the same findings as a one-process run (tests/test_parallel.py).
Workers are spawned processes (CUDA-safe); worker ``i`` uses ``cuda:i`` when the device is CUDA, so
``--workers N`` on an N-GPU host is one process per GPU. :func:`run_queue` runs jobs from one queue,
longest first, on this process and ``N - 1`` workers that stay up between jobs (the gate's cases:
:func:`refcheck.goldens.gate.gate_shard`, each worker keeping its :class:`~refcheck.pool.ReferencePool` and so its
models and shared work). Nothing here knows goldens: the gate hands its jobs in.

Workers end with this process (:func:`worker_pool`): they stay in its process group (a signal to the
group reaches them), ignore SIGINT (a terminal's Ctrl-C reaches the whole group; this process decides)
and leave on their own within a second when this process is gone, whatever ended it (:func:`worker_init`,
:func:`refcheck.lifetime.watch_parent`). While they run, SIGTERM or SIGINT to this process ends every worker
(:func:`refcheck.lifetime.ended_on_signal` with :func:`end_processes`: SIGTERM, then SIGKILL after
:data:`GRACE_S`), then takes the signal's own course: SIGTERM ends the process (exit 143), SIGINT raises
``KeyboardInterrupt``. The main thread waits on its workers in steps of :data:`refcheck.lifetime.POLL_S`, so the
handler runs within that time even when the kernel handed the signal to another of this process's threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from multiprocessing.connection import wait as wait_ready
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, TypeVar

from refcheck.errors import UsageError, WorkerDiedError
from refcheck.lifetime import POLL_S, ended_on_signal, watch_parent

if TYPE_CHECKING:  # torch and the trace format load where they are used: a worker that runs neither starts light
    from refcheck.diff.findings import Report
    from refcheck.pool import ReferencePool
    from refcheck.trace.io import Trace

T = TypeVar("T")
_VOLATILE = ("created", "device", "prompt_set_sha256")  # provenance keys that differ between shards
GRACE_S = 3.0  # seconds a worker has to end after SIGTERM before it is killed


def split(items: Sequence[T], n: int) -> list[list[T]]:
    if n < 1:
        raise UsageError(f"--workers must be >= 1, got {n}")
    shards = [list(items[i::n]) for i in range(n)]
    return [s for s in shards if s]


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under ``taskset``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def shard_device(device: str, index: int) -> str:
    """Worker ``index``'s device: ``cuda:index`` for CUDA, the given device otherwise."""
    return f"cuda:{index}" if device.split(":")[0] == "cuda" else device


def merge_traces(traces: Sequence[Trace], order: Sequence[str], prompt_set_sha256: str | None = None) -> Trace:
    """One trace from shard traces, requests and steps in ``order`` (the original prompt ids).

    ``prompt_set_sha256`` is the hash of the whole prompt set (each shard only knows its part).
    """
    from refcheck.trace.io import Trace

    if not traces:
        raise UsageError("nothing to merge")
    base = {k: v for k, v in traces[0].provenance.items() if k not in _VOLATILE}
    for t in traces[1:]:
        other = {k: v for k, v in t.provenance.items() if k not in _VOLATILE}
        if other != base:
            diff = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise UsageError(f"shard traces disagree in provenance ({', '.join(diff)}): refusing to merge")
    requests = {r.request_id: r for t in traces for r in t.requests}
    steps = {r: [s for t in traces for s in t.steps if s.request_id == r] for r in requests}
    missing = [r for r in order if r not in requests]
    if missing:
        raise UsageError(f"shards are missing requests {missing[:5]}")
    prov = dict(traces[0].provenance)
    prov["device"] = traces[0].provenance.get("device")
    prov["workers"] = len(traces)
    if prompt_set_sha256 is not None:
        prov["prompt_set_sha256"] = prompt_set_sha256
    return Trace(provenance=prov, requests=[requests[r] for r in order],
                 steps=[s for r in order for s in sorted(steps[r], key=lambda s: s.step)])


def merge_reports(reports: Sequence[Report], case: str, mode: str) -> Report:
    from refcheck.diff.findings import Report

    out = Report(case=case, mode=mode)
    for r in reports:
        out.merge(r)
        for k, v in r.stats.items():
            out.stats.setdefault(k, v)
    taus_e = [(r.stats.get("mean_tau_engine"), r.stats.get("steps_engine", 0)) for r in reports]
    taus_r = [(r.stats.get("mean_tau_reference"), r.stats.get("steps_reference", 0)) for r in reports]
    for key, pairs, steps_key in (("mean_tau_engine", taus_e, "steps_engine"), ("mean_tau_reference", taus_r, "steps_reference")):
        n = sum(s for m, s in pairs if m is not None)
        if n:
            out.stats[key] = sum(m * s for m, s in pairs if m is not None) / n
            out.stats[steps_key] = n
    if out.stats.get("mean_tau_engine") is not None and out.stats.get("mean_tau_reference") is not None:
        out.stats["mean_tau_delta"] = out.stats["mean_tau_engine"] - out.stats["mean_tau_reference"]
    return out


def worker_init(parent: int) -> None:
    """A worker's start (module docstring): SIGINT ignored, a thread that ends it when ``parent`` is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(lambda: None, parent)


def end_processes(procs: Iterable[BaseProcess], grace: float = GRACE_S) -> None:
    """SIGTERM to each of ``procs``, SIGKILL to those still up after ``grace`` seconds."""
    pending = {}
    for p in list(procs):
        try:
            p.terminate()
            pending[p.sentinel] = p
        except (OSError, ValueError, AttributeError):  # already gone, closed, or never started
            pass
    deadline = time.monotonic() + grace
    try:
        while pending and (left := deadline - time.monotonic()) > 0:
            for ready in wait_ready(list(pending), left):
                pending.pop(ready)
    except (OSError, ValueError):  # a sentinel closed meanwhile: kill whatever is left
        pass
    for p in pending.values():
        try:
            p.kill()
        except (OSError, ValueError):
            pass


def _how_ended(procs: Iterable[BaseProcess]) -> str:
    """Each process's pid and how it ended (``exitcode``: negative for the signal that ended it)."""
    out = []
    for p in procs:
        code = p.exitcode
        how = "still running" if code is None else \
            f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit {code}"
        out.append(f"pid {p.pid} {how}")
    return ", ".join(out) or "none left to ask"


@contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """``workers`` spawned processes that end with this one (module docstring); shut down on leaving. A worker that
    dies while it runs a job (BrokenProcessPool) is a :class:`~refcheck.errors.WorkerDiedError` naming how each
    worker ended."""
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=worker_init,
                               initargs=(os.getpid(),))

    def processes() -> list[BaseProcess]:  # the workers spawned so far
        return list((getattr(pool, "_processes", None) or {}).values())

    with ended_on_signal(lambda: end_processes(processes())), pool:
        try:
            yield pool
        except BrokenProcessPool as exc:
            dead = processes()
            for p in dead:
                p.join(GRACE_S)  # the pool stops the others: how each ended is known
            raise WorkerDiedError(f"a worker process died while it ran ({_how_ended(dead)}); no verdict was given. "
                                  "SIGKILL is what the kernel's out-of-memory killer sends: fewer --workers need less "
                                  "memory") from exc


def run_parallel(fn: Callable[..., T], jobs: Sequence[tuple], workers: int) -> list[T]:
    """fn(*job) for every job, in spawned worker processes (:func:`worker_pool`, in order); inline when
    workers == 1."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*job) for job in jobs]
    with worker_pool(min(workers, len(jobs))) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        while wait_futures(futures, timeout=POLL_S).not_done:  # timed: a signal's handler runs meanwhile
            pass
        return [f.result() for f in futures]


def run_queue(fn: Callable[..., T], jobs: Sequence[tuple], workers: int, inline: Callable[..., T],
              on_result: Callable[[int, T], None] | None = None) -> list[T]:
    """Every job, results in order, ``workers`` at a time, each taken from one queue in order as soon
    as a worker is free (put the longest first): ``inline(*job)`` in this process, ``fn(*job)`` in
    ``workers - 1`` spawned processes, which stay up from job to job. ``on_result(index, result)`` is
    called as each job finishes (one at a time). A job's exception is raised here once the running
    jobs are done; jobs not started by then are not run. The workers: :func:`worker_pool`."""
    pending = deque(enumerate(jobs))
    lock = threading.Lock()
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def take() -> tuple[int, tuple] | None:
        with lock:
            return pending.popleft() if pending and not errors else None

    def drain(run: Callable[[tuple], T]) -> None:
        while (item := take()) is not None:
            try:
                results[item[0]] = run(item[1])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                with lock:
                    errors.append(exc)
                continue
            if on_result is not None:
                with lock:
                    on_result(item[0], results[item[0]])

    helpers = min(workers, len(jobs)) - 1
    with worker_pool(helpers) if helpers >= 1 else nullcontext() as pool:
        feeders = [threading.Thread(target=drain, args=(lambda job: pool.submit(fn, *job).result(),), daemon=True)
                   for _ in range(helpers)]
        for t in feeders:
            t.start()
        drain(lambda job: inline(*job))
        for t in feeders:
            while t.is_alive():
                t.join(POLL_S)  # timed: a signal's handler runs meanwhile
        if errors:
            raise errors[0]  # inside the pool: a worker's death becomes a WorkerDiedError
    return results


# -- worker entry points (module level: spawned processes import them by name) ------------------------
def thread_share(workers: int) -> int:
    """Torch threads for one of ``workers`` processes: its share of the usable cores, at most
    ``OMP_NUM_THREADS`` when that is set. The cap is how a caller that already runs several processes
    (pytest-xdist workers, a CI matrix) keeps each one, and every process it spawns, to its own cores:
    more threads than cores make torch's OpenMP threads wait on each other, a tiny forward then costs
    a millisecond instead of microseconds."""
    share = max(1, usable_cpus() // max(workers, 1))
    try:
        cap = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return share
    return min(share, cap) if cap >= 1 else share


def worker_setup(workers: int) -> int:
    """Offline, and this process's share of the usable cores as torch threads (:func:`thread_share`);
    returns the old count (for callers that run inline and restore it)."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(thread_share(workers))
    return before


def engine_shard(engine: str, spec, prompts, mode: str, ref_dtype: str, ref_device: str, index: int,
                 workers: int, full_state: bool = False, engine_opts: dict | None = None) -> tuple[bytes, Report]:
    """Run a live engine on one shard of prompts and diff it; returns (trace bytes, report). Torch
    threads: this process's share of the cores while it runs, restored after."""
    import dataclasses

    import torch

    from refcheck.diff.judge import judge
    from refcheck.pool import ReferencePool
    from refcheck.trace.io import trace_bytes

    threads = worker_setup(workers)
    try:
        spec = dataclasses.replace(spec, device=shard_device(spec.device, index))
        reference = ReferencePool()
        trace = live_trace(engine, spec, prompts, reference, full_state, engine_opts)
        report = judge(trace, reference, engine, mode, strict_acceptance=engine == "reference", ref_dtype=ref_dtype,
                       ref_device=shard_device(ref_device, index))
        return trace_bytes(trace), report
    finally:
        torch.set_num_threads(threads)  # run inline (one worker), the caller keeps its own thread count


def live_trace(engine: str, spec, prompts, reference: ReferencePool | None, full_state: bool = False,
               engine_opts: dict | None = None) -> Trace:
    """Record a live engine's trace (:mod:`refcheck.engines`: the reference, an injected fault, z-lab's
    dflash or SGLang), the reference and fault engines on ``reference``'s runner (None: a runner of their own);
    ``engine_opts``: the engine kind's own options (SGLang's ``cuda_graphs``, ...)."""
    from refcheck.engines import open_engine

    return open_engine(engine, spec, reference, full_state, engine_opts).trace(prompts)
