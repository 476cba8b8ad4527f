"""What shipping a capture record costs the engine's process, on the CPU: a benchmark of the capture's way out.

Usage::

    python scripts/bench_capture_ship.py [--records 400] [--rounds 3] [--drag] [--vs OTHER_REPO_ROOT]
    python scripts/bench_capture_ship.py --sites

Builds ``--records`` batch records shaped like a DFLASH step of 32 requests at block 16 (the verify summary, the
committed state of 2 attention and 4 linear-attention layers, the drafter's top ranks and context, the per-request
host lists) and ships them through a :class:`refcheck.sglang.capture.records.Recorder` into a temporary directory:
``ship ms/record`` is the loop's wall time per record (what the scheduler's thread pays: packing, flattening,
queueing, with the writer thread running beside it), ``cpu ms/record`` the process's CPU time per record until
every record is written (shipping and the writer together). The tensors are on the CPU, so the device-side copy is
not in it; on the GPU the same parts are the cost ledger's ``ship`` and ``writer_ms_per_record``
(``docs/results/capture-cost-h200.md``). ``pass us/batch`` is what the capture hooks cost a decode batch of 1 and of
32 traced requests that the sampling rule passes over (``hooks._run_batch`` around a step that does nothing; the
ledger's ``passed_ms_per_plain_batch`` on the GPU). ``torch calls`` is how many calls into torch the hooks make on
the engine's thread per recorded DFLASH batch, and per target-only one, on the graphed path (:func:`calls_per_batch`: the tests' stand-ins,
each graph replay counted as its launch and input copies), what the scheduler's thread pays per call on the GPU.
``host`` is this machine's clock read and Python loop as a scheduler's status file gives them
(:func:`refcheck.sglang.capture.profiling.host_speed`), to carry a figure from one host to another. ``--drag`` also
times stand-in scheduler batches (Python calling into torch as it goes, each call letting go of the interpreter
lock, then a wait releasing it) with one record in 16 shipped (:func:`writer_drag`): whether the writer thread slows
the batches around a recorded one, and by how much per record (``drag``). With ``--vs`` each round runs this
checkout's refcheck and the other one's, in turn, in fresh processes, and prints the ratios (this / other) of the
medians. ``--sites`` prints only the torch calls per recorded DFLASH batch by where the hooks make them (file and
function; a graph's replay by its name), the writer thread's header and frame parts per record
(:func:`writer_parts_us`), and what giving each record its requests' context pieces costs a recorded batch of 32
requests (:func:`carry_us`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _record(bs: int = 32, block: int = 16, vocab: int = 512, k: int = 5) -> tuple[dict, dict]:
    import torch

    n = bs * block
    t = {"cand": torch.randint(0, vocab, (bs, block)), "accept_lens": torch.randint(1, block, (bs,)),
         "nodes": {"topk_ids": torch.randint(0, vocab, (n, k)), "topk_logprobs": torch.randn(n, k),
                   "argmax": torch.randint(0, vocab, (n,)), "picked": torch.randn(n)},
         "out_tokens": torch.randint(0, vocab, (bs, block)), "committed": torch.arange(bs)}
    kv = {f"{kind}.{layer}": (layer, kind, torch.randn(bs, block, 16), None) for layer in (3, 7) for kind in ("kv_k", "kv_v")}
    mamba = {"layers": [0, 1, 2, 4], "conv": torch.randn(4, bs, 16), "rec": torch.randn(4, bs, 16), "conv_rows": None,
             "rec_rows": None}
    draft = {"ids": torch.randint(0, vocab, (bs, block - 1, 13)), "logprobs": torch.randn(bs, block - 1, 13),
             "reach": torch.ones(bs, block - 1), "k": torch.tensor(k)}
    context = {"sketch": torch.randn(bs, block, 16), "positions": torch.arange(n).view(bs, block), "lens": torch.ones(bs)}
    fields = {"layout": "chain", "rids": [f"refcheck-1-{i}-mixed-{i:02d}" for i in range(bs)], "origin": list(range(bs)),
              "steps": [7] * bs, "committed_host": list(range(100, 100 + bs)), "roots_host": list(range(bs)),
              "meta": {"server_topk": 1, "batch_size": bs, "layout_in_engine": "chain", "cuda_graph": True},
              "sides": None, "events": None}
    return fields, {"t": t, "state": {"kv": kv, "mamba": mamba}, "layers": None, "draft": draft, "context": context}


def measure(records: int) -> dict[str, float]:
    """Ship ``records`` records through a Recorder (module docstring): ms per record."""
    import torch

    from refcheck.sglang.capture.records import Recorder

    torch.set_num_threads(1)  # the CPU stand-ins' copies on one thread: OpenMP's spinning would be counted as cost
    rec = Recorder(Path(tempfile.mkdtemp(prefix="refcheck-ship-")))
    batch = [_record() for _ in range(records)]
    c0, t0 = time.process_time(), time.perf_counter()
    for fields, tensors in batch:
        rec.ship("batch", fields, tensors)
    ship = time.perf_counter() - t0
    if not rec.shipper.drain(120.0):
        raise RuntimeError("the writer did not write every record within 120 s")
    return {"ship_ms": 1000 * ship / records, "cpu_ms": 1000 * (time.process_time() - c0) / records}


def pass_over(requests: int, batches: int = 3000) -> float:
    """Microseconds the capture hooks cost a decode batch of ``requests`` traced requests that the sampling rule
    passes over (every request marked with a rule that takes none of the ``batches`` + 100 batches run)."""
    import os
    from types import SimpleNamespace as NS

    import torch

    os.environ["REFCHECK_CAPTURE_DIR"] = tempfile.mkdtemp(prefix="refcheck-pass-")
    from refcheck.sglang.capture import hooks
    from refcheck.sglang.capture.sample_rule import SampleRule, sampled_rid

    every = 1_000_000
    rule = next(r for r in (SampleRule(every, seed) for seed in range(1000)) if 0 < r.phase < every - batches - 200)

    class Req:  # SGLang's requests take attributes and weak references
        def __init__(self, rid: str) -> None:
            self.rid = rid

    batch = NS(forward_mode=NS(is_extend=lambda: False, is_decode=lambda: True), spec_algorithm=NS(is_none=lambda: False),
               reqs=[Req(sampled_rid(rule, f"bench-{i:02d}")) for i in range(requests)],
               req_pool_indices=torch.arange(requests))
    scheduler = NS(tp_rank=0, server_args=NS(tp_size=1))
    for _ in range(100):
        hooks._run_batch(lambda self, b: None, scheduler, batch)
    t0 = time.perf_counter()
    for _ in range(batches):
        hooks._run_batch(lambda self, b: None, scheduler, batch)
    return 1e6 * (time.perf_counter() - t0) / batches


def writer_parts_us(records: int = 300) -> tuple[float, float]:
    """The writer thread's two parts per DFLASH-sized record (:func:`_record`), in microseconds of its thread's CPU:
    encoding the header (:mod:`refcheck.sglang.capture.header_codec`, holding the interpreter lock) and appending the
    record's frame to its segment (the kernel's write releases it)."""
    from refcheck.sglang.capture import packing
    from refcheck.sglang.capture.segments import SegmentLog

    fields, tensors = _record()
    skeleton, ts, n_dev = packing.pack({"type": "batch", **fields, **tensors})
    entries, dev, host = packing.table(ts), packing.flatten(ts[:n_dev]), packing.flatten(ts[n_dev:])
    t0 = time.thread_time()
    parts = [packing.encode_parts(skeleton, entries, dev.numpy().data, host.numpy().data) for _ in range(records)]
    t1 = time.thread_time()
    log = SegmentLog(Path(tempfile.mkdtemp(prefix="refcheck-writer-")), "records")
    for data in parts:
        log.append(data)
    t2 = time.thread_time()
    log.close()
    return 1e6 * (t1 - t0) / records, 1e6 * (t2 - t1) / records


def carry_us(requests: int = 32, batches: int = 2000, prompt: int = 300) -> float:
    """Microseconds the hooks spend per recorded decode batch of ``requests`` requests giving each record its piece
    of the request's context (:meth:`refcheck.sglang.capture.step_clock.StepClock.context`: a ``prompt``-token prompt
    carried once, then four new tokens a batch), over the same loop without it."""
    from types import SimpleNamespace

    from refcheck.sglang.capture import snapshot
    from refcheck.sglang.capture.batch import Batch
    from refcheck.sglang.capture.sample_rule import SampleRule
    from refcheck.sglang.capture.step_clock import StepClock

    reqs = [SimpleNamespace(rid=f"r{i}", origin_input_ids=list(range(prompt)), output_ids=[1],
                            sampling_params=SimpleNamespace(temperature=1.0, top_k=1)) for i in range(requests)]
    rids, rows, clock = [r.rid for r in reqs], list(range(requests)), StepClock(SampleRule())

    def loop(carry: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(batches):
            for r in reqs:
                r.output_ids.extend((1, 2, 3, 4))
            snap = Batch(mode="decode", speculative=True, rids=rids)
            if carry:
                snapshot.carry(snap, clock, reqs, rows)
        return (time.perf_counter() - t0) / batches

    loop(True)  # every prompt carried once, as at a request's first record
    return 1e6 * (loop(True) - loop(False))


def calls_per_batch(root: Path = ROOT, graphed: bool = True, kind: str = "dflash",
                    sites: dict[str, float] | None = None) -> float:
    """Calls into torch the capture hooks make on the engine's thread per recorded decode batch: ``root``'s
    ``tests/capture_kit.py`` stand-ins on the CPU (``kind`` "dflash": four DFLASH batches of 2-3 requests;
    "target": three target-only batches of 1-2), each call counted whose caller is refcheck's code, the records'
    reading left out. ``graphed``: through the graph caches, each cache's computation counted as what its replay
    costs on the GPU (one copy per input and one launch); else the eager path. ``sites``: filled with the calls per
    batch by where they are made (``file:function``, a graph's replay as ``graph:NAME``)."""
    import pytest
    import torch
    from torch.overrides import TorchFunctionMode

    if str(root / "tests") not in sys.path:
        sys.path.insert(0, str(root / "tests"))
    import capture_kit

    from refcheck.sglang.capture import graphs, records

    package, quiet = str(root / "refcheck"), [0]
    by_site: dict[str, int] = {}

    def book(site: str, n: int) -> None:
        by_site[site] = by_site.get(site, 0) + n

    def quietly(fn: Any) -> Any:  # its torch calls are not the engine thread's (a replay's are counted as one)
        def call(*args: Any) -> Any:
            quiet[0] += 1
            try:
                return fn(*args)
            finally:
                quiet[0] -= 1
        return call

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            code = sys._getframe(1).f_code
            if not quiet[0] and code.co_filename.startswith(package):
                book(f"{Path(code.co_filename).name}:{code.co_name}", 1)
            return func(*args, **(kwargs or {}))

    def replayed(cache: Any, key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        book(f"graph:{key[0] if isinstance(key[0], str) else f'state (bucket {key[0]})'}", 1 + len(inputs))
        return quietly(fn)(*inputs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs.GraphCache, "run", replayed)
        mp.setattr(records, "read_capture", quietly(records.read_capture))
        drive, batches, want = ((capture_kit.dflash_batches, 4, 10) if kind == "dflash"
                                else (capture_kit.target_only_batches, 3, 5))
        with Count():
            steps = drive(Path(tempfile.mkdtemp(prefix="refcheck-calls-")), mp, graphed, "cpu")
    if len(steps) != want:
        raise RuntimeError(f"the stand-in {kind} batches recorded {len(steps)} steps, not {want}")
    if sites is not None:
        sites.update({site: n / batches for site, n in by_site.items()})
    return sum(by_site.values()) / batches


def _engine_batch(iterations: int, wait_s: float, operand: Any) -> None:
    """A stand-in scheduler step: a fixed amount of Python work, ``iterations`` rounds of a small ``add`` on
    ``operand`` and a short sum (each call into torch lets go of the interpreter lock, as the torch calls of SGLang's
    scheduler do, so a writer thread waiting for the lock takes it there), then a wait that releases it (the device's
    work).
    Fixed work, not a fixed time: time the writer takes from it makes the step longer."""
    for _ in range(iterations):
        operand.add(operand)
        sum(range(20))
    time.sleep(wait_s)


def _iterations(python_us: float, operand: Any) -> int:
    """How many of :func:`_engine_batch`'s rounds take ``python_us`` on this host (no writer running)."""
    t0 = time.perf_counter()
    _engine_batch(2000, 0.0, operand)
    return max(1, round(python_us / (1e6 * (time.perf_counter() - t0) / 2000)))


DRAG_KEYS = ("untraced_ms", "ships_ms", "after_ms", "rest_ms", "drag_ms")


def writer_drag(batches: int = 640, every: int = 16, python_us: float = 2500.0,
                wait_s: float = 0.0004) -> dict[str, float]:
    """Whether the writer thread slows the engine's thread: stand-in batches (:func:`_engine_batch`; by default
    shaped like a DFLASH batch under CUDA graphs, 2.9 ms of which the device's wait is 0.4) in periods of ``every``,
    a period that ships one DFLASH-sized record at its start alternating with one that ships none (``batches`` of
    each kind, so a drift of the host's speed reaches both alike). The mean ms of a batch without capture, of a
    batch that ships (the ship included), of the batch after it and of the rest; ``drag_ms``, per record: what the
    ``every`` batches of its period took over those of a period without capture, the ship itself left out (the
    writer's share of the engine's thread: waiting for the interpreter lock while the writer holds it, and the
    handovers)."""
    import torch

    from refcheck.sglang.capture.records import Recorder

    torch.set_num_threads(1)
    operand = torch.ones(4)
    iterations = _iterations(python_us, operand)
    rec = Recorder(Path(tempfile.mkdtemp(prefix="refcheck-drag-")))
    periods = max(1, batches // every)
    made = [_record() for _ in range(periods)]
    plain: list[list[float]] = [[] for _ in range(every)]
    by_place: list[list[float]] = [[] for _ in range(every)]
    shipping = []
    for g in range(2 * periods * every):
        period, place = divmod(g, every)
        traced = period % 2 == 1
        ships = traced and place == 0
        t0 = time.perf_counter()
        if ships:
            rec.ship("batch", *made[period // 2])
        t1 = time.perf_counter()
        _engine_batch(iterations, wait_s, operand)
        t2 = time.perf_counter()
        (by_place if traced else plain)[place].append(t2 - t1)
        if ships:
            shipping.append(t2 - t0)
    if not rec.shipper.drain(60.0):
        raise RuntimeError("the writer did not write every record within 60 s")
    drag = sum(statistics.mean(a) - statistics.mean(b) for a, b in zip(by_place, plain))
    means = [statistics.mean(x for place in plain for x in place), statistics.mean(shipping),
             statistics.mean(by_place[1]) if every > 1 else math.nan,
             statistics.mean(x for place in by_place[2:] for x in place) if every > 2 else math.nan, drag]
    return {key: 1000 * v for key, v in zip(DRAG_KEYS, means)}


def host() -> dict[str, float]:
    """This host's speed as the capture's status file gives it for a scheduler process
    (:func:`refcheck.sglang.capture.profiling.host_speed`): a bench figure is read against it."""
    from refcheck.sglang.capture.profiling import host_speed

    return host_speed()


def _child(root: Path, records: int, drag: bool) -> dict[str, float]:
    code = (f"import sys, json; sys.path.insert(0, {str(root)!r}); sys.path.insert(1, {str(ROOT / 'scripts')!r}); "
            f"import bench_capture_ship as b; from pathlib import Path; print(json.dumps({{**b.measure({records}), "
            f"'pass_us_1': b.pass_over(1), 'pass_us_32': b.pass_over(32), "
            f"'calls': b.calls_per_batch(Path({str(root)!r})), "
            f"'calls_target': b.calls_per_batch(Path({str(root)!r}), kind='target'), **b.host(), "
            f"**(b.writer_drag() if {drag} else {{}})}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vs", type=Path, default=None, help="Another checkout's root: its refcheck, run in turn.")
    ap.add_argument("--drag", action="store_true", help="Also time the writer thread's drag on stand-in batches.")
    ap.add_argument("--sites", action="store_true",
                    help="Only print this checkout's torch calls per recorded DFLASH batch (graphed) by call site.")
    args = ap.parse_args(argv)
    if args.sites:
        sites: dict[str, float] = {}
        total = calls_per_batch(sites=sites)
        print(f"torch calls per recorded DFLASH batch (graphed): {total:.1f}")
        for site, n in sorted(sites.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{n:8.1f}  {site}")
        encode, write = writer_parts_us()
        print(f"writer, per DFLASH-sized record: header {encode:.0f} us (holding the interpreter lock), frame {write:.0f} us")
        print(f"context pieces: {carry_us():.1f} us per recorded batch of 32 requests")
        return 0
    if args.records < 1 or args.rounds < 1:
        ap.error("--records and --rounds must be >= 1")
    if args.vs is not None and not (args.vs / "refcheck" / "sglang" / "capture" / "records.py").is_file():
        ap.error(f"--vs {args.vs}: not a checkout of refcheck with the SGLang capture")
    trees = [("this", ROOT)] + ([("other", args.vs.resolve())] if args.vs is not None else [])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, root in trees:
            runs[name].append(_child(root, args.records, args.drag))
    keys = ("ship_ms", "cpu_ms", "pass_us_1", "pass_us_32", "calls", "calls_target", "clock_read_ns",
            "python_loop_us") + \
        (DRAG_KEYS if args.drag else ())
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    for name, m in med.items():
        print(f"{name}: ship {m['ship_ms']:.3f} ms/record, cpu {m['cpu_ms']:.3f} ms/record "
              f"(median of {args.rounds} x {args.records} records); pass-over {m['pass_us_1']:.1f} us/batch at 1 "
              f"request, {m['pass_us_32']:.1f} at 32; torch calls per recorded batch (graphed) {m['calls']:.1f} DFLASH, "
              f"{m['calls_target']:.1f} target-only; "
              f"host: clock read {m['clock_read_ns']:.0f} ns, Python loop {m['python_loop_us']:.0f} us")
        if args.drag:
            print(f"{name}: stand-in batch {m['untraced_ms']:.3f} ms untraced; 1 in 16 recorded: {m['ships_ms']:.3f} "
                  f"shipping, {m['after_ms']:.3f} the batch after, {m['rest_ms']:.3f} the rest; the writer's drag "
                  f"{m['drag_ms']:.3f} ms per record")
    if "other" in med:
        print("this / other: " + ", ".join(f"{k} {med['this'][k] / med['other'][k]:.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
