#!/usr/bin/env python
"""refcheck beside SGLang at real model width: build the ``real`` pair on the GPU, run it, measure.

    python scripts/real_width.py build --out /tmp/real [--layers 8] [--device cuda] [--seed 0]
    scripts/sglang_bundle.sh run python3 scripts/real_width.py run --pair-dir /tmp/real --out /tmp/real-results \\
        [--algorithms REFCHECK_DDTREE,NGRAM,DFLASH] [--max-new-tokens 32] [--mem-fraction 0.45]

``build`` writes DIR/target (a hybrid with Qwen3.6-27B's widths, ``--layers`` of its 64, random bf16 weights
built on the device: :func:`refcheck.models.build.build_real_pair`), DIR/draft (a DFlash drafter of z-lab's
Qwen3.6-27B-DFlash shape for it) and DIR/build.json, and prints parameter counts, bytes and wall seconds
as JSON. ``--tiny`` builds the same layout at a test scale (hidden 64, vocab 1000) for a dry run anywhere.
At 8 layers the target is 5.6 B parameters (11.2 GB bf16), the drafter 1.7 B (3.5 GB); the reference holds
both in fp32 (29 GB) once SGLang has exited.

``run`` (``--tp 2``: SGLang over two GPUs, the suite's ``-tp2`` configurations) diffs SGLang against the reference
for each algorithm through ``scripts/sglang_suite.py``'s
``run_config`` (one ``python -m refcheck diff --engine sglang --model DIR/target --draft DIR/draft ...
--ref-device cuda --ref-dtype float32 --mode both --save-trace`` process, then a bf16 ``--mode replay`` of the
saved trace): REFCHECK_DDTREE at budget 15 (config ``ddtree-b15``), NGRAM at budget 11 and BFS breadth 10
(``ngram``), DFLASH at the draft's block size - 1 = 15 (``dflash``). The files are the suite's, named by
config: OUT/<config>.arrow, .fp32.json, .bf16.json, .log. OUT/summary.json (merged with an earlier one, so
algorithms can run in separate calls) holds per algorithm the suite's entry (rc, verdicts, counts, τ, largest
deviations, engine start) and:

* ``trace``: file bytes, step rows, **bytes per verify step** (file bytes / step rows), mean tree nodes per
  step, and the uncompressed Arrow bytes per step of each column (the file is zstd-compressed; the columns
  show where the bytes go);
* ``diffed_steps_per_s_fp32``: step rows / (process wall - engine start - SGLang's generate), i.e. the
  reference's share of the live diff (loading the fp32 pair, replay and free run); the report carries no
  timing of its own; ``diffed_steps_per_s_bf16_replay``: step rows / the bf16 replay's whole process wall
  (its model load included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from anywhere: the repository's refcheck first
if str(HERE) not in sys.path:  # the suite beside this script (scripts/ is not a package)
    sys.path.insert(0, str(HERE))

#: algorithm -> the scripts/sglang_suite.py configuration that runs it
ALGORITHMS = {"REFCHECK_DDTREE": "ddtree-b15", "NGRAM": "ngram", "DFLASH": "dflash",
              # an injected SGLang fault (refcheck/sglang/ddtree/faults.py): the verdict must fail it at its onset
              "REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX": "ddtree-fault-mamba-flat-index"}


def suite() -> ModuleType:
    """scripts/sglang_suite.py (its ``run_config``); scripts/ is on the path."""
    import sglang_suite

    return sglang_suite


def build(args: argparse.Namespace) -> dict:
    from refcheck.models.build import REAL_TINY, SHARD_BYTES, build_real_pair

    t0 = time.perf_counter()
    info = build_real_pair(args.out, args.layers, args.seed, args.device, REAL_TINY if args.tiny else None,
                           SHARD_BYTES if args.shard_gib is None else int(args.shard_gib * (1 << 30)))
    info["wall_s"]["process"] = round(time.perf_counter() - t0, 3)
    (Path(args.out) / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def trace_stats(path: Path) -> dict:
    """Size of a saved trace: file bytes, step rows, bytes per step, nodes per step, the uncompressed Arrow
    bytes per step of each column (largest first), and the engine's generate seconds (its provenance)."""
    import pyarrow as pa

    from refcheck.trace.io import read_trace

    trace = read_trace(path)  # checksums and structure checked
    rows = len(trace.steps)
    size = path.stat().st_size
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    per_column = {name: round(table.column(name).nbytes / max(rows, 1), 1) for name in table.column_names}
    meta = sum(len(v) for v in (table.schema.metadata or {}).values())  # provenance + requests table
    return {"file": str(path), "bytes": size, "step_rows": rows, "requests": len(trace.requests),
            "bytes_per_step": round(size / rows, 1) if rows else None,
            "nodes_per_step": round(sum(len(s.tree_tokens) for s in trace.steps) / rows, 2) if rows else None,
            "metadata_bytes": meta,
            "uncompressed_bytes_per_step": dict(sorted(per_column.items(), key=lambda kv: -kv[1])),
            "generate_s": trace.provenance.get("engine", {}).get("settings", {}).get("generate_s")}


def rates(entry: dict, stats: dict) -> dict:
    """Diffed steps per second of the live fp32 diff (its reference share) and of the bf16 replay."""
    rows = stats.get("step_rows") or 0
    generate_s = stats.get("generate_s")
    out: dict = {}
    start = entry.get("engine_start_s")
    if rows and start is not None and generate_s is not None:
        diff_s = entry["wall_s"] - start - generate_s
        out["diff_s_fp32"] = round(diff_s, 1)
        out["diffed_steps_per_s_fp32"] = round(rows / diff_s, 2) if diff_s > 0 else None
    bf16 = entry.get("bf16") or {}
    if rows and bf16.get("wall_s"):
        out["diffed_steps_per_s_bf16_replay"] = round(rows / bf16["wall_s"], 2)
    return out


def pair_info(pair_dir: Path) -> dict:
    """The pair's shape from its configs, and its bytes on disk."""
    t = json.loads((pair_dir / "target" / "config.json").read_text())
    d = json.loads((pair_dir / "draft" / "config.json").read_text())

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())

    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "tie_word_embeddings")
    return {"target": {k: t.get(k) for k in keys}, "draft_layers": d.get("num_hidden_layers"),
            "draft_target_layer_ids": (d.get("dflash_config") or {}).get("target_layer_ids"),
            "target_bytes": size(pair_dir / "target"), "draft_bytes": size(pair_dir / "draft")}


def run_one(algorithm: str, args: argparse.Namespace, module: ModuleType) -> dict:
    """One algorithm through the suite's run_config, plus the trace's size and the diff's rate."""
    name = ALGORITHMS[algorithm] + (f"-tp{args.tp}" if args.tp > 1 else "")
    ns = argparse.Namespace(model=str(args.pair_dir / "target"), draft=str(args.pair_dir / "draft"), pair="hybrid",
                            max_new_tokens=args.max_new_tokens, mem_fraction=args.mem_fraction, timeout=args.timeout,
                            parallel=1, no_bf16_replay=args.no_bf16_replay)
    trace = args.out / f"{name}.arrow"
    trace.unlink(missing_ok=True)  # an earlier call's trace must not pass for this run's when this one fails
    entry = {"config": name, **module.run_config(name, ns, args.out)}
    if trace.is_file():
        entry["trace"] = trace_stats(trace)
        entry |= rates(entry, entry["trace"])
    return entry


def run(args: argparse.Namespace) -> dict:
    algorithms = [a.strip().upper() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {', '.join(unknown)} (choose from {', '.join(ALGORITHMS)})")
    for sub in ("target", "draft"):
        if not (args.pair_dir / sub / "config.json").is_file():
            raise SystemExit(f"{args.pair_dir / sub} is not a checkpoint directory (build it: real_width.py build)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary["pair"] = pair_info(args.pair_dir)
    module = suite()
    for algorithm in algorithms:
        summary[algorithm] = run_one(algorithm, args, module)
        print(algorithm, json.dumps(summary[algorithm]), flush=True)
        path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="Write DIR/target and DIR/draft (random weights built on the device).")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--layers", type=int, default=8, help="Target layers, a multiple of 4 (64: the full shape).")
    b.add_argument("--device", default="cuda")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--shard-gib", type=float, default=None, help="Largest checkpoint shard, GiB (default 5).")
    b.add_argument("--tiny", action="store_true", help="The test scale (hidden 64, vocab 1000): a dry run anywhere.")
    r = sub.add_parser("run", help="Diff SGLang against the reference on a built pair, per algorithm.")
    r.add_argument("--pair-dir", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--algorithms", default="REFCHECK_DDTREE,NGRAM,DFLASH")
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--mem-fraction", type=float, default=0.45, help="SGLang's mem_fraction_static.")
    r.add_argument("--tp", type=int, choices=(1, 2), default=1,
                   help="SGLang's tensor parallelism (2: the suite's -tp2 configurations, on two GPUs).")
    r.add_argument("--timeout", type=float, default=540.0, help="Per diff process, seconds.")
    r.add_argument("--no-bf16-replay", action="store_true", help="Skip the bf16 replay of each trace.")
    args = ap.parse_args(argv)
    from refcheck.errors import RefcheckError

    try:
        if args.command == "build":
            print(json.dumps(build(args), indent=1))
        else:
            run(args)
    except RefcheckError as exc:  # a user error (e.g. --layers 6): its message and exit code, no traceback
        print(f"real_width: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
