"""The SGLang side of scripts/bench_sglang_verify.py: one engine per budget, in a child process.

Contract: :func:`sglang_phase` (the parent) writes a job, starts ``python bench_sglang_engine.py JOB``
in a session of its own with the timing plugin installed (:mod:`bench_sglang_timing`), kills the
session after its limit, reads the result file and groups the plugin's spans by timed pass.
:func:`run_child` (the child) starts ``sglang.Engine``, runs one warm generate, the timed generates
and two prefill-only generates, and rewrites the result file atomically at every stage, so a child
killed mid-run still leaves what it measured. :func:`summarise_sglang` turns a result into per-step
figures (see bench_sglang_verify's docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_sglang_timing import ENV_TIMES, ROOT, attribute_times, install_timing_plugin, span_stats

if str(ROOT) not in sys.path:  # refcheck from the checkout (the bundle puts it on PYTHONPATH too)
    sys.path.insert(0, str(ROOT))

def write_json(path: Path, payload: dict) -> None:
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
        write_json(result, res)
    # the prompt alone (one new token: no verify step); also flushes the plugin's last pending spans
    res["prefill_only"] = [one_pass(engine, job, f"prefill-{k}", 1) for k in range(2)]


def run_child(job_path: str) -> int:
    """``--sglang-child JOB``: one engine, its passes, reported through JOB's result file at every stage."""
    from refcheck.sglang.child import summarise_error

    job = json.loads(Path(job_path).read_text())
    result = Path(job["result"])
    res: dict[str, Any] = {"stage": "import"}
    try:
        import sglang
    except ImportError as exc:
        write_json(result, {**res, "stage": "failed", "failed_at": "import", "error": summarise_error(exc)})
        return 3
    res["sglang"] = str(getattr(sglang, "__version__", "unknown"))
    t0 = time.time()
    try:
        engine = sglang.Engine(**job["engine_kwargs"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        write_json(result, {**res, "stage": "failed", "failed_at": "start", "error": summarise_error(exc)})
        return 4
    res.update(stage="started", start_s=time.time() - t0)
    write_json(result, res)
    try:
        _passes(engine, job, res, result)
        res["stage"] = "done"
    except Exception as exc:  # noqa: BLE001
        res.update(stage="failed", failed_at="generate", error=summarise_error(exc))
    write_json(result, res)
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - the results are written already
        pass
    return 0 if res["stage"] == "done" else 5


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
        "verify_forward": span_stats(verify), "spec_step": span_stats(steps),
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
    from refcheck.sglang.engine_process import log_error

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
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(job_path)],
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


if __name__ == "__main__":
    sys.exit(run_child(sys.argv[1]))
