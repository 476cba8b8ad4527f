"""Diffs against a layer-sharded reference: one process per shard, SPMD (ddtree_reference/sharded.py).

Contract: :func:`sharded_diff` replays a trace against the reference split by layers over ``shards``
processes (rank i on ``cuda:i`` with NCCL when the reference device is CUDA, gloo on CPUs), each
holding only its own layers' weights and state, and returns rank 0's report, which equals an
unsharded replay's. Only replay is sharded: the free-run oracle is transformers' own forward of the
whole model, so ``mode`` must be "replay". A user error in a rank (a corrupt trace, a model error: one
with an exit code, :func:`refcheck.errors.exit_code_for`) is raised here as itself, naming the trace's file.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path

from refcheck.diff.findings import STATE_CATEGORIES, Report, step_counts
from refcheck.errors import UsageError, WorkerDiedError, exit_code_for
from refcheck.trace.io import Trace, trace_bytes, trace_from_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, parent: int, shards: int, port: int, data: bytes, case: str, ref_dtype: str, ref_device: str,
          out: str, source: str) -> None:
    from refcheck.lifetime import watch_parent

    watch_parent(lambda: None, parent)  # leaves within POLL_S of the parent's death, even from a blocked collective
    import torch
    import torch.distributed as dist

    from ddtree_reference.sharded import PipelineTarget
    from refcheck.diff.judge import judge
    from refcheck.parallel import thread_share
    from refcheck.pool import ReferencePool, reference_spec_for

    cuda = ref_device.split(":")[0] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see the device notes)
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(thread_share(shards))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=shards)
    try:
        trace = trace_from_bytes(data, source)
        pool = ReferencePool()
        runner = pool.runner(reference_spec_for(trace, ref_dtype, device))
        runner.target = PipelineTarget(runner.target)
        runner.target.release_foreign_layers()
        report = judge(trace, pool, case, mode="replay", ref_dtype=ref_dtype, ref_device=device)
        Path(out).with_suffix(f".{rank}.pkl").write_bytes(pickle.dumps(report))
    except Exception as exc:
        if exit_code_for(exc) is not None:  # the parent raises it as itself
            Path(out).with_suffix(f".{rank}.error.pkl").write_bytes(pickle.dumps(exc))
        raise
    finally:
        dist.destroy_process_group()


def sharded_diff(trace: Trace, case: str, mode: str, shards: int, ref_dtype: str, ref_device: str) -> Report:
    import torch
    import torch.multiprocessing as mp

    if mode != "replay":
        raise UsageError("--ref-shards shards the replay only (the free-run oracle is transformers' whole-model "
                         "forward): pass --mode replay")
    from refcheck.diff.tolerance import calibration_for, engine_numerics
    from refcheck.pool import reference_spec_for

    reference_spec_for(trace, ref_dtype, ref_device)  # a malformed provenance: its error here, not in every rank
    numerics = engine_numerics(trace.provenance)
    if calibration_for(*numerics).rule is not None:
        raise UsageError(f"--ref-shards: an engine trace in {numerics[0]} is judged by the calibrated verdict, whose "
                         "rounding ensemble needs the whole reference in one process; drop --ref-shards (layer "
                         "sharding replays float32 engine traces)")
    if ref_device.split(":")[0] == "cuda" and torch.cuda.device_count() < shards:
        raise UsageError(f"--ref-shards {shards} needs {shards} CUDA devices, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory(prefix="refcheck-shards-") as tmp:
        out = os.path.join(tmp, "report.pkl")
        try:
            _run_ranks((os.getpid(), shards, free_port(), trace_bytes(trace), case, ref_dtype, ref_device, out,
                        trace.source or case), shards)
        except Exception as exc:
            errors = [Path(out).with_suffix(f".{r}.error.pkl") for r in range(shards)]
            typed = next((pickle.loads(e.read_bytes()) for e in errors if e.is_file()), None)
            if typed is None and isinstance(exc, mp.ProcessExitedException):  # killed, or exited abruptly
                how = f"killed by {exc.signal_name}" if exc.signal_name else f"exit {exc.exit_code}"
                raise WorkerDiedError(f"reference shard {exc.error_index} of {shards} died while it ran ({how}); no "
                                      "verdict was given") from exc
            if typed is None:
                raise
            raise typed from None
        return merge_shard_reports([pickle.loads(Path(out).with_suffix(f".{r}.pkl").read_bytes()) for r in range(shards)])


def _run_ranks(args: tuple[object, ...], shards: int) -> None:
    """``_rank(i, *args)`` for every rank, in spawned processes that end with this one: SIGTERM or SIGINT here ends
    them first (:func:`refcheck.parallel.end_processes`), and each rank leaves once this process (``args[0]``) is
    gone, whatever ended it. Raises what torch's join raises when a rank fails."""
    from torch.multiprocessing.spawn import ProcessContext, start_processes

    from refcheck.lifetime import POLL_S, ended_on_signal
    from refcheck.parallel import end_processes

    started: list[ProcessContext] = []
    with ended_on_signal(lambda: end_processes(started[0].processes if started else [])):
        started.append(start_processes(_rank, args=args, nprocs=shards, join=False, start_method="spawn"))
        while not started[0].join(timeout=POLL_S):  # timed: a signal's handler runs meanwhile
            pass


def merge_shard_reports(reports: list[Report]) -> Report:
    """Rank 0's report (tokens, logits and acceptance are the same on every rank) plus every other
    rank's state checks of its own layers; per-step verdicts recounted over the merged findings."""
    out = reports[0]
    for rep in reports[1:]:
        out.findings += [f for f in rep.findings if f.category in STATE_CATEGORIES]
        for cat in STATE_CATEGORIES:
            out.checks[cat] += rep.checks.get(cat, 0)
        for key, value in rep.stats.items():
            if key.startswith("max_rel_l2_"):
                out.stats[key] = max(out.stats.get(key, value), value)
    steps = out.stats.get("steps")
    if steps:  # other ranks' state findings may make more steps fail: recount over the merged findings
        out.stats["steps"] = step_counts(out.findings, sum(steps.values()))
    return out
