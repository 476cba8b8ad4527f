"""The reference side of scripts/bench_sglang_verify.py: its exact tree verify at the same shape.

Contract: :func:`reference_phase` builds bench_verify's target of a shape in bf16 with random weights,
prefills the prompt :func:`make_prompt` also gives SGLang, builds one DDTree per budget from peaked
random draft log-probs, and times the exact verify (one tree chunk, ``validate=False``) as a CUDA-graph
replay with eager layers, then with :meth:`Target.compile` layers (checked against eager logits
first). It fills its ``out`` dict and calls ``save`` after each stage. :func:`wait_for_gpu` waits for
SGLang's processes to release the GPU.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench_sglang_timing import span_stats


def load_bench_verify() -> Any:
    """scripts/bench_verify.py (its ``build``, ``Timer``, ``bandwidth`` and ``SHAPES``); scripts/ is on the path."""
    import bench_verify

    return bench_verify


def make_prompt(n: int, vocab: int, period: int = 48, seed: int = 0) -> list[int]:
    """A repetitive prompt (a random ``period``-token phrase over and over) of ids below ``vocab``."""
    rng = random.Random(seed)
    phrase = [rng.randrange(16, vocab) for _ in range(period)]
    return [phrase[i % period] for i in range(n)]


def _time_graph(timer: Any, fn: Any, reps: int, use_graphs: bool = True) -> dict[str, Any]:
    """``fn`` captured as a CUDA graph (ddtree_reference.graphs.capture; its eager stand-in off CUDA) and its
    replays timed; a failed capture is a result, not a crash."""
    from ddtree_reference.graphs import capture

    try:
        return span_stats(timer(capture(fn, use_graphs=use_graphs)[0], reps)) or {}
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def _reference_setup(bench: Any, shape: str, device: str, prefix: int,
                     budgets: list[int]) -> tuple[Any, Any, Any, dict, dict]:
    """The bf16 target with random weights on ``device``, a prefilled state, one tree per budget; the
    floor figures."""
    import torch

    from ddtree_reference.tree import build_ddtree

    dev = torch.device(device)
    t0 = time.time()
    target = bench.build(shape, torch.bfloat16, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    timer = bench.Timer(dev)
    bw = bench.bandwidth(dev, timer)
    info = {"weight_gb": weight_bytes / 1e9, "bandwidth_tb_s": bw / 1e12, "floor_ms": 1e3 * weight_bytes / bw,
            "build_s": time.time() - t0, "prefix": prefix}
    prompt = torch.tensor(make_prompt(prefix, target.vocab_size), device=dev)
    gen = torch.Generator().manual_seed(0)
    trees = {}
    with torch.no_grad():
        state, _ = target.prefill(prompt)
        for b in budgets:  # peaked random draft log-probs over 15 depths, as bench_verify's trees
            lp = torch.log_softmax(3 * torch.randn(15, target.vocab_size, generator=gen), dim=-1)
            tree = build_ddtree(int(prompt[-1]), lp, b)
            trees[b] = (tree.tokens.to(dev), tree.parents.to(dev), tree.depths.to(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"reference: built {shape} ({info['weight_gb']:.1f} GB) in {info['build_s']:.1f} s; copy bandwidth "
          f"{info['bandwidth_tb_s']:.2f} TB/s; floor {info['floor_ms']:.2f} ms; prefix {prefix}", flush=True)
    return target, timer, state, trees, info


def _verify_fn(target: Any, state: Any, tree: tuple) -> Any:
    """The exact verify of ``tree`` (one tree chunk, no host-side checks) returning ``(logits,)``: what a
    graph captures (the eager stand-in copies a tuple of tensors)."""
    tokens, parents, depths = tree
    return lambda: (target.forward(state, tokens, parents, depths, validate=False).logits,)


def _compiled_rows(target: Any, state: Any, trees: dict, eager: dict, timer: Any, reps: int, out: dict,
                   use_graphs: bool, profile_top: int = 0) -> None:
    """Target.compile, then per budget: compile the node count, check it against eager, time its graph;
    with ``profile_top``, one compiled forward's kernels under the profiler (the top names by time)."""
    t0 = time.time()
    target.compile()
    for b, tree in trees.items():
        rec = out["budgets"][str(b)]
        try:  # the first call compiles this node count
            (logits,) = _verify_fn(target, state, tree)()
            rec["compiled_max_abs_logit_diff"] = float((logits - eager[b]).abs().max())
        except Exception as exc:  # noqa: BLE001 - a compiler failure is this row's result
            rec["compiled_graphed"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            print(f"reference B={b}: compile failed: {rec['compiled_graphed']['error']}", flush=True)
            continue
        rec["compiled_graphed"] = row = _time_graph(timer, _verify_fn(target, state, tree), reps, use_graphs)
        print(f"reference B={b}: exact tree chunk, compiled+graphed {row.get('median_ms', float('nan')):.2f} ms "
              f"(max |Δ logit| vs eager {rec['compiled_max_abs_logit_diff']:.3g})", flush=True)
        if profile_top and use_graphs:  # where the compiled forward's GPU time goes, kernel by kernel
            rec["compiled_kernels"] = k = load_bench_verify().kernel_breakdown(_verify_fn(target, state, tree),
                                                                               profile_top)
            print(f"reference B={b}: {k['kernels']} kernels, GEMM {k['gemm_ms']:.2f} ms, attention "
                  f"{k['attention_ms']:.2f} ms, other {k['other_ms']:.2f} ms", flush=True)
            for row_k in k["top_kernels"]:
                print(f"    {row_k['ms']:8.3f} ms {row_k['count']:5d}x {row_k['kind']:9s} {row_k['name'][:110]}",
                      flush=True)
    out["compile_and_time_s"] = time.time() - t0


def reference_phase(args: argparse.Namespace, budgets: list[int], deadline: float, out: dict[str, Any],
                    save: Any) -> None:
    """The exact tree chunk as a graph replay, eager layers then compiled layers, per budget; fills
    ``out`` and calls ``save`` after each stage (a run cut short keeps what it measured)."""
    import torch

    bench = load_bench_verify()
    target, timer, state, trees, info = _reference_setup(bench, args.ref_shape, args.ref_device, args.ref_prefix,
                                                         budgets)
    out.update(info, budgets={str(b): {"tree_tokens": b + 1} for b in budgets}, skipped=[])
    graphs = args.ref_device.startswith("cuda")
    eager: dict[int, Any] = {}
    with torch.no_grad():
        for b, tree in trees.items():
            (eager[b],) = _verify_fn(target, state, tree)()
            out["budgets"][str(b)]["graphed"] = row = _time_graph(timer, _verify_fn(target, state, tree), args.reps,
                                                                  graphs)
            print(f"reference B={b}: exact tree chunk, graphed          {row.get('median_ms', float('nan')):.2f} ms",
                  flush=True)
        save()
        if deadline - time.time() < args.compile_reserve:
            out["skipped"].append("compiled rows (time limit)")
            return
        _compiled_rows(target, state, trees, eager, timer, args.reps, out, graphs, args.profile_top)


def wait_for_gpu(min_free_gb: float, timeout_s: float = 60.0) -> float:
    """Free GPU memory (GB) once at least ``min_free_gb`` is free or ``timeout_s`` passed (SGLang's
    processes release theirs as they exit)."""
    import torch

    t0 = time.time()
    while True:
        free = torch.cuda.mem_get_info()[0] / 1e9
        if free >= min_free_gb or time.time() - t0 > timeout_s:
            return free
        time.sleep(2)
