#!/usr/bin/env python
"""Benchmark the reference's exact tree verify at real scale, side by side with the leaky forward.

    python scripts/bench_verify.py --shape qwen3.6-27b --device cuda --dtype bfloat16   # H200
    python scripts/bench_verify.py --shape small --device cpu --dtype float32           # anywhere

Builds a model of the given shape with random weights directly on the device (nothing downloaded),
prefills a prefix, builds DDTree-shaped trees for each budget from peaked random draft log-probs, and
prints in one run: the measured copy bandwidth and the weight-streaming floor; a plain decode step;
the leaky masked forward (recurrent layers over the flattened tree as one chunk — the engine bug);
the exact verify by depth levels and by one tree chunk; the commit; the end-to-end reference step
(draft + tree + verify + walk + commit with a random DFlash drafter of the target's width); peak
memory over the resident weights and state. Medians with min–max over repetitions (CUDA events on
GPU), ratios to the floor and to the leaky forward. On CUDA the decode step, the leaky forward and
the exact tree chunk are also timed as CUDA-graph replays (``validate=False``: the chunk forward
then never reads the device on the host). A graph bakes in its tree, the prefix length and the
cache shapes, so those rows time one fixed tree; the end-to-end step, whose prefix and caches
grow, runs eager.

``--compile`` then runs the graphed rows again with :meth:`Target.compile` (Inductor fuses each
layer's elementwise work; the weights still stream through cuBLAS), after checking its logits
against the eager forward. ``--profile`` prints where the GPU time of one forward goes (kernel
count; time in GEMM kernels, in attention, in everything else), eager and compiled: the
measurement behind "what keeps it above the floor".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddtree_reference.graphs import capture
from ddtree_reference.tree import build_ddtree

SHAPES = {
    # Qwen3.6-27B: 64 layers (48 Gated DeltaNet + 16 gated full attention), hidden 5120, vocab 248320
    "qwen3.6-27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                        linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def build(shape: str, dtype: torch.dtype, device: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from ddtree_reference.target import Target

    spec = dict(SHAPES[shape])
    n = spec["num_hidden_layers"]
    cfg = Qwen3_5TextConfig(**spec, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (n // 4),
                            max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random weights are created directly in the model dtype, on the device
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return Target(model.eval())


def random_drafter(target, layers: int = 2):
    from ddtree_reference.drafter import DFlashDrafter, default_target_layer_ids

    h = target.hidden_size
    n_t = len(target.layers)
    cfg = dict(hidden_size=h, intermediate_size=target.config.intermediate_size, num_hidden_layers=layers,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=target.vocab_size,
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192, attention_bias=False,
               num_target_layers=n_t,
               dflash_config=dict(mask_token_id=0, block_size=16, target_layer_ids=default_target_layer_ids(n_t, 5)))
    with torch.device(target.device):
        d = DFlashDrafter(cfg, target)
    return d.to(dtype=target.dtype).eval()


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int, warmup: int = 2) -> list[float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return times


def fixed_shape_step(target, drafter, state, root: int, budget: int, timer, reps: int, use_graphs: bool) -> dict:
    """The end-to-end step over fixed-size caches: the draft from fixed-size context buffers
    (ddtree_reference/static_draft.py), the tree on the host, then verify + walk + commit + context extend
    (ddtree_reference/static.py); as two CUDA graphs with ``use_graphs``, else eagerly through the same
    code. First checks one run of each against the eager drafter, forward and walk; then times the
    draft, the verify and the whole step. Returns {"equal", "logit_err", "draft_err", "times"} or
    {"error"} (a failed capture is a benchmark result, not a crash)."""
    from ddtree_reference.static import StaticState, verify_walk_commit
    from ddtree_reference.static_draft import StaticDraftContext

    dev = target.device
    cap = tuple(drafter.target_layer_ids)
    max_depth = drafter.block_size - 1
    room = state.length + (2 * reps + 16) * (max_depth + 1)
    sstate = StaticState.from_state(state, capacity=room)
    ctx = StaticDraftContext.from_drafter(drafter, capacity=room)
    ins = [torch.zeros(budget + 1, dtype=torch.long, device=dev) for _ in range(3)]  # tokens, parents, depths [n]
    bonus = torch.tensor(root, device=dev)  # [] the next block's first token, written by the verify step
    lp_eager = drafter.propose(root, state.length)
    tree0 = build_ddtree(root, lp_eager, budget)
    load_tree(ins, tree0)
    snap, ctx_snap = sstate.snapshot(), ctx.snapshot()

    def undo() -> None:
        sstate.restore(snap)
        ctx.restore(ctx_snap)
        bonus.fill_(root)

    def draft_fn():
        return (ctx.propose(bonus, sstate.length),)

    def verify_fn():
        o = verify_walk_commit(target, sstate, *ins, max_depth, cap, ctx)
        bonus.copy_(o.bonus)
        return o.n_accepted, o.path, o.bonus, o.forward.logits

    try:
        draft, (lp_out,) = capture(draft_fn, undo, use_graphs)
        verify, (n_acc, path, out_bonus, logits) = capture(verify_fn, undo, use_graphs)
        draft()
        draft_err = float((lp_out - lp_eager).abs().max())
        verify()
    except Exception as exc:  # noqa: BLE001 - reported as the benchmark's result
        return {"error": f"{type(exc).__name__}: {exc}"}
    equal, logit_err = equals_eager(target, state, tree0, cap, (n_acc, path, out_bonus, logits))

    def step() -> None:  # graphed draft, host tree, graphed verify + walk + commit + extend
        draft()
        load_tree(ins, build_ddtree(int(bonus), lp_out, budget))  # reads the bonus and the drafts' top-k on the host
        verify()

    times = time_phases(timer, reps, undo, {"draft": draft, "verify": verify, "step": step})
    return {"equal": equal, "logit_err": logit_err, "draft_err": draft_err, "times": times}


def load_tree(ins: list[torch.Tensor], tree) -> None:
    """Copy a tree's tokens, parents and depths into the fixed-size input buffers ``ins`` ([n] each)."""
    for dst, src in zip(ins, (tree.tokens, tree.parents, tree.depths)):
        dst.copy_(src)


def equals_eager(target, state, tree, cap: tuple[int, ...], outputs: tuple) -> tuple[bool, float]:
    """Whether one fixed-shape verify's outputs (accepted count, path, bonus, logits) equal the eager
    forward and walk over ``tree``, and the largest logit difference."""
    n_acc, path, out_bonus, logits = outputs
    eager = target.forward(state, tree.tokens, tree.parents, tree.depths, capture=cap)
    want = tree.walk_greedy(eager.logits.argmax(-1).cpu())
    k = int(n_acc)
    equal = path[:k].tolist() == want and int(out_bonus) == int(eager.logits[want[-1]].argmax())
    return equal, float((logits - eager.logits).abs().max())


def time_phases(timer, reps: int, undo, phases: dict) -> dict[str, list[float]]:
    """Time each phase ``reps`` times, in order, each from the snapshot state (``undo`` before and after)."""
    undo()
    times = {}
    for name, fn in phases.items():
        times[name] = timer(fn, reps)
        undo()
    return times


GEMM_MARKERS = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "cublas")
ATTENTION_MARKERS = ("flash", "fmha", "attention", "attn")


def kernel_kind(name: str) -> str:
    """GEMM (weights streaming through cuBLAS / CUTLASS), attention, or other (elementwise, norms,
    reductions, copies, the delta rule's small matmuls are GEMMs too)."""
    low = name.lower()
    if any(m in low for m in GEMM_MARKERS):
        return "gemm"
    if any(m in low for m in ATTENTION_MARKERS):
        return "attention"
    return "other"


def kernel_breakdown(fn, top: int = 0) -> dict:
    """One eager run of ``fn`` under the CUDA profiler: kernel count and summed kernel time by kind;
    with ``top``, also the ``top`` kernel names by summed time (``top_kernels``: name, kind, count, ms)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict = {"kernels": 0, "gemm_ms": 0.0, "attention_ms": 0.0, "other_ms": 0.0}
    by_name: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or ev.device_time <= 0:
            continue
        out["kernels"] += 1
        ms = ev.device_time / 1e3  # device_time is in microseconds
        out[f"{kernel_kind(ev.name)}_ms"] += ms
        entry = by_name.setdefault(ev.name, [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    if top:
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        out["top_kernels"] = [{"name": name[:160], "kind": kernel_kind(name), "count": c, "ms": round(ms, 4)}
                              for name, (c, ms) in ranked]
    return out


def bandwidth(device: torch.device, timer: Timer) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.randn(n // 4, device=device)
    y = torch.empty_like(x)
    ms = statistics.median(timer(lambda: y.copy_(x), 10))
    return 2 * x.numel() * 4 / (ms / 1e3)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--budgets", default="15,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--level-reps", type=int, default=3, help="repetitions of the slow level-by-level verify")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time the graphed rows with Target.compile")
    ap.add_argument("--profile", action="store_true", help="kernel-time breakdown of one forward (CUDA only)")
    return ap.parse_args()


class Bench:
    """One run: the model with its prefilled state and drafter, the options, and the rows measured so far
    (each row is printed as it is measured)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        dev = torch.device(args.device)
        self.dev = dev
        t0 = time.time()
        self.target = build(args.shape, DTYPES[args.dtype], args.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.target.model.parameters())
        self.timer = Timer(dev)
        self.bw = bandwidth(dev, self.timer)
        self.floor_ms = 1e3 * self.weight_bytes / self.bw
        print(f"built {args.shape} ({self.weight_bytes / 1e9:.1f} GB) in {time.time() - t0:.1f} s; copy bandwidth "
              f"{self.bw / 1e12:.2f} TB/s; weight-streaming floor {self.floor_ms:.2f} ms", flush=True)
        self.gen = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(0, self.target.vocab_size, (args.prefix,), generator=self.gen)
        self.drafter = random_drafter(self.target)
        with torch.no_grad():
            self.state, pf = self.target.prefill(self.prompt.to(dev), capture=tuple(self.drafter.target_layer_ids))
            self.drafter.extend(pf.context, torch.arange(args.prefix, device=dev), self.prompt.to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        self.resident = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        self.rows: list[dict] = []
        self.one = torch.zeros(1, dtype=torch.long, device=dev)
        self.use_graphs = dev.type == "cuda" and not args.no_graphs

    # -- rows ----------------------------------------------------------------------------------------
    def add(self, name: str, budget, times: list[float], leaky_ms: float | None = None,
            extra: dict | None = None) -> None:
        med = statistics.median(times)
        row = {"what": name, "budget": budget, "median_ms": med, "min_ms": min(times), "max_ms": max(times),
               "x_floor": med / self.floor_ms, "x_leaky": (med / leaky_ms) if leaky_ms else None, **(extra or {})}
        self.rows.append(row)
        lk = f"{row['x_leaky']:.2f}× leaky" if row["x_leaky"] else ""
        print(f"{name:28s} B={str(budget):>4s} {med:9.2f} ms [{min(times):.2f}–{max(times):.2f}] "
              f"{row['x_floor']:6.2f}× floor {lk}", flush=True)

    def try_graph(self, name: str, budget, fn, leaky_ms: float | None = None) -> float | None:
        """Time ``fn`` as a CUDA-graph replay (CUDA, unless --no-graphs); a failed capture is a row too."""
        if not self.use_graphs:
            return None
        try:
            times = self.timer(capture(fn)[0], self.args.reps)
        except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash: report why
            print(f"{name:28s} B={str(budget):>4s} capture failed: {type(exc).__name__}: {exc}", flush=True)
            self.rows.append({"what": name, "budget": budget, "error": f"{type(exc).__name__}: {exc}"})
            return None
        self.add(name, budget, times, leaky_ms)
        return statistics.median(times)

    def breakdown(self, name: str, budget, fn) -> None:
        """With --profile on CUDA: the kernel-time breakdown of one run of ``fn``."""
        if self.dev.type != "cuda" or not self.args.profile:
            return
        k = kernel_breakdown(fn)
        total = k["gemm_ms"] + k["attention_ms"] + k["other_ms"]
        floor_ms = self.floor_ms
        self.rows.append({"what": f"kernels: {name}", "budget": budget, **k, "gemm_x_floor": k["gemm_ms"] / floor_ms})
        print(f"{'  kernels: ' + name:28s} B={str(budget):>4s} {k['kernels']:6d} kernels, {total:8.2f} ms: GEMM "
              f"{k['gemm_ms']:.2f} ({k['gemm_ms'] / floor_ms:.2f}× floor), attention {k['attention_ms']:.2f}, "
              f"other {k['other_ms']:.2f}", flush=True)

    def step_rows(self, kind: str, b: int, leaky_ms: float) -> None:
        """The fixed-shape end-to-end step (:func:`fixed_shape_step`): its check against eager and its phases."""
        res = fixed_shape_step(self.target, self.drafter, self.state, int(self.prompt[-1]), b, self.timer,
                               max(3, self.args.reps // 2), self.use_graphs)
        if "error" in res:
            print(f"{'reference step, ' + kind:28s} B={b:>4d} failed: {res['error']}", flush=True)
            self.rows.append({"what": f"reference step, {kind}", "budget": b, "error": res["error"]})
            return
        print(f"{kind + ' step equals eager':28s} B={b:>4d} {'yes' if res['equal'] else 'NO'} "
              f"(max |Δ logit| {res['logit_err']:.3g}, max |Δ draft log-prob| {res['draft_err']:.3g})", flush=True)
        self.add(f"  draft: propose, {kind}", b, res["times"]["draft"])
        self.add(f"verify+walk+commit, {kind}", b, res["times"]["verify"], leaky_ms)
        self.add(f"reference step, {kind}", b, res["times"]["step"], leaky_ms,
                 {"equals_eager": res["equal"], "max_abs_logit_diff": res["logit_err"],
                  "max_abs_draft_diff": res["draft_err"]})

    # -- the benchmark -------------------------------------------------------------------------------
    def decode_rows(self) -> None:
        """A plain one-token decode step: eager, graphed, and its kernel breakdown."""
        target, state, one = self.target, self.state, self.one
        self.add("decode step (1 token)", "-",
                 self.timer(lambda: target.forward(state, one + 7, one - 1, one), self.args.reps))
        self.try_graph("decode step, graphed", "-", self.decode_step)
        self.breakdown("decode step", "-", self.decode_step)

    def decode_step(self):
        """One token through the target, without host checks (graphable)."""
        one = self.one
        return self.target.forward(self.state, one + 7, one - 1, one, validate=False)

    def budget_rows(self, b: int) -> tuple[tuple, float]:
        """Every row of budget ``b`` over one DDTree-shaped tree from peaked random draft log-probs; returns the
        tree's tokens, parents and depths on the device, and the leaky forward's median (ms)."""
        lp = torch.log_softmax(3 * torch.randn(15, self.target.vocab_size, generator=self.gen), dim=-1)
        tree = build_ddtree(int(self.prompt[-1]), lp, b)
        tt, tp, td = tree.tokens.to(self.dev), tree.parents.to(self.dev), tree.depths.to(self.dev)
        leaky_ms = self.verify_rows(b, tree, (tt, tp, td))
        self.phase_rows(b, leaky_ms)
        return (tt, tp, td), leaky_ms

    def verify_rows(self, b: int, tree, tensors: tuple) -> float:
        """The leaky forward, the exact verify (tree chunk, eager and graphed; depth levels) and the commit;
        returns the leaky forward's median (ms)."""
        target, state, timer, reps = self.target, self.state, self.timer, self.args.reps
        tt, tp, td = tensors
        target.gdn_method = "chunk"
        leaky = timer(lambda: target.forward(state, tt, tp, td, leaky=True), reps)
        leaky_ms = statistics.median(leaky)
        self.add("leaky masked forward", b, leaky)
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        chunk = timer(lambda: target.forward(state, tt, tp, td), reps)
        peak = (torch.cuda.max_memory_allocated() - self.resident) / 1e9 if self.dev.type == "cuda" else None
        self.add("exact verify: tree chunk", b, chunk, leaky_ms, {"peak_extra_gb": peak})
        g_leaky = self.try_graph("leaky forward, graphed", b, lambda: target.forward(state, tt, tp, td, leaky=True,
                                                                                    validate=False))
        self.try_graph("exact tree chunk, graphed", b, lambda: target.forward(state, tt, tp, td, validate=False),
                       g_leaky)
        self.breakdown("exact tree chunk", b, lambda: target.forward(state, tt, tp, td, validate=False))
        fwd = target.forward(state, tt, tp, td)
        path = tree.path(int(tree.depths.argmax()))
        self.add("commit", b, timer(lambda: state.commit(fwd, path), reps))
        target.gdn_method = "levels"
        levels = timer(lambda: target.forward(state, tt, tp, td), self.args.level_reps, 1)
        self.add("exact verify: depth levels", b, levels, leaky_ms)
        target.gdn_method = "chunk"
        return leaky_ms

    def phase_rows(self, b: int, leaky_ms: float) -> None:
        """The phases of the end-to-end step side by side (the drafter and the host-side tree builder), the
        eager step, and the fixed-shape (graphed on CUDA) step."""
        target, drafter, state, prompt, reps = self.target, self.drafter, self.state, self.prompt, self.args.reps
        self.add("  draft: propose", b, self.timer(lambda: drafter.propose(int(prompt[-1]), state.length), reps))
        lp_dev = drafter.propose(int(prompt[-1]), state.length)
        self.add("  tree: build_ddtree", b, self.timer(lambda: build_ddtree(int(prompt[-1]), lp_dev, b), reps))

        def step() -> None:
            lp2 = drafter.propose(int(prompt[-1]), state.length)
            tr = build_ddtree(int(prompt[-1]), lp2, b)
            f = target.forward(state, tr.tokens, tr.parents, tr.depths, capture=tuple(drafter.target_layer_ids))
            acc = tr.walk_greedy(f.logits.argmax(-1).cpu())
            state.commit(f, acc)

        self.add("reference step (end to end)", b, self.timer(step, max(3, reps // 2)), leaky_ms)
        self.step_rows("graphed" if self.use_graphs else "fixed-shape", b, leaky_ms)

    def compiled_rows(self, trees: dict[int, tuple], leaky_by_budget: dict[int, float]) -> None:
        """The graphed rows again, each layer's pieces through torch.compile (the drafter stays eager)."""
        target, state = self.target, self.state
        kind = "compiled+graphed" if self.use_graphs else "compiled"
        if not self.compile_checked(trees):
            return
        self.try_graph(f"decode step, {kind}", "-", self.decode_step)
        self.breakdown("decode step, compiled", "-", self.decode_step)
        for b, (tt, tp, td) in trees.items():
            g_leaky = self.try_graph(f"leaky forward, {kind}", b,
                                     lambda: target.forward(state, tt, tp, td, leaky=True, validate=False))
            self.try_graph(f"exact tree chunk, {kind}", b, lambda: target.forward(state, tt, tp, td, validate=False),
                           g_leaky)
            self.breakdown("exact tree chunk, compiled", b, lambda: target.forward(state, tt, tp, td, validate=False))
            self.step_rows(kind, b, leaky_by_budget[b])

    def compile_checked(self, trees: dict[int, tuple]) -> bool:
        """Compile the target, every shape once, each checked against the eager forward; False (and an error
        row) when the compiler fails."""
        target, state, one = self.target, self.state, self.one
        eager_out = {b: target.forward(state, *trees[b], validate=False).logits for b in trees}
        t0 = time.time()
        target.compile()
        try:
            for b, (tt, tp, td) in trees.items():  # compile every shape once, and check it against eager
                err = float((target.forward(state, tt, tp, td, validate=False).logits - eager_out[b]).abs().max())
                target.forward(state, tt, tp, td, leaky=True, validate=False)
                self.rows.append({"what": "compiled forward vs eager", "budget": b, "max_abs_logit_diff": err})
                print(f"{'compiled equals eager':28s} B={b:>4d} max |Δ logit| {err:.3g}", flush=True)
            target.forward(state, one + 7, one - 1, one, validate=False)
        except Exception as exc:  # noqa: BLE001 - a compiler failure is this row's result, not a crash
            print(f"compile failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            self.rows.append({"what": "compile", "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            return False
        print(f"compiled every shape in {time.time() - t0:.1f} s", flush=True)
        return True

    def summary(self) -> dict:
        return {"shape": self.args.shape, "dtype": self.args.dtype, "device": str(self.dev), "prefix": self.args.prefix,
                "weight_gb": self.weight_bytes / 1e9, "bandwidth_tb_s": self.bw / 1e12, "floor_ms": self.floor_ms,
                "rows": self.rows, "gpu": torch.cuda.get_device_name() if self.dev.type == "cuda" else None,
                "torch": torch.__version__}


def main() -> None:
    args = parse_args()
    bench = Bench(args)
    trees: dict[int, tuple] = {}
    leaky_by_budget: dict[int, float] = {}
    with torch.no_grad():
        bench.decode_rows()
        for b in [int(x) for x in args.budgets.split(",")]:
            trees[b], leaky_by_budget[b] = bench.budget_rows(b)
        if args.compile:
            bench.compiled_rows(trees, leaky_by_budget)
    out = bench.summary()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
