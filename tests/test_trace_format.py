"""Trace format, part 1: exact round trip, tensor codec, a property test, atomic writes
(part 2, bad inputs and the manifest: test_trace_errors.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck import atomic_file
from refcheck.errors import CorruptTraceError
from refcheck.goldens.manifest import sha256_file
from refcheck.trace import (
    DTYPE_NAMES,
    SCHEMA_VERSION,
    RequestRow,
    StateEntry,
    StepRow,
    Trace,
    TraceValidationError,
    decode_tensor,
    encode_tensor,
    read_trace,
    trace_bytes,
    write_trace,
)
from refcheck.trace import io as trace_io
from refcheck.trace import schema as trace_schema

from trace_helpers import (  # noqa: E402
    assert_traces_equal,
    dir_listing,
    make_trace,
    tensors_identical,
)


# ---------------------------------------------------------------------------- round trip
def test_round_trip_realistic(trace_file: tuple[Trace, Path]) -> None:
    trace, path = trace_file
    back = read_trace(path)
    assert back.schema_version == SCHEMA_VERSION == "1.5" and back.checksummed
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
def test_atomic_write_failure_at_replace_keeps_old_file(
    trace_file: tuple[Trace, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = trace_file
    before = path.read_bytes()
    listing = dir_listing(path.parent)

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(atomic_file.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        write_trace(make_trace(n_requests=1, n_steps=1), path)
    assert path.read_bytes() == before
    assert dir_listing(path.parent) == listing  # no temp file left behind


def test_atomic_write_failure_mid_write_keeps_old_file(
    trace_file: tuple[Trace, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = trace_file
    before = path.read_bytes()
    listing = dir_listing(path.parent)
    real_fsync = os.fsync

    def fsync_then_fail(fd: int) -> None:
        real_fsync(fd)
        raise KeyboardInterrupt  # even a BaseException cleans up

    monkeypatch.setattr(atomic_file.os, "fsync", fsync_then_fail)
    with pytest.raises(KeyboardInterrupt):
        write_trace(make_trace(n_requests=1, n_steps=1), path)
    assert path.read_bytes() == before
    assert dir_listing(path.parent) == listing


def test_invalid_trace_is_not_written(trace_file: tuple[Trace, Path]) -> None:
    _, path = trace_file
    before = path.read_bytes()
    bad = make_trace(n_requests=1, n_steps=1)
    bad.steps[0].emitted_logprobs = bad.steps[0].emitted_logprobs[:-1]
    with pytest.raises(TraceValidationError, match="emitted_logprobs"):
        write_trace(bad, path)
    assert path.read_bytes() == before
    assert dir_listing(path.parent) == ["case.arrow"]


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
        (lambda t: setattr(t.steps[0], "committed_len", 2**40), "do not fit"),
            (lambda t: setattr(t.steps[0], "step", 2**40), "without gaps"),
        (lambda t: t.steps[0].tree_tokens.__setitem__(0, None), "do not fit|null"),
        (lambda t: t.steps[0].accepted.append(None), "wrongly typed"),
        (lambda t: setattr(t.steps[0], "emitted", None), "wrongly typed"),
        (lambda t: setattr(t, "provenance", {"x": float("nan")}), "provenance"),
        (lambda t: setattr(t, "provenance", {1: "int key"}), "provenance"),
        (lambda t: setattr(t.requests[0], "max_new_tokens", 0), "max_new_tokens 0"),
        (lambda t: setattr(t.requests[0], "max_new_tokens", -2), "max_new_tokens -2"),
    ],
)
def test_write_validation(mutate, match: str) -> None:
    trace = make_trace(n_requests=1, n_steps=2)
    mutate(trace)
    with pytest.raises(TraceValidationError, match=match):
        trace_bytes(trace)


def test_a_traces_fixed_bytes_do_not_grow_with_its_steps_but_with_its_provenance():
    """fixed_bytes: a golden trace's file with no record batch at all, less than the file of no steps write_trace
    writes (which holds one empty batch and its checksum); at least its provenance and requests; a timed run's books
    in its provenance add to it, while the steps' bytes over it grow with the steps."""
    import dataclasses
    import json

    from refcheck.trace.io import fixed_bytes, read_trace, trace_bytes

    trace = read_trace(Path(__file__).resolve().parents[1] / "golden" / "attention-b15.arrow")
    fixed = fixed_bytes(trace)
    assert len(json.dumps(trace.provenance)) < fixed < len(trace_bytes(dataclasses.replace(trace, steps=[])))
    steps_alone = [len(trace_bytes(dataclasses.replace(trace, steps=trace.steps[:n]))) - fixed for n in (16, 32, 64)]
    assert all(1.5 < later / earlier < 2.5 for earlier, later in zip(steps_alone, steps_alone[1:])), steps_alone
    booked = dataclasses.replace(trace, provenance={**trace.provenance, "books": [0.0123 + k for k in range(5000)]})
    assert fixed_bytes(booked) > fixed + 5000
