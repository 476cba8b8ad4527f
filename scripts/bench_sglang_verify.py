#!/usr/bin/env python
"""SGLang's graphed tree-verify step beside the reference's compiled + graphed exact verify, at the
Qwen3.6-27B shape, in one run on one GPU.

    scripts/sglang_bundle.sh run python3 scripts/bench_sglang_verify.py --out OUT.json   # one H200
    python scripts/bench_sglang_verify.py --dry-run [--model-dir DIR] [--out PLAN.json]   # anywhere

Contract. Writes a Qwen3.6-27B-shaped ``config.json`` (the widths of ``bench_verify.SHAPES
["qwen3.6-27b"]``: 64 layers, 48 Gated DeltaNet + 16 gated full attention at 3:1, hidden 5120,
vocab 248320; ``Qwen3_5ForCausalLM`` / ``qwen3_5_text`` with the fields SGLang reads,
:func:`refcheck.models.build._sglang_fields`), then, sequentially on the one GPU:

1. for each budget B (default 15 and 64): ``sglang.Engine`` with random weights
   (``load_format="dummy"``: no files), bf16, triton attention and linear attention, NGRAM with
   ``B + 1`` draft tokens (its corpus always pads the tree to that size, so every verify forward
   runs ``B + 1`` tokens), decode CUDA graphs captured for batch size 1 only (prefill graphs off),
   page size 1, radix cache off, one request at a time, overlap scheduling as SGLang defaults it
   (``--no-overlap`` turns it off; an overlapped engine that measured nothing is run once more
   without it, and so are the later budgets). One warm generate, ``--sglang-reps`` timed generates of
   ``--max-new-tokens`` (greedy, ``ignore_eos``) on a repetitive ``--prompt-len``-token prompt, two
   prefill-only generates (one new token). SGLang runs in a child process of this script (SGLang
   kills its whole process tree when a scheduler dies; the child also frees the GPU completely on
   exit). A timing plugin (an ``sglang.srt.plugins`` entry point in a throw-away ``.dist-info``)
   records, in the scheduler process, CUDA-event spans of every verify forward
   (``ModelRunner.forward`` in TARGET_VERIFY mode, with whether it replayed the CUDA graph) and of
   every NGRAM decode step (``NGRAMWorker.forward_batch_generation``: the n-gram draft on the host,
   the verify forward, greedy tree acceptance, KV move and mamba-state commit). A span runs from
   its start event to its end event on the stream: host-side gaps inside it count.
2. the reference (bench_verify's ``build`` / ``Timer`` / ``bandwidth``): the same shape in bf16, a
   prefix of the mean context SGLang's timed steps saw (prompt + half the new tokens; override
   ``--ref-prefix``), a DDTree of B + 1 nodes per budget from peaked random draft log-probs, the
   exact verify (one tree chunk, ``validate=False``) as a CUDA-graph replay, eager layers and then
   :meth:`Target.compile` layers (checked against eager logits first).

Figures per budget (JSON ``budgets`` rows; medians, min–max in the phase records):

* ``sglang_verify_forward_ms``: SGLang's graphed verify forward alone (GPU span of the model
  runner's forward: graph-input copies, attention metadata, replay). The like-for-like partner of
  ``reference_verify_ms`` (the reference's graph replay of the exact tree chunk).
* ``sglang_spec_step_ms``: the span of SGLang's whole NGRAM decode step (draft + verify + accept +
  commit); ``sglang_step_ms``: (generate wall − prefill-only wall) / verify steps, i.e. scheduling,
  the round trips between SGLang's processes and everything else included: an upper bound for its
  verify alone. ``sglang_step_ms_raw`` does not subtract the prefill.
* ratios ``reference / SGLang`` against the forward and the step (≤ 1: the reference is no slower),
  and both sides over bench_verify's weight-streaming floor (weights / measured copy bandwidth).

Time: ``--time-limit`` seconds from start (default 540, for a 600 s command): each SGLang phase is
killed at ``--sglang-phase-limit`` or when only ``--ref-reserve`` seconds would be left for the
reference; a phase that cannot start in time is skipped and named in ``skipped``; the JSON is
rewritten after every phase, so a run cut short still leaves what it measured. Exit 0 when both
sides were measured for every budget, 1 otherwise. ``--dry-run`` writes the config, prints the
engine arguments and the plan and touches no GPU; ``--phases reference --ref-shape small
--ref-device cpu`` runs the reference phase's plumbing on a CPU (graph capture's eager stand-in).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # refcheck / reference from the checkout (the bundle puts it on PYTHONPATH too)
    sys.path.insert(0, str(ROOT))

SHAPE = "qwen3.6-27b"
ENV_TIMES = "BENCH_SGLANG_VERIFY_TIMES"  # the timing plugin appends its JSON lines here (unset: inert)
PLUGIN = "bench_sglang_verify_timing"
MAX_POSITIONS = 8192  # as bench_verify.build; prompt + new tokens + tree stay far below it


# -- the model directory and SGLang's arguments ------------------------------------------------------------
def load_bench_verify() -> Any:
    """scripts/bench_verify.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_verify", HERE / "bench_verify.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_config(shape: dict[str, int]) -> dict[str, Any]:
    """config.json of a Qwen3.6-style hybrid text model of ``shape`` (bench_verify.SHAPES widths)."""
    from refcheck.models.build import _sglang_fields

    n = shape["num_hidden_layers"]
    cfg: dict[str, Any] = dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", dtype="bfloat16", torch_dtype="bfloat16",
        **shape,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (n // 4),  # as bench_verify.build
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
        attention_dropout=0.0, attn_output_gate=True, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False, initializer_range=0.02, use_cache=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
    )
    return _sglang_fields(cfg)  # full_attention_interval, top-level rope_theta / partial_rotary_factor


def write_config(model_dir: Path, shape: dict[str, int]) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(target_config(shape), indent=2, sort_keys=True) + "\n")
    return model_dir


def engine_kwargs(model_dir: Path, budget: int, mem_fraction: float = 0.65, overlap: bool = True,
                  ngram_breadth: int = 10) -> dict[str, Any]:
    """``sglang.Engine`` arguments for one budget: refcheck's runner settings (token ids in and out,
    triton attention and linear attention, radix cache off, page size 1, NGRAM with ``budget + 1``
    draft tokens), with dummy weights, decode graphs for batch size 1 only and prefill graphs off."""
    from refcheck.errors import UsageError
    from refcheck.runners.sglang import MAX_TREE_TOKENS
    from refcheck.runners.sglang import engine_kwargs as refcheck_engine_kwargs
    from refcheck.spec import EngineSpec

    if not 1 <= budget < MAX_TREE_TOKENS:
        raise UsageError(f"budget {budget}: SGLang verifies trees of 2 to {MAX_TREE_TOKENS} tokens")
    kw = refcheck_engine_kwargs(EngineSpec(dtype="bfloat16", device="cuda"), str(model_dir), "NGRAM",
                                cuda_graphs=True, mem_fraction_static=mem_fraction, budget=budget,
                                ngram_breadth=ngram_breadth, max_running=1)
    kw.update(load_format="dummy",  # random weights initialised on the GPU: no checkpoint files
              disable_overlap_schedule=not overlap,
              cuda_graph_max_bs_decode=1,  # capture the verify graph for one request only (start-up time)
              disable_prefill_cuda_graph=True)  # the prompt runs once per generate; its graphs would cost start-up
    return kw


def make_prompt(n: int, vocab: int, period: int = 48, seed: int = 0) -> list[int]:
    """A repetitive prompt (a random ``period``-token phrase over and over) of ids below ``vocab``."""
    rng = random.Random(seed)
    phrase = [rng.randrange(16, vocab) for _ in range(period)]
    return [phrase[i % period] for i in range(n)]


def parse_budgets(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# -- the timing plugin (runs inside SGLang's scheduler process) -------------------------------------------
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
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PLUGIN} = bench_sglang_verify:register_timing\n")
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


# -- the SGLang child process ---------------------------------------------------------------------------------
def _write_json(path: Path, payload: dict) -> None:
    from refcheck.atomic_file import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(payload, indent=1).encode(), durable=False)  # whole or absent


def one_pass(engine: Any, job: dict, rid: str, max_new: int) -> dict[str, Any]:
    """One generate of the job's prompt: wall time and SGLang's own counts."""
    t0 = time.time()
    out = engine.generate(input_ids=job["input_ids"], rid=rid,
                          sampling_params={"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True})
    t1 = time.time()
    meta = out.get("meta_info", {})
    keep = ("completion_tokens", "prompt_tokens", "spec_verify_ct", "spec_accept_length", "spec_accept_rate",
            "e2e_latency")
    return {"rid": rid, "max_new_tokens": max_new, "t0": t0, "t1": t1, "wall_s": t1 - t0,
            **{k: meta[k] for k in keep if isinstance(meta.get(k), (int, float))}}


def _passes(engine: Any, job: dict, res: dict, result: Path) -> None:
    res["warm"] = one_pass(engine, job, "warm", job["max_new_tokens"])
    res["timed"] = []
    guess = 1.5 * res["warm"]["wall_s"]  # the warm pass also compiles the prefill's kernels: an upper bound
    for k in range(job["reps"]):
        if time.time() + guess > job["deadline"]:
            res["stopped_early"] = f"{k} of {job['reps']} timed passes (time limit)"
            break
        res["timed"].append(one_pass(engine, job, f"timed-{k}", job["max_new_tokens"]))
        _write_json(result, res)
    # the prompt alone (one new token: no verify step); also flushes the plugin's last pending spans
    res["prefill_only"] = [one_pass(engine, job, f"prefill-{k}", 1) for k in range(2)]


def run_child(job_path: str) -> int:
    """``--sglang-child JOB``: one engine, its passes, reported through JOB's result file at every stage."""
    from refcheck.runners.sglang_child import summarise_error

    job = json.loads(Path(job_path).read_text())
    result = Path(job["result"])
    res: dict[str, Any] = {"stage": "import"}
    try:
        import sglang
    except ImportError as exc:
        _write_json(result, {**res, "stage": "failed", "failed_at": "import", "error": summarise_error(exc)})
        return 3
    res["sglang"] = str(getattr(sglang, "__version__", "unknown"))
    t0 = time.time()
    try:
        engine = sglang.Engine(**job["engine_kwargs"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        _write_json(result, {**res, "stage": "failed", "failed_at": "start", "error": summarise_error(exc)})
        return 4
    res.update(stage="started", start_s=time.time() - t0)
    _write_json(result, res)
    try:
        _passes(engine, job, res, result)
        res["stage"] = "done"
    except Exception as exc:  # noqa: BLE001
        res.update(stage="failed", failed_at="generate", error=summarise_error(exc))
    _write_json(result, res)
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - the results are written already
        pass
    return 0 if res["stage"] == "done" else 5


# -- the parent: one SGLang phase per budget ------------------------------------------------------------------
def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "n": len(xs)}


def summarise_sglang(res: dict) -> dict[str, Any]:
    """Per-step figures of one SGLang phase's timed passes (see the module docstring)."""
    timed = [p for p in res.get("timed", []) if p.get("spec_verify_ct")]
    if not timed:
        return {}
    prefill = statistics.median(p["wall_s"] for p in res["prefill_only"]) if res.get("prefill_only") else 0.0
    fwd = res.get("forward_times", {})
    verify = [ms for p in timed for ms in fwd.get(p["rid"], {}).get("verify_forward", [])]
    steps = [ms for p in timed for ms in fwd.get(p["rid"], {}).get("spec_step", [])]
    graphed = [g for p in timed for g in fwd.get(p["rid"], {}).get("graphed", [])]
    return {
        "step_ms": statistics.median(1e3 * (p["wall_s"] - prefill) / p["spec_verify_ct"] for p in timed),
        "step_ms_raw": statistics.median(1e3 * p["wall_s"] / p["spec_verify_ct"] for p in timed),
        "prefill_only_s": prefill,
        "verify_steps": [p["spec_verify_ct"] for p in timed],
        "tokens_per_s": statistics.median(p.get("completion_tokens", 0) / p["wall_s"] for p in timed),
        "accept_length": statistics.median(p.get("spec_accept_length", 0.0) for p in timed),
        "verify_forward": _stats(verify), "spec_step": _stats(steps),
        "verify_graphed": f"{sum(bool(g) for g in graphed)} of {len(graphed)}",
    }


def gpu_used_gb(wait_below_gb: float | None = None, timeout_s: float = 60.0) -> float | None:
    """GPU memory in use (GB, nvidia-smi: no CUDA context in this process), after waiting up to
    ``timeout_s`` for it to drop below ``wait_below_gb``; None without nvidia-smi."""
    t0 = time.time()
    while True:
        try:
            text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=20).stdout
            used = float(text.split()[0]) * 2**20 / 1e9  # MiB
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None
        if wait_below_gb is None or used < wait_below_gb or time.time() - t0 > timeout_s:
            return used
        time.sleep(2)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it, SGLang's schedulers, their helpers
    except (ProcessLookupError, PermissionError):
        pass


def sglang_phase(budget: int, kw: dict, prompt: list[int], args: argparse.Namespace, work: Path,
                 limit_s: float) -> dict[str, Any]:
    """One engine for ``budget`` in a child process, killed after ``limit_s``; its result file, summarised."""
    from refcheck.runners.sglang import log_error

    job_path, result, times = work / f"sglang-b{budget}.job.json", work / f"sglang-b{budget}.result.json", \
        work / f"sglang-b{budget}.times.jsonl"
    log = args.log_dir / f"sglang-b{budget}.log"
    for p in (result, times):
        p.unlink(missing_ok=True)
    job_path.write_text(json.dumps({"engine_kwargs": kw, "input_ids": prompt, "max_new_tokens": args.max_new_tokens,
                                    "reps": args.sglang_reps, "deadline": time.time() + limit_s - 30,
                                    "result": str(result), "times": str(times)}))
    env = install_timing_plugin(work / "site")
    env[ENV_TIMES] = str(times)
    res_gpu = gpu_used_gb(wait_below_gb=5.0)  # SGLang sizes its pools from the memory free at its start
    t0 = time.time()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--sglang-child", str(job_path)],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
        _kill_group(proc)
        proc.wait()
    res = json.loads(result.read_text()) if result.is_file() else {"stage": "failed", "failed_at": "import"}
    res.update(rc=rc, wall_s=time.time() - t0, log=str(log), timed_out=rc is None, gpu_used_gb_at_start=res_gpu)
    # the plugin's spans by timed pass (here, not in the child: a child killed mid-run still leaves its spans)
    res["forward_times"] = attribute_times(times, {p["rid"]: (p["t0"], p["t1"]) for p in res.get("timed", [])})
    if res.get("stage") != "done":
        res["error"] = log_error(log) or res.get("error") or (f"killed after {limit_s:.0f} s" if rc is None
                                                              else f"exit code {rc}")
    res["summary"] = summarise_sglang(res)
    return res


def print_sglang(budget: int, res: dict) -> None:
    s = res.get("summary") or {}
    if not s:
        print(f"SGLang B={budget}: no timed pass ({res.get('stage')}: {res.get('error')}); log {res.get('log')}",
              flush=True)
        return
    vf = s.get("verify_forward") or {}
    print(f"SGLang B={budget}: start {res.get('start_s', 0):.0f} s; step {s['step_ms']:.2f} ms "
          f"(raw {s['step_ms_raw']:.2f}); verify forward {vf.get('median_ms', float('nan')):.2f} ms "
          f"[{vf.get('min_ms', float('nan')):.2f}–{vf.get('max_ms', float('nan')):.2f}], graphed "
          f"{s['verify_graphed']}; {s['tokens_per_s']:.1f} tok/s, accept length {s['accept_length']:.2f}, "
          f"verify steps {s['verify_steps']}", flush=True)
    if not vf:
        print(f"SGLang B={budget}: the timing plugin recorded no verify forward (is it loaded? see {res.get('log')})",
              flush=True)


# -- the reference ----------------------------------------------------------------------------------------------
def _time_graph(timer: Any, fn: Any, reps: int, use_graphs: bool = True) -> dict[str, Any]:
    """``fn`` captured as a CUDA graph (reference.graphs.capture; its eager stand-in off CUDA) and its
    replays timed; a failed capture is a result, not a crash."""
    from reference.graphs import capture

    try:
        return _stats(timer(capture(fn, use_graphs=use_graphs)[0], reps)) or {}
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def _reference_setup(bench: Any, shape: str, device: str, prefix: int,
                     budgets: list[int]) -> tuple[Any, Any, Any, dict, dict]:
    """The bf16 target with random weights on ``device``, a prefilled state, one tree per budget; the
    floor figures."""
    import torch

    from reference.tree import build_ddtree

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
                   use_graphs: bool) -> None:
    """Target.compile, then per budget: compile the node count, check it against eager, time its graph."""
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
        _compiled_rows(target, state, trees, eager, timer, args.reps, out, graphs)


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


# -- both sides together -----------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def combine(sglang: dict[str, dict], reference: dict[str, Any], budgets: list[int]) -> list[dict[str, Any]]:
    """One row per budget: both sides' figures, reference / SGLang ratios, multiples of the floor."""
    floor = reference.get("floor_ms")
    rows = []
    for b in budgets:
        s = (sglang.get(str(b)) or {}).get("summary") or {}
        r = (reference.get("budgets") or {}).get(str(b)) or {}
        ref_ms = (r.get("compiled_graphed") or {}).get("median_ms")
        fwd_ms = (s.get("verify_forward") or {}).get("median_ms")
        row = {"budget": b, "tree_tokens": b + 1, "sglang_step_ms": s.get("step_ms"),
               "sglang_step_ms_raw": s.get("step_ms_raw"), "sglang_verify_forward_ms": fwd_ms,
               "sglang_spec_step_ms": (s.get("spec_step") or {}).get("median_ms"),
               "reference_verify_ms": ref_ms,
               "reference_graphed_eager_layers_ms": (r.get("graphed") or {}).get("median_ms"),
               "ratio_ref_over_sglang_forward": _ratio(ref_ms, fwd_ms),
               "ratio_ref_over_sglang_step": _ratio(ref_ms, s.get("step_ms")),
               "floor_ms": floor, "reference_x_floor": _ratio(ref_ms, floor),
               "sglang_forward_x_floor": _ratio(fwd_ms, floor)}
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    def f(x: float | None, unit: str = "") -> str:
        return "—" if x is None else f"{x:.2f}{unit}"

    print("| B | SGLang verify forward | SGLang NGRAM step (GPU span) | SGLang step (wall / steps) | reference "
          "compiled+graphed | ref / SGLang forward | ref / SGLang step | floor |", flush=True)
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {f(r['sglang_verify_forward_ms'], ' ms')} | {f(r['sglang_spec_step_ms'], ' ms')} | "
              f"{f(r['sglang_step_ms'], ' ms')} | {f(r['reference_verify_ms'], ' ms')} | "
              f"{f(r['ratio_ref_over_sglang_forward'], '×')} | {f(r['ratio_ref_over_sglang_step'], '×')} | "
              f"{f(r['floor_ms'], ' ms')} |", flush=True)


# -- the run -----------------------------------------------------------------------------------------------------
def plan(args: argparse.Namespace, budgets: list[int]) -> list[str]:
    """What a run does, in order (printed by every run, and all of a dry run)."""
    steps = [f"SGLang NGRAM B={b} ({b + 1} draft tokens): engine start (dummy bf16 weights, decode graph for "
             f"batch size 1), 1 warm + {args.sglang_reps} timed generates of {args.max_new_tokens} tokens on a "
             f"{args.prompt_len}-token prompt, 2 prefill-only generates; killed after "
             f"{args.sglang_phase_limit:.0f} s" for b in budgets if "sglang" in args.phases]
    if "reference" in args.phases:
        steps.append(f"reference: build {args.ref_shape} bf16 on {args.ref_device}, prefill {args.ref_prefix} "
                     f"tokens, exact tree chunk of B + 1 nodes for B in {budgets} as a CUDA graph ({args.reps} "
                     "replays), then Target.compile and again")
    return steps + [f"time limit {args.time_limit:.0f} s from start; {args.ref_reserve:.0f} s kept for the reference"]


def _sglang_phases(args: argparse.Namespace, budgets: list[int], model_dir: Path, result: dict,
                   deadline: float, save: Any) -> None:
    """One engine per budget, within the time left before the reference's reserve. An engine with
    overlap scheduling that measured nothing is run once more without it (and so is every later budget)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = make_prompt(args.prompt_len, vocab)
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-verify-"))
    for b in budgets:
        for attempt in range(2):
            left = deadline - time.time() - (args.ref_reserve if "reference" in args.phases else 10)
            limit = min(args.sglang_phase_limit, left)
            if limit < args.min_sglang_s:
                result["skipped"].append(f"SGLang B={b} ({left:.0f} s left before the reference's reserve)")
                break
            kw = result["engine_kwargs"][str(b)]
            res = sglang_phase(b, kw, prompt, args, work, limit)
            if attempt:
                res["first_attempt"] = result["sglang"][str(b)]
            result["sglang"][str(b)] = res
            print_sglang(b, res)
            save()
            if res["summary"] or kw["disable_overlap_schedule"]:
                break
            print(f"SGLang B={b}: again without overlap scheduling", flush=True)
            result["overlap"] = False
            for k in result["engine_kwargs"].values():
                k["disable_overlap_schedule"] = True


def _reference(args: argparse.Namespace, budgets: list[int], result: dict, deadline: float, save: Any) -> None:
    import torch

    if deadline - time.time() < args.min_reference_s:
        result["skipped"].append(f"reference ({deadline - time.time():.0f} s left)")
        return
    result["torch"] = torch.__version__
    if args.ref_device.startswith("cuda"):
        result["free_gb_before_reference"] = wait_for_gpu(args.need_free_gb)
        result["gpu"] = torch.cuda.get_device_name()
    try:
        reference_phase(args, budgets, deadline, result["reference"], save)
    except Exception as exc:  # noqa: BLE001 - the SGLang figures are still worth writing
        result["reference"]["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        print(f"reference failed: {result['reference']['error']}", flush=True)
    result["skipped"] += result["reference"].get("skipped", [])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="15,64", help="comma-separated verify budgets (drafted nodes per tree)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sglang-reps", type=int, default=3, help="timed generates per budget")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed per reference row")
    ap.add_argument("--ref-prefix", type=int, default=None, help="default: prompt + half the new tokens")
    ap.add_argument("--mem-fraction", type=float, default=0.65, help="SGLang's mem_fraction_static")
    ap.add_argument("--ngram-breadth", type=int, default=10, help="speculative_ngram_max_bfs_breadth (> 1: trees)")
    ap.add_argument("--no-overlap", action="store_true", help="disable SGLang's overlap scheduling")
    ap.add_argument("--phases", default="sglang,reference")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds from start for the whole run")
    ap.add_argument("--sglang-phase-limit", type=float, default=240.0, help="seconds per SGLang engine, at most")
    ap.add_argument("--ref-reserve", type=float, default=150.0, help="seconds kept for the reference phase")
    ap.add_argument("--min-sglang-s", type=float, default=90.0, help="skip an SGLang phase with less time left")
    ap.add_argument("--min-reference-s", type=float, default=45.0, help="skip the reference with less time left")
    ap.add_argument("--compile-reserve", type=float, default=60.0, help="skip the compiled rows with less left")
    ap.add_argument("--need-free-gb", type=float, default=70.0, help="free GPU memory to wait for before the reference")
    ap.add_argument("--ref-shape", default=SHAPE, help="bench_verify shape of the reference (small: a CPU smoke test)")
    ap.add_argument("--ref-device", default="cuda", help="the reference's device (cpu: eager stand-ins, no graphs)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to write config.json (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (logs beside it)")
    ap.add_argument("--dry-run", action="store_true", help="write the config, print the plan and engine arguments")
    ap.add_argument("--sglang-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if args.ref_prefix is None:
        args.ref_prefix = args.prompt_len + args.max_new_tokens // 2  # the mean context of SGLang's timed steps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sglang_child:
        return run_child(args.sglang_child)
    t0 = time.time()
    deadline = t0 + args.time_limit
    budgets = parse_budgets(args.budgets)
    shape = load_bench_verify().SHAPES[SHAPE]
    model_dir = write_config(args.model_dir or Path(tempfile.mkdtemp(prefix="bench-sglang-27b-")), shape)
    args.log_dir = args.out.parent if args.out else model_dir
    args.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "shape": SHAPE, "model_dir": str(model_dir), "budgets_asked": budgets, "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens, "ref_prefix": args.ref_prefix, "overlap": not args.no_overlap,
        "plan": plan(args, budgets), "skipped": [], "sglang": {}, "reference": {},
        "engine_kwargs": {str(b): engine_kwargs(model_dir, b, args.mem_fraction, not args.no_overlap,
                                                args.ngram_breadth) for b in budgets}}

    def save() -> None:
        if args.out:
            _write_json(args.out, {**result, "elapsed_s": time.time() - t0})

    print(("dry run: " if args.dry_run else "") + f"config {model_dir / 'config.json'}", flush=True)
    for step in result["plan"]:
        print(f"  - {step}", flush=True)
    if args.dry_run:
        print(json.dumps(result["engine_kwargs"], indent=2), flush=True)
        save()
        return 0
    if "sglang" in args.phases:
        _sglang_phases(args, budgets, model_dir, result, deadline, save)
    if "reference" in args.phases:
        _reference(args, budgets, result, deadline, save)
    result["budgets"] = combine(result["sglang"], result["reference"], budgets)
    print_rows(result["budgets"])
    if result["skipped"]:
        print("skipped: " + "; ".join(result["skipped"]), flush=True)
    save()
    complete = all(r["reference_verify_ms"] is not None and r["sglang_verify_forward_ms"] is not None
                   for r in result["budgets"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
