"""Trace bytes per verify step at another model depth: a captured trace's steps with its state entries
replaced by those of an L-layer hybrid target, in the state-sketch form and in the one-sketch-per-row form.

Usage::

    python scripts/state_bytes.py TRACE [--layers 64] [--attention-every 4] [--value-heads 48] [--conv-rows 3]

Sketch bytes do not depend on the model's widths, only on its layer count and kinds: every step keeps the
trace's own nodes, top-k, drafter side and timings, and gets ``kv_k``/``kv_v`` entries for each attention
layer (every ``--attention-every``-th, as Qwen3.5 / 3.6 lay them out) and ``conv``/``rec`` entries for each
linear-attention layer, filled with seeded random values in the form an engine records: ``[1, 16]`` in the
trace's own sketch dtype, or ``[rows, 16]`` float32 (``rec`` one row per value head, ``conv`` ``--conv-rows``,
KV one per accepted node). Prints one JSON object: the trace's bytes per step as written, without state, and
at the given depth in both forms (Arrow + zstd, as ``write_trace`` writes it: ``trace_bytes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refcheck.sketch import SKETCH_DIM  # noqa: E402
from refcheck.trace.io import StepRow, Trace, read_trace, trace_bytes  # noqa: E402


def _bytes_per_step(trace: Trace) -> float:
    return len(trace_bytes(trace)) / max(1, len(trace.steps))  # the bytes write_trace would write


def deepened(trace: Trace, layers: int, attention_every: int, heads: int, conv_rows: int, rows_form: bool) -> Trace:
    """``trace`` with every step's state replaced by an ``layers``-deep target's entries (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    template = next(e for s in trace.steps for e in s.state)
    dtype = template.sketch.dtype

    def entry(name: str, layer: int, kind: str, rows: int) -> object:
        if rows_form:
            sketch = torch.randn(rows, SKETCH_DIM, generator=gen)
        else:  # the recorded dtype: bfloat16 for bfloat16 engines
            sketch = torch.randn(1, SKETCH_DIM, generator=gen).mul(30).to(dtype)
        return dataclasses.replace(template, name=name, layer=layer, kind=kind, sketch=sketch, full=None)

    def step(s: StepRow) -> StepRow:
        state = []
        for layer in range(layers):
            if layer % attention_every == attention_every - 1:
                state += [entry(f"{k}.{layer}", layer, k, len(s.accepted)) for k in ("kv_k", "kv_v")]
            else:
                state += [entry(f"conv.{layer}", layer, "conv", conv_rows), entry(f"rec.{layer}", layer, "rec", heads)]
        return dataclasses.replace(s, state=state)

    return dataclasses.replace(trace, steps=[step(s) for s in trace.steps])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--attention-every", type=int, default=4)
    ap.add_argument("--value-heads", type=int, default=48)
    ap.add_argument("--conv-rows", type=int, default=3)
    args = ap.parse_args(argv)
    trace = read_trace(args.trace)
    if not any(s.state for s in trace.steps):
        print(f"state_bytes: {args.trace} holds no state entries", file=sys.stderr)
        return 2
    bare = dataclasses.replace(trace, steps=[dataclasses.replace(s, state=[]) for s in trace.steps])
    out = {"trace": str(args.trace), "steps": len(trace.steps), "layers": args.layers,
           "as_written": args.trace.stat().st_size / len(trace.steps), "without_state": _bytes_per_step(bare)}
    for form, rows in (("state_sketch", False), ("row_sketches", True)):
        deep = deepened(trace, args.layers, args.attention_every, args.value_heads, args.conv_rows, rows)
        out[form] = _bytes_per_step(deep)
        out["entries_per_step"] = len(deep.steps[0].state)
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
