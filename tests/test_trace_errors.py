"""Trace format, part 2: bad inputs (typed errors, never a traceback), schema versions and the
sha256 manifest (part 1: test_trace_format.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from refcheck import atomic_file
from refcheck.errors import EXIT_CORRUPT, EXIT_GOLDEN, CorruptTraceError, GoldenError, SchemaVersionError
from refcheck.goldens.manifest import Manifest, load_manifest, sha256_file
from refcheck.trace import (
    SCHEMA_VERSION,
    Trace,
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
    requests_blob,
    rewrite,
)


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
    assert "2.0" in str(exc.value) and SCHEMA_VERSION in str(exc.value)
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
    monkeypatch.setattr(atomic_file.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("nope")))
    with pytest.raises(OSError):
        manifest.save(tmp_path)
    assert (tmp_path / "MANIFEST.json").read_bytes() == before
    assert dir_listing(tmp_path) == ["MANIFEST.json"]



def test_a_1_2_file_reads_with_no_residual_uniform(trace_file: tuple[Trace, Path], tmp_path: Path) -> None:
    """1.2 -> 1.3 adds residual_uniform: a 1.2 file (without the column) reads it as NaN, everything else as written."""
    trace, path = trace_file
    old = tmp_path / "v12.arrow"
    rewrite(path, old, table_fn=lambda t: t.drop_columns(["residual_uniform"]),
            meta_fn=lambda m: {**m, b"refcheck.schema_version": b"1.2"})
    back = read_trace(old)
    assert back.schema_version == "1.2"
    assert all(s.residual_uniform != s.residual_uniform for s in back.steps)
    back.schema_version = SCHEMA_VERSION
    assert_traces_equal(trace, back)
