"""Shared builders and comparisons for the trace-format tests (not a test module)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pyarrow as pa
import torch

from refcheck.trace import (
    RequestRow,
    StateEntry,
    StepRow,
    Trace,
    write_trace,
)
from refcheck.trace import io as trace_io
from refcheck.trace import schema as trace_schema
from refcheck.trace.rows import defaults

TIMINGS = {"draft": 0.001, "tree": 0.0002, "verify": 0.01, "commit": 0.0005}


# ------------------------------------------------------------------------------- helpers
def f32(x: float) -> float:
    """The float32 value of ``x`` (what a float32 column stores)."""
    return torch.tensor(x, dtype=torch.float32).item()


def tensors_identical(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bits (NaN payloads included)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    # Compare raw words: bit-exact, and NaN == NaN.
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def floats_equal(a: list, b: list) -> bool:
    """Nested float lists equal, NaN equal to NaN."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(
            floats_equal(x, y) for x, y in zip(a, b)
        )
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_steps_equal(a: StepRow, b: StepRow) -> None:
    for name in (
        "request_id", "step", "committed_len", "tree_tokens", "tree_parents", "tree_depths",
        "tree_ranks", "draft_topk_ids", "topk_ids", "target_argmax", "accepted", "accept_length",
        "bonus", "emitted", "timings", "node_draws",
    ):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    for name in ("draft_topk_logprobs", "topk_logprobs", "emitted_logprobs", "node_uniforms"):
        assert floats_equal(getattr(a, name), getattr(b, name)), name
    assert tensors_identical(a.layer_sketch, b.layer_sketch)
    assert len(a.state) == len(b.state)
    for x, y in zip(a.state, b.state):
        assert (x.name, x.layer, x.kind) == (y.name, y.layer, y.kind)
        assert tensors_identical(x.sketch, y.sketch), x.name
        assert tensors_identical(x.full, y.full), x.name


def assert_traces_equal(a: Trace, b: Trace) -> None:
    assert a.provenance == b.provenance
    assert a.schema_version == b.schema_version
    assert len(a.requests) == len(b.requests)
    for x, y in zip(a.requests, b.requests):
        assert (x.request_id, x.kind, x.prompt_ids, x.output_ids) == (
            y.request_id, y.kind, y.prompt_ids, y.output_ids,
        )  # fmt: skip
        assert floats_equal(x.output_logprobs, y.output_logprobs)
        for name in ("temperature", "top_k", "top_p", "seed", "rng", "rng_request"):
            assert getattr(x, name) == getattr(y, name), name
        assert floats_equal(x.first_uniform, y.first_uniform)
    assert len(a.steps) == len(b.steps)
    for x, y in zip(a.steps, b.steps):
        assert_steps_equal(x, y)


def make_step(rid: str, step: int, gen: torch.Generator, n: int = 6, depth: int = 3, k: int = 2) -> StepRow:
    """A plausible tree step: chain of ``depth`` plus siblings, bf16/fp16/fp32 state tensors."""
    parents = [-1] + [max(0, i - 2) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    ranks = [0] + [(i + 1) % 2 for i in range(1, n)]
    tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
    lp = lambda *shape: [[f32(-abs(v)) for v in row] for row in torch.randn(*shape, generator=gen).tolist()]  # noqa: E731
    accepted = [0, 1, 3][: 1 + step % 3]
    kv = torch.randn(2, 4, 8, generator=gen)
    state = [
        StateEntry("layers.0.k", 0, "kv_k", kv[0].to(torch.bfloat16), kv.to(torch.bfloat16)),
        StateEntry("layers.0.v", 0, "kv_v", kv[1].to(torch.float16), None),
        StateEntry("layers.1.conv", 1, "conv", torch.randn(3, 5, generator=gen), torch.randn(3, 5, 7, generator=gen)),
        StateEntry("layers.1.rec", 1, "rec", torch.tensor(float("nan")).to(torch.bfloat16), None),
    ]
    emitted = [tokens[i] for i in accepted[1:]] + [7]
    emitted_lp = [f32(-0.5 * (i + 1)) for i in range(len(emitted))]
    emitted_lp[0] = float("nan")  # an engine that does not report this logprob
    return StepRow(
        request_id=rid,
        step=step,
        committed_len=10 + 3 * step,
        tree_tokens=tokens,
        tree_parents=parents,
        tree_depths=depths,
        tree_ranks=ranks,
        draft_topk_ids=torch.randint(0, 1000, (depth, k), generator=gen).tolist(),
        draft_topk_logprobs=lp(depth, k),
        topk_ids=torch.randint(0, 1000, (n, k), generator=gen).tolist(),
        topk_logprobs=lp(n, k),
        target_argmax=torch.randint(0, 1000, (n,), generator=gen).tolist(),
        accepted=accepted,
        accept_length=len(accepted),
        bonus=7,
        emitted=emitted,
        emitted_logprobs=emitted_lp,
        state=state,
        timings=dict(TIMINGS),
        layer_sketch=(torch.randn(2, n, 4, generator=gen).to(torch.bfloat16) if step % 2 == 0 else None),
        node_draws=[-1] + torch.randint(0, 1000, (n - 1,), generator=gen).tolist() if step % 2 else [],
        node_uniforms=[float("nan")] + torch.rand(n - 1, generator=gen, dtype=torch.float64).tolist() if step % 2 else [],
    )


def make_trace(n_requests: int = 2, n_steps: int = 4) -> Trace:
    gen = torch.Generator().manual_seed(0)
    requests = [
        RequestRow(f"req-{i}", "chat", list(range(5 + i)), list(range(100, 110)), [f32(-0.1 * j) for j in range(10)])
        for i in range(n_requests)
    ]
    if n_requests > 1:  # a sampled request beside greedy ones (schema 1.2)
        requests[1] = RequestRow(requests[1].request_id, "chat", requests[1].prompt_ids, requests[1].output_ids,
                                 requests[1].output_logprobs, temperature=0.7, top_k=20, top_p=0.9, seed=2**40 + 3,
                                 rng="refcheck-philox-position", rng_request=1, first_uniform=0.25)
    steps = [make_step(r.request_id, s, gen) for r in requests for s in range(n_steps)]
    provenance = {
        "engine": "reference",
        "model": {"target": "hybrid", "dtype": "bfloat16"},
        "budget": 15,
        "seed": 0,
        "temperature": 0.0,
        "prompts_sha256": "ab" * 32,
        "tags": ["a", "é", "日本"],
        "null": None,
    }
    return Trace(provenance=provenance, requests=requests, steps=steps)


def make_trace_file(tmp_path: Path) -> tuple[Trace, Path]:
    trace = make_trace()
    path = tmp_path / "case.arrow"
    write_trace(trace, path)
    return trace, path


def rewrite(src: Path, dst: Path, table_fn=lambda t: t, meta_fn=lambda m: m) -> None:
    """Rewrite a trace file by hand: transform its steps table and its schema metadata."""
    reader = pa.ipc.open_file(pa.memory_map(str(src)))
    table = table_fn(reader.read_all())
    meta = meta_fn(dict(reader.schema.metadata))
    Path(dst).write_bytes(trace_io.sealed_file_bytes(table.schema.with_metadata(meta), table.to_batches()))


def rewrite_legacy(src: Path, dst: Path, table_fn=lambda t: t, meta_fn=lambda m: m) -> None:
    """Like :func:`rewrite`, as a schema 1.0 writer would: no checksum keys."""
    reader = pa.ipc.open_file(pa.memory_map(str(src)))
    table = table_fn(reader.read_all())
    meta = {k: v for k, v in meta_fn(dict(reader.schema.metadata)).items() if k not in trace_schema.CHECKSUM_KEYS}
    meta.setdefault(trace_schema.KEY_VERSION, b"1.0")
    with pa.ipc.new_file(str(dst), table.schema.with_metadata(meta)) as w:
        w.write_table(table.replace_schema_metadata(meta))


def requests_blob(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, trace_schema.REQUESTS_SCHEMA) as w:
        rows = [{**defaults(RequestRow), **r} for r in rows]  # the columns since 1.2: their defaults unless given
        w.write_table(pa.Table.from_pylist(rows, schema=trace_schema.REQUESTS_SCHEMA))
    return sink.getvalue().to_pybytes()


def dir_listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))
