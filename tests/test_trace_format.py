"""Tests for refcheck/trace: exact round trip, tensor codec, atomic writes, typed errors for every
bad-input mode, schema versioning, and the sha256 manifest."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.errors import EXIT_CORRUPT, EXIT_GOLDEN, CorruptTraceError, GoldenError
from refcheck.trace import (
    DTYPE_NAMES,
    SCHEMA_VERSION,
    Manifest,
    RequestRow,
    SchemaVersionError,
    StateEntry,
    StepRow,
    Trace,
    TraceValidationError,
    decode_tensor,
    encode_tensor,
    load_manifest,
    read_trace,
    sha256_file,
    trace_bytes,
    write_trace,
)
from refcheck.trace import io as trace_io
from refcheck.trace import schema as trace_schema

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
        "bonus", "emitted", "timings",
    ):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    for name in ("draft_topk_logprobs", "topk_logprobs", "emitted_logprobs"):
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
    )


def make_trace(n_requests: int = 2, n_steps: int = 4) -> Trace:
    gen = torch.Generator().manual_seed(0)
    requests = [
        RequestRow(f"req-{i}", "chat", list(range(5 + i)), list(range(100, 110)), [f32(-0.1 * j) for j in range(10)])
        for i in range(n_requests)
    ]
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


@pytest.fixture
def trace_file(tmp_path: Path) -> tuple[Trace, Path]:
    trace = make_trace()
    path = tmp_path / "case.arrow"
    write_trace(trace, path)
    return trace, path


def rewrite(src: Path, dst: Path, table_fn=lambda t: t, meta_fn=lambda m: m) -> None:
    """Rewrite a trace file by hand: transform its steps table and its schema metadata."""
    reader = pa.ipc.open_file(pa.memory_map(str(src)))
    table = table_fn(reader.read_all())
    meta = meta_fn(dict(reader.schema.metadata))
    schema = table.schema.with_metadata(meta)
    with pa.ipc.new_file(str(dst), schema) as w:
        w.write_table(table.replace_schema_metadata(meta))


def requests_blob(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, trace_schema.REQUESTS_SCHEMA) as w:
        w.write_table(pa.Table.from_pylist(rows, schema=trace_schema.REQUESTS_SCHEMA))
    return sink.getvalue().to_pybytes()


# ---------------------------------------------------------------------------- round trip
def test_round_trip_realistic(trace_file: tuple[Trace, Path]) -> None:
    trace, path = trace_file
    back = read_trace(path)
    assert back.schema_version == SCHEMA_VERSION == "1.0"
    assert_traces_equal(trace, back)
    # bf16 bit-exact, explicitly
    s0, b0 = trace.steps[0], back.steps[0]
    assert b0.state[0].sketch.dtype == torch.bfloat16
    assert torch.equal(b0.state[0].sketch.view(torch.int16), s0.state[0].sketch.view(torch.int16))
    assert torch.equal(b0.layer_sketch.view(torch.int16), s0.layer_sketch.view(torch.int16))
    assert b0.state[1].sketch.dtype == torch.float16 and b0.state[1].full is None
    assert math.isnan(b0.emitted_logprobs[0])
    assert [s.step for s in back.steps_of("req-1")] == [0, 1, 2, 3]
    assert back.request("req-0").prompt_ids == list(range(5))


def test_steps_of_sorts_by_step() -> None:
    trace = make_trace(n_requests=1, n_steps=3)
    trace.steps.reverse()
    assert [s.step for s in trace.steps_of("req-0")] == [0, 1, 2]
    assert trace.steps_of("nope") == []


def test_write_returns_size_and_is_deterministic(tmp_path: Path) -> None:
    trace = make_trace()
    n = write_trace(trace, tmp_path / "a.arrow")
    assert n == (tmp_path / "a.arrow").stat().st_size == len(trace_bytes(trace))
    write_trace(trace, tmp_path / "b.arrow")
    assert sha256_file(tmp_path / "a.arrow") == sha256_file(tmp_path / "b.arrow")


def test_codec_all_dtypes_bit_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    for name in DTYPE_NAMES:
        base = torch.randn(3, 4, 5, generator=gen) * 50
        if name == "bool":
            t = base > 0
        else:
            t = base.to(getattr(torch, name))
        for view in (t, t[:, 1:3].transpose(0, 1), t[0, 0, 0], t[:0]):  # non-contiguous, 0-d, empty
            back = decode_tensor(encode_tensor(view))
            assert back.is_contiguous() and back.device.type == "cpu"
            assert tensors_identical(view.contiguous(), back), name
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert tensors_identical(decode_tensor(encode_tensor(special.to(dtype))), special.to(dtype))
    nan_payload = torch.tensor([0x7FC1, -1], dtype=torch.int16).view(torch.bfloat16)
    assert tensors_identical(decode_tensor(encode_tensor(nan_payload)), nan_payload)


def test_codec_errors() -> None:
    good = encode_tensor(torch.ones(2, 3))
    with pytest.raises(CorruptTraceError, match="needs 24 bytes"):
        decode_tensor({**good, "data": good["data"][:-1]})
    with pytest.raises(CorruptTraceError, match="unknown dtype"):
        decode_tensor({**good, "dtype": "complex64"})
    with pytest.raises(CorruptTraceError, match="invalid shape"):
        decode_tensor({**good, "shape": [-2, -3]})
    with pytest.raises(CorruptTraceError):
        decode_tensor({"dtype": "float32"})
    with pytest.raises(TraceValidationError, match="cannot store"):
        encode_tensor(torch.ones(2, dtype=torch.complex64))


# ------------------------------------------------------------------------ property test
@st.composite
def steps_strategy(draw: st.DrawFn, rid: str, step: int) -> StepRow:
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    k = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 5))
    i32 = st.integers(-(2**31), 2**31 - 1)
    f32s = st.floats(width=32, allow_nan=True, allow_infinity=True)
    ids = lambda rows: draw(st.lists(st.lists(i32, min_size=k, max_size=k), min_size=rows, max_size=rows))  # noqa: E731
    lps = lambda rows: draw(st.lists(st.lists(f32s, min_size=k, max_size=k), min_size=rows, max_size=rows))  # noqa: E731
    accepted = [0] + draw(st.lists(st.integers(0, n - 1), max_size=n - 1))
    n_emit = draw(st.integers(0, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    state = [
        StateEntry(
            name=draw(st.text(max_size=8)),
            layer=draw(st.integers(0, 64)),
            kind=draw(st.sampled_from(trace_schema.STATE_KINDS)),
            sketch=(torch.randn(tuple(shape), generator=gen) * 100).to(dtype),
            full=draw(st.none() | st.just(torch.randn(2, 3, generator=gen).to(dtype))),
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    has_sketch = draw(st.booleans())
    return StepRow(
        request_id=rid,
        step=step,
        committed_len=draw(st.integers(0, 2**31 - 1)),
        tree_tokens=draw(st.lists(i32, min_size=n, max_size=n)),
        tree_parents=parents,
        tree_depths=depths,
        tree_ranks=draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)),
        draft_topk_ids=ids(depth),
        draft_topk_logprobs=lps(depth),
        topk_ids=ids(n),
        topk_logprobs=lps(n),
        target_argmax=draw(st.lists(i32, min_size=n, max_size=n)),
        accepted=accepted,
        accept_length=len(accepted),
        bonus=draw(i32),
        emitted=draw(st.lists(i32, min_size=n_emit, max_size=n_emit)),
        emitted_logprobs=draw(st.lists(f32s, min_size=n_emit, max_size=n_emit)),
        state=state,
        timings={f: draw(st.floats(0, 10)) for f in trace_schema.TIMING_FIELDS},
        layer_sketch=torch.randn(2, n, 3, generator=gen).to(dtype) if has_sketch else None,
    )


@st.composite
def traces_strategy(draw: st.DrawFn) -> Trace:
    ids = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3, unique=True))
    requests = [
        RequestRow(
            rid,
            draw(st.sampled_from(["chat", "code", ""])),
            draw(st.lists(st.integers(0, 50_000), max_size=8)),
            out := draw(st.lists(st.integers(0, 50_000), max_size=8)),
            draw(st.lists(st.floats(width=32), min_size=len(out), max_size=len(out))),
        )
        for rid in ids
    ]
    steps = [draw(steps_strategy(rid, s)) for rid in ids for s in range(draw(st.integers(0, 3)))]
    provenance = draw(
        st.dictionaries(
            st.text(max_size=5),
            st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.lists(st.integers(), max_size=3),
            max_size=4,
        )
    )
    return Trace(provenance=provenance, requests=requests, steps=steps)


@settings(max_examples=30, deadline=None)
@given(trace=traces_strategy())
def test_round_trip_property(trace: Trace) -> None:
    back = trace_io.trace_from_bytes(trace_bytes(trace))
    assert_traces_equal(trace, back)


# ------------------------------------------------------------------------ atomic write
def _dir_listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def test_atomic_write_failure_at_replace_keeps_old_file(
    trace_file: tuple[Trace, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = trace_file
    before = path.read_bytes()
    listing = _dir_listing(path.parent)

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(trace_io.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        write_trace(make_trace(n_requests=1, n_steps=1), path)
    assert path.read_bytes() == before
    assert _dir_listing(path.parent) == listing  # no temp file left behind


def test_atomic_write_failure_mid_write_keeps_old_file(
    trace_file: tuple[Trace, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = trace_file
    before = path.read_bytes()
    listing = _dir_listing(path.parent)
    real_fsync = os.fsync

    def fsync_then_fail(fd: int) -> None:
        real_fsync(fd)
        raise KeyboardInterrupt  # even a BaseException cleans up

    monkeypatch.setattr(trace_io.os, "fsync", fsync_then_fail)
    with pytest.raises(KeyboardInterrupt):
        write_trace(make_trace(n_requests=1, n_steps=1), path)
    assert path.read_bytes() == before
    assert _dir_listing(path.parent) == listing


def test_invalid_trace_is_not_written(trace_file: tuple[Trace, Path]) -> None:
    _, path = trace_file
    before = path.read_bytes()
    bad = make_trace(n_requests=1, n_steps=1)
    bad.steps[0].emitted_logprobs = bad.steps[0].emitted_logprobs[:-1]
    with pytest.raises(TraceValidationError, match="emitted_logprobs"):
        write_trace(bad, path)
    assert path.read_bytes() == before
    assert _dir_listing(path.parent) == ["case.arrow"]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.requests.clear(), "no requests"),
        (lambda t: t.requests.append(t.requests[0]), "duplicate request id"),
        (lambda t: setattr(t.steps[0], "request_id", "ghost"), "unknown request"),
        (lambda t: setattr(t.steps[1], "step", 0), "step 0 twice"),
        (lambda t: setattr(t.steps[0], "tree_parents", [-1]), "tree_parents"),
        (lambda t: setattr(t.steps[0], "accepted", [0, 99]), "out of range"),
        (lambda t: setattr(t.steps[0], "timings", {"draft": 1.0}), "timings"),
        (lambda t: setattr(t.steps[0].state[0], "kind", "kv"), "kind"),
        (lambda t: setattr(t.steps[0], "layer_sketch", torch.zeros(2, 3)), "layer_sketch"),
        (lambda t: setattr(t.steps[0], "step", 2**40), "do not fit"),
        (lambda t: t.steps[0].tree_tokens.__setitem__(0, None), "do not fit|null"),
        (lambda t: t.steps[0].accepted.append(None), "wrongly typed"),
        (lambda t: setattr(t.steps[0], "emitted", None), "wrongly typed"),
        (lambda t: setattr(t, "provenance", {"x": float("nan")}), "provenance"),
        (lambda t: setattr(t, "provenance", {1: "int key"}), "provenance"),
    ],
)
def test_write_validation(mutate, match: str) -> None:
    trace = make_trace(n_requests=1, n_steps=2)
    mutate(trace)
    with pytest.raises(TraceValidationError, match=match):
        trace_bytes(trace)


# --------------------------------------------------------------------------- bad inputs
def test_nonexistent_is_golden_error(tmp_path: Path) -> None:
    with pytest.raises(GoldenError, match="no trace") as exc:
        read_trace(tmp_path / "missing.arrow")
    assert exc.value.exit_code == EXIT_GOLDEN


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.arrow").write_bytes(b"")
    with pytest.raises(CorruptTraceError, match="empty") as exc:
        read_trace(tmp_path / "e.arrow")
    assert exc.value.exit_code == EXIT_CORRUPT


def test_wrong_magic(tmp_path: Path) -> None:
    (tmp_path / "t.arrow").write_text("request_id,step\nfoo,1\n")
    with pytest.raises(CorruptTraceError, match=r"not an Arrow IPC file \(bad magic\)"):
        read_trace(tmp_path / "t.arrow")


@pytest.mark.parametrize("cut", ["last100", "half", "header"])
def test_truncated(trace_file: tuple[Trace, Path], tmp_path: Path, cut: str) -> None:
    _, path = trace_file
    data = path.read_bytes()
    data = {"last100": data[:-100], "half": data[: len(data) // 2], "header": data[:8]}[cut]
    bad = tmp_path / "cut.arrow"
    bad.write_bytes(data)
    with pytest.raises(CorruptTraceError, match="truncated or corrupt"):
        read_trace(bad)


def test_flipped_bytes_detected(trace_file: tuple[Trace, Path]) -> None:
    trace, path = trace_file
    directory = path.parent
    manifest = Manifest()
    manifest.record("case", path.name, sha256_file(path), path.stat().st_size, {"engine": "reference"})
    manifest.save(directory)
    assert load_manifest(directory).verify(directory) == []
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 4):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    # The manifest always catches it ...
    problems = load_manifest(directory).verify(directory)
    assert len(problems) == 1 and "sha256 mismatch" in problems[0]
    # ... and a read either fails with the typed error or returns (no pyarrow exception leaks).
    try:
        read_trace(path)
    except CorruptTraceError:
        pass


def test_random_bit_flips_raise_only_typed_errors() -> None:
    """Whatever a bit flip hits, reading returns a trace or raises CorruptTraceError."""
    import random

    data = trace_bytes(make_trace(n_requests=1, n_steps=2))
    rng = random.Random(0)
    for _ in range(150):
        b = bytearray(data)
        for _ in range(rng.choice([1, 4])):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        try:
            trace_io.trace_from_bytes(bytes(b))
        except CorruptTraceError:
            pass


def test_arrow_file_without_refcheck_metadata(tmp_path: Path) -> None:
    path = tmp_path / "plain.arrow"
    table = pa.table({"request_id": ["a"], "step": pa.array([0], pa.int32())})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    with pytest.raises(CorruptTraceError, match="not a refcheck trace"):
        read_trace(path)


def test_missing_column(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "nocol.arrow"
    rewrite(path, bad, table_fn=lambda t: t.drop_columns(["accepted", "bonus"]))
    with pytest.raises(CorruptTraceError, match="lacks required column.*accepted, bonus"):
        read_trace(bad)


def test_wrong_column_type(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "type.arrow"

    def widen(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index("step")
        # int64 instead of the schema's int32: a schema error
        return t.set_column(i, pa.field("step", pa.int64(), nullable=False), t.column("step").cast(pa.int64()))

    rewrite(path, bad, table_fn=widen)
    with pytest.raises(CorruptTraceError, match="'step' has type int64"):
        read_trace(bad)


def test_null_in_required_value(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "null.arrow"

    def null_bonus(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index("bonus")
        col = pa.array([None] + t.column("bonus").to_pylist()[1:], pa.int32())
        return t.set_column(i, pa.field("bonus", pa.int32(), nullable=False), col)

    rewrite(path, bad, table_fn=null_bonus)
    with pytest.raises(CorruptTraceError, match="null value in required field bonus"):
        read_trace(bad)


def test_newer_major_version(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "v2.arrow"
    rewrite(path, bad, meta_fn=lambda m: {**m, b"refcheck.schema_version": b"2.0"})
    with pytest.raises(SchemaVersionError) as exc:
        read_trace(bad)
    assert "2.0" in str(exc.value) and "1.0" in str(exc.value)
    assert isinstance(exc.value, CorruptTraceError) and exc.value.exit_code == EXIT_CORRUPT


@pytest.mark.parametrize("version", ["1.0", "1.7"])
def test_same_major_any_minor_accepted(trace_file: tuple[Trace, Path], tmp_path: Path, version: str) -> None:
    trace, path = trace_file
    other = tmp_path / "minor.arrow"
    # a newer minor may add columns: they are ignored
    extra = lambda t: t.append_column("future_column", pa.array([1] * t.num_rows, pa.int8()))  # noqa: E731
    rewrite(path, other, table_fn=extra, meta_fn=lambda m: {**m, b"refcheck.schema_version": version.encode()})
    back = read_trace(other)
    assert back.schema_version == version
    back.schema_version = SCHEMA_VERSION
    assert_traces_equal(trace, back)


def test_unparsable_version(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "vx.arrow"
    rewrite(path, bad, meta_fn=lambda m: {**m, b"refcheck.schema_version": b"one"})
    with pytest.raises(CorruptTraceError, match="unparsable schema version"):
        read_trace(bad)


def test_read_routes_through_migrations(
    trace_file: tuple[Trace, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, path = trace_file
    old = tmp_path / "v0.arrow"
    # a fictitious 0.9 where `bonus` was called `bonus_token`
    rewrite(
        path,
        old,
        table_fn=lambda t: t.rename_columns(["bonus_token" if n == "bonus" else n for n in t.column_names]),
        meta_fn=lambda m: {**m, b"refcheck.schema_version": b"0.9"},
    )
    with pytest.raises(CorruptTraceError, match="lacks required column.*bonus"):
        read_trace(old)

    def upgrade(steps: pa.Table, requests: pa.Table) -> tuple[pa.Table, pa.Table]:
        names = ["bonus" if n == "bonus_token" else n for n in steps.column_names]
        return steps.rename_columns(names), requests

    monkeypatch.setitem(trace_schema._MIGRATIONS, (0, 9), trace_schema.Migration(to=(1, 0), upgrade=upgrade))
    back = read_trace(old)
    assert back.schema_version == "0.9"
    back.schema_version = SCHEMA_VERSION
    assert_traces_equal(trace, back)


def test_zero_requests(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "empty.arrow"
    rewrite(
        path,
        bad,
        table_fn=lambda t: t.slice(0, 0),
        meta_fn=lambda m: {**m, b"refcheck.requests": requests_blob([])},
    )
    with pytest.raises(CorruptTraceError, match="empty trace"):
        read_trace(bad)


@pytest.mark.parametrize(
    "meta_fn, match",
    [
        (lambda m: {**m, b"refcheck.provenance": b"{not json"}, "provenance is not valid JSON"),
        (lambda m: {**m, b"refcheck.provenance": b"[1, 2]"}, "not an object"),
        (lambda m: {**m, b"refcheck.requests": b"garbage"}, "requests table is corrupt"),
        (lambda m: {k: v for k, v in m.items() if k != b"refcheck.requests"}, "lacks refcheck.requests"),
        (lambda m: {**m, b"refcheck.magic": b"something-else"}, "not a refcheck trace"),
    ],
)
def test_bad_metadata(trace_file: tuple[Trace, Path], tmp_path: Path, meta_fn, match: str) -> None:
    _, path = trace_file
    bad = tmp_path / "meta.arrow"
    rewrite(path, bad, meta_fn=meta_fn)
    with pytest.raises(CorruptTraceError, match=match):
        read_trace(bad)


def test_steps_of_unknown_request_in_file(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    _, path = trace_file
    bad = tmp_path / "orphan.arrow"
    rewrite(path, bad, meta_fn=lambda m: {**m, b"refcheck.requests": requests_blob([
        {"request_id": "req-0", "kind": "chat", "prompt_ids": [1], "output_ids": [], "output_logprobs": []}
    ])})  # fmt: skip
    with pytest.raises(CorruptTraceError, match="unknown request 'req-1'"):
        read_trace(bad)


def test_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(CorruptTraceError, match="cannot read"):
        read_trace(tmp_path)


# ----------------------------------------------------------------------------- manifest
def test_manifest_round_trip_and_history(tmp_path: Path) -> None:
    trace = make_trace(n_requests=1, n_steps=2)
    path = tmp_path / "greedy.arrow"
    size = write_trace(trace, path)
    digest = sha256_file(path)

    with pytest.raises(GoldenError):
        load_manifest(tmp_path)
    manifest = load_manifest(tmp_path, allow_missing=True)
    assert manifest.cases == {}
    manifest.record("greedy", path.name, digest, size, {"engine": "reference", "seed": 0})
    manifest.save(tmp_path)
    saved = json.loads((tmp_path / "MANIFEST.json").read_text())
    assert saved["version"] == 1
    assert saved["cases"]["greedy"] == {
        "file": "greedy.arrow",
        "sha256": digest,
        "bytes": size,
        "provenance": {"engine": "reference", "seed": 0},
        "history": [],
    }

    loaded = load_manifest(tmp_path)
    assert loaded.to_json() == manifest.to_json()
    assert loaded.verify(tmp_path) == []

    # same hash again: no history entry
    loaded.record("greedy", path.name, digest, size, {"engine": "reference", "seed": 0}, reason="noop")
    assert loaded.cases["greedy"].history == []

    # regenerate with a change: history appended
    trace.steps[0].bonus = 123
    size2 = write_trace(trace, path)
    digest2 = sha256_file(path)
    assert digest2 != digest
    loaded.record("greedy", path.name, digest2, size2, {"engine": "reference", "seed": 1}, reason="seed bump")
    loaded.save(tmp_path)
    again = load_manifest(tmp_path)
    (h,) = again.cases["greedy"].history
    assert (h.sha256_old, h.sha256_new, h.reason) == (digest, digest2, "seed bump")
    assert h.provenance_old == {"engine": "reference", "seed": 0}
    assert h.provenance_new == {"engine": "reference", "seed": 1}
    assert h.time.endswith("+00:00")
    assert again.verify(tmp_path) == []

    # explicit `previous` (e.g. from another manifest) seeds a fresh case's history
    fresh = Manifest()
    fresh.record("greedy", path.name, "00" * 32, 1, {}, reason="r2", previous=again.cases["greedy"])
    assert [x.sha256_new for x in fresh.cases["greedy"].history] == [digest2, "00" * 32]


def test_manifest_verify_lists_problems(tmp_path: Path) -> None:
    for name in ("a.arrow", "b.arrow"):
        (tmp_path / name).write_bytes(name.encode())
    manifest = Manifest()
    manifest.record("a", "a.arrow", sha256_file(tmp_path / "a.arrow"), 7, {})
    manifest.record("b", "b.arrow", "0" * 64, 7, {})
    manifest.record("c", "c.arrow", "1" * 64, 7, {})
    problems = manifest.verify(tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith("b: b.arrow sha256 mismatch")
    assert problems[1] == "c: c.arrow is missing"


@pytest.mark.parametrize(
    "text, exc, match",
    [
        ("{not json", CorruptTraceError, "not valid JSON"),
        ("[]", CorruptTraceError, "not a JSON object"),
        ('{"version": 1}', CorruptTraceError, "lacks 'cases'"),
        ('{"version": 2, "cases": {}}', SchemaVersionError, "newer"),
        ('{"version": 1, "cases": {"x": {"file": "../x", "sha256": "", "bytes": 1, "provenance": {}, "history": []}}}',
         CorruptTraceError, "plain file name"),
        ('{"version": 1, "cases": {"x": {"file": "x", "sha256": "", "bytes": "1", "provenance": {}, "history": []}}}',
         CorruptTraceError, "'bytes' has the wrong type"),
    ],
)  # fmt: skip
def test_manifest_malformed(tmp_path: Path, text: str, exc: type, match: str) -> None:
    (tmp_path / "MANIFEST.json").write_text(text)
    with pytest.raises(exc, match=match):
        load_manifest(tmp_path)


def test_manifest_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = Manifest()
    manifest.record("a", "a.arrow", "0" * 64, 1, {})
    manifest.save(tmp_path)
    before = (tmp_path / "MANIFEST.json").read_bytes()
    manifest.record("b", "b.arrow", "1" * 64, 1, {})
    monkeypatch.setattr(trace_io.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("nope")))
    with pytest.raises(OSError):
        manifest.save(tmp_path)
    assert (tmp_path / "MANIFEST.json").read_bytes() == before
    assert _dir_listing(tmp_path) == ["MANIFEST.json"]
