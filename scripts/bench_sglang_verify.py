#!/usr/bin/env python
"""SGLang's graphed tree-verify step beside the reference's compiled + graphed exact verify, at the
Qwen3.6-27B shape, in one run on one GPU.

    scripts/sglang_bundle.sh run python3 scripts/bench_sglang_verify.py --out OUT.json   # one H200
    python scripts/bench_sglang_verify.py --dry-run [--model-dir DIR] [--out PLAN.json]   # anywhere

The sides live in their own modules: ``bench_sglang_engine.py`` (SGLang's engine, in a child
process), ``bench_sglang_timing.py`` (the timing plugin inside SGLang's scheduler),
``bench_sglang_reference.py`` (the reference's verify); this file writes the model, runs both and
sets them side by side.

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
   prefill-only generates (one new token). SGLang runs in a child process (bench_sglang_engine.py; SGLang
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
  and both sides over bench_verify's weight-streaming floor (weights / measured copy bandwidth);
* ``goal`` (and the last line printed): per budget whether the reference's exact verify is no slower than
  SGLang's graphed verify forward, ``met`` over all budgets (None while a side is missing).

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
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (HERE, ROOT):  # the sides' modules (scripts/ is not a package), refcheck / reference from the checkout
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_sglang_engine import print_sglang, sglang_phase, write_json  # noqa: E402
from bench_sglang_reference import load_bench_verify, make_prompt, reference_phase, wait_for_gpu  # noqa: E402

SHAPE = "qwen3.6-27b"
MAX_POSITIONS = 8192  # as bench_verify.build; prompt + new tokens + tree stay far below it


# -- the model directory and SGLang's arguments ------------------------------------------------------------
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
    from refcheck.sglang.pair import MAX_TREE_TOKENS
    from refcheck.sglang.runner import engine_kwargs as refcheck_engine_kwargs
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


def parse_budgets(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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


def goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The reference's speed goal per budget: its compiled + graphed exact verify no slower than SGLang's
    graphed verify forward (ratio <= 1). ``met`` is None when a budget lacks either side."""
    per = {str(r["budget"]): (None if r["ratio_ref_over_sglang_forward"] is None
                              else bool(r["ratio_ref_over_sglang_forward"] <= 1.0)) for r in rows}
    known = [v for v in per.values() if v is not None]
    return {"rule": "reference compiled+graphed exact verify <= SGLang graphed verify forward",
            "per_budget": per, "met": (all(known) if len(known) == len(per) else None)}


def goal_line(g: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    parts = [f"B={r['budget']} " + ("not measured" if g["per_budget"][str(r["budget"])] is None else
                                    f"{'met' if g['per_budget'][str(r['budget'])] else 'NOT met'} "
                                    f"({r['ratio_ref_over_sglang_forward']:.2f}×)") for r in rows]
    return "goal (the reference no slower than SGLang's verify forward): " + "; ".join(parts)


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
    ap.add_argument("--profile-top", type=int, default=0,
                    help="profile one compiled reference forward per budget: its N most expensive kernels")
    ap.add_argument("--ref-shape", default=SHAPE, help="bench_verify shape of the reference (small: a CPU smoke test)")
    ap.add_argument("--ref-device", default="cuda", help="the reference's device (cpu: eager stand-ins, no graphs)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to write config.json (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (logs beside it)")
    ap.add_argument("--dry-run", action="store_true", help="write the config, print the plan and engine arguments")
    args = ap.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if args.ref_prefix is None:
        args.ref_prefix = args.prompt_len + args.max_new_tokens // 2  # the mean context of SGLang's timed steps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
            write_json(args.out, {**result, "elapsed_s": time.time() - t0})

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
    result["goal"] = goal(result["budgets"])
    print_rows(result["budgets"])
    print(goal_line(result["goal"], result["budgets"]), flush=True)
    if result["skipped"]:
        print("skipped: " + "; ".join(result["skipped"]), flush=True)
    save()
    complete = all(r["reference_verify_ms"] is not None and r["sglang_verify_forward_ms"] is not None
                   for r in result["budgets"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
