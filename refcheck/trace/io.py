"""Reading and writing refcheck traces (schema in :mod:`refcheck.trace.schema`).

Contract:

* :func:`write_trace` serializes a :class:`Trace` (steps table in an Arrow IPC file, requests
  table as a zstd IPC stream in the schema metadata) and writes it **atomically**: a temp file in
  the target directory is written, flushed and fsynced, ``os.replace``-d onto the path, and the
  directory is fsynced. On any exception the temp file is removed and an existing file at the
  path is untouched. It validates the trace first and raises
  :class:`~refcheck.trace.schema.TraceValidationError` for a structural defect.
* :func:`read_trace` returns the :class:`Trace` or raises a typed error, never a pyarrow one:
  :class:`~refcheck.errors.GoldenError` when the file does not exist;
  :class:`~refcheck.errors.SchemaVersionError` for a newer major schema version;
  :class:`~refcheck.errors.CorruptTraceError` for an empty file, a bad magic, a truncated or
  corrupt Arrow file, an Arrow file that is not a refcheck trace, missing columns, nulls in
  required values, zero requests, or bad provenance JSON. The trace remembers its file
  (``Trace.source``): its typed provenance (``Trace.prov``, read when the trace is diffed) names it
  in a :class:`~refcheck.provenance.ProvenanceError`. Files of an older or equal major and
  any minor are accepted: they are routed through ``schema._MIGRATIONS`` (see
  :func:`refcheck.trace.schema.migrate`) before the column check; columns of a newer minor that
  this version does not know are ignored.
* The rows are :mod:`refcheck.trace.rows` and the checksums :mod:`refcheck.trace.checksums`; both are
  re-exported here. The encoder and decoder follow the rows' field list column by column
  (:func:`refcheck.trace.rows.columns`), with one rule per column kind.
* Integrity (schema 1.1): the file carries its own checksums in the schema metadata (a sha256 per
  record batch, one over the requests table, and one over the whole file with its own two copies
  zeroed). :func:`read_trace` checks them before decoding anything: any changed byte is a
  :class:`~refcheck.errors.CorruptTraceError` naming the record batch (or the requests table, or
  "outside the record batches"). A 1.0 file has no checksums: it reads with
  ``Trace.checksummed = False`` ("unchecked"); a file of 1.1 or later without them is corrupt.
* Content: the tree is a tree (``parents[0] = -1``, every other parent an earlier node, depths
  consistent), each request's steps are 0, 1, 2, ... without gaps or repeats, and
  :func:`check_token_ids` bounds token ids by a known vocabulary; a violation is a
  :class:`~refcheck.trace.schema.TraceValidationError` naming the request, step and node.
* Round trip: every field reads back equal; float32 columns hold float32 values (a Python float
  is rounded to float32 on write); tensors round-trip bit-exactly (see :mod:`.codec`);
  ``provenance`` must be JSON-native (str keys, lists, no NaN) and reads back equal.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import torch

# re-exported (``X as X``): refcheck.trace and older callers import these from here
from refcheck.atomic_file import atomic_write_bytes as atomic_write_bytes
from refcheck.atomic_file import fsync_dir as fsync_dir
from refcheck.errors import CorruptTraceError, GoldenError
from refcheck.trace.checksums import IPC_OPTIONS as IPC_OPTIONS
from refcheck.trace.checksums import batch_sha256 as batch_sha256
from refcheck.trace.checksums import check_checksums as check_checksums
from refcheck.trace.checksums import sealed_file_bytes as sealed_file_bytes
from refcheck.trace.codec import decode_tensor, encode_tensor
from refcheck.trace.rows import Column, columns
from refcheck.trace.rows import RequestRow as RequestRow
from refcheck.trace.rows import StateEntry as StateEntry
from refcheck.trace.rows import StepRow as StepRow
from refcheck.trace.rows import Trace as Trace
from refcheck.trace.schema import (
    KEY_FILE_SHA256,
    KEY_MAGIC,
    KEY_PROVENANCE,
    KEY_REQUESTS,
    KEY_VERSION,
    MAGIC,
    REQUESTS_SCHEMA,
    RNG_KINDS,
    SCHEMA_VERSION,
    STATE_KINDS,
    STEPS_SCHEMA,
    TIMING_FIELDS,
    TraceValidationError,
    check_columns,
    check_no_nulls,
    check_version,
    migrate,
)

ARROW_MAGIC = b"ARROW1"
_BATCH_ROWS = 1024  # steps per record batch at most
_BATCH_BYTES = 256 << 20  # tensor bytes per record batch at most (binary offsets are int32)
# The columns, from the one field list (refcheck/trace/rows.py): the encoder and decoder below follow them.
_STEP_COLUMNS, _REQUEST_COLUMNS, _STATE_COLUMNS = columns(StepRow), columns(RequestRow), columns(StateEntry)


# ------------------------------------------------------------------------------ validation
def _fail(source: str, where: str, msg: str) -> NoReturn:
    raise TraceValidationError(f"{source}: {where}: {msg}")


def _same_shape(a: Sequence[Sequence[Any]], b: Sequence[Sequence[Any]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b))


def _validate_step(s: StepRow, source: str) -> None:
    where = f"request {s.request_id!r} step {s.step}"
    n = len(s.tree_tokens)
    if n < 1:
        _fail(source, where, "tree has no nodes (the root is node 0)")
    for name in ("tree_parents", "tree_depths", "tree_ranks", "target_argmax", "topk_ids"):
        if len(getattr(s, name)) != n:
            _fail(source, where, f"{name} has {len(getattr(s, name))} entries, the tree has {n} nodes")
    if not _same_shape(s.topk_ids, s.topk_logprobs):
        _fail(source, where, "topk_ids and topk_logprobs differ in shape")
    if not _same_shape(s.draft_topk_ids, s.draft_topk_logprobs):
        _fail(source, where, "draft_topk_ids and draft_topk_logprobs differ in shape")
    if len(s.emitted) != len(s.emitted_logprobs):
        _fail(
            source,
            where,
            f"emitted has {len(s.emitted)} tokens but emitted_logprobs {len(s.emitted_logprobs)}",
        )
    for name in ("node_draws", "node_uniforms"):
        if len(getattr(s, name)) not in (0, n):
            _fail(source, where, f"{name} has {len(getattr(s, name))} entries: the tree has {n} nodes (or [] if unexposed)")
    bad_u = [i for i, u in enumerate(s.node_uniforms) if not (u != u or 0.0 <= u < 1.0)]
    if bad_u:
        _fail(source, f"{where} node {bad_u[0]}", f"uniform {s.node_uniforms[bad_u[0]]} outside [0, 1)")
    r = s.residual_uniform
    if r == r and not 0.0 <= r < 1.0:
        _fail(source, where, f"residual uniform {r} outside [0, 1)")
    bad = [i for i in s.accepted if not 0 <= i < n]
    if bad:
        _fail(source, where, f"accepted node indices {bad} out of range [0, {n})")
    _validate_tree(s, source, where)
    if not isinstance(s.timings, dict) or set(s.timings) != set(TIMING_FIELDS):
        got = sorted(s.timings) if isinstance(s.timings, dict) else type(s.timings).__name__
        _fail(source, where, f"timings must have exactly the keys {list(TIMING_FIELDS)}, got {got}")
    for e in s.state:
        if not isinstance(e, StateEntry):
            _fail(source, where, f"state entries must be StateEntry, got {type(e).__name__}")
        if e.kind not in STATE_KINDS:
            _fail(source, where, f"state {e.name!r} has kind {e.kind!r}, not one of {STATE_KINDS}")
    if s.layer_sketch is not None:
        shape = tuple(s.layer_sketch.shape)
        if len(shape) != 3 or shape[1] != n:
            _fail(source, where, f"layer_sketch must be [layers, N={n}, r], got {list(shape)}")


def _validate_tree(s: StepRow, source: str, where: str) -> None:
    """The tree is a tree: root parent -1 at depth 0, every other parent an earlier node, depth = parent's + 1."""
    parents, depths = s.tree_parents, s.tree_depths
    if parents[0] != -1 or depths[0] != 0:
        _fail(source, f"{where} node 0", f"the root must have parent -1 and depth 0, got {parents[0]} and {depths[0]}")
    for i in range(1, len(parents)):
        p = parents[i]
        if not 0 <= p < i:
            _fail(source, f"{where} node {i}", f"parent {p} out of range (an earlier node in [0, {i}))")
        if depths[i] != depths[p] + 1:
            _fail(source, f"{where} node {i}", f"depth {depths[i]} but its parent {p} has depth {depths[p]}")


def gaps_declared(provenance: dict[str, Any]) -> bool:
    """Whether the trace's capture says it holds some steps only: a sampled capture (1 step in N > 1), records
    its queue lost, batches past its byte budget, or records a rolling budget deleted."""
    cap = provenance.get("capture") or {}
    sample = cap.get("sample") if isinstance(cap, dict) else None
    every = sample.get("every", 1) if isinstance(sample, dict) else 1
    stats = cap.get("stats") if isinstance(cap, dict) else None
    return (isinstance(every, int) and every > 1) or bool(isinstance(stats, dict) and (
        stats.get("lost_batches") or stats.get("over_budget_batches") or stats.get("rolled_out_records")))


def _validate_step_numbers(trace: Trace, source: str) -> None:
    """Each request's steps are exactly 0..n-1 (no gap, no jump); a trace whose capture declares gaps
    (:func:`gaps_declared`) holds non-negative ones."""
    numbers: dict[str, list[int]] = {}
    for s in trace.steps:
        numbers.setdefault(s.request_id, []).append(s.step)
    sampled = gaps_declared(trace.provenance)
    for rid, steps in numbers.items():
        steps.sort()
        if sampled:
            if steps[0] < 0:
                raise TraceValidationError(f"{source}: request {rid!r} step {steps[0]}: step numbers are >= 0")
            continue  # (each number once: checked with every trace's steps)
        gap = next((i for i, k in enumerate(steps) if k != i), None)
        if gap is not None:
            raise TraceValidationError(f"{source}: request {rid!r} step {steps[gap]}: steps must run 0, 1, 2, ... "
                                       f"without gaps, but step {gap} is missing")


def check_token_ids(trace: Trace, vocab_size: int, source: str = "trace") -> None:
    """Every token id of the trace (prompts, outputs, trees, top-k, argmax, bonus, emitted) lies in
    ``[0, vocab_size)``; else a :class:`TraceValidationError` naming the request, step and node."""
    def bad(ids: Sequence[int]) -> int | None:
        return next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)

    for r in trace.requests:
        for name in ("prompt_ids", "output_ids"):
            i = bad(getattr(r, name))
            if i is not None:
                raise TraceValidationError(f"{source}: request {r.request_id!r} {name}[{i}] = {getattr(r, name)[i]} is "
                                           f"outside the vocabulary [0, {vocab_size})")
    for s in trace.steps:
        where = f"request {s.request_id!r} step {s.step}"
        for name in ("tree_tokens", "target_argmax"):
            i = bad(getattr(s, name))
            if i is not None:
                _fail(source, f"{where} node {i}", f"{name} {getattr(s, name)[i]} is outside the vocabulary [0, {vocab_size})")
        i = bad([t for t in s.node_draws if t != -1])
        if i is not None:
            node = next(j for j, t in enumerate(s.node_draws) if t != -1 and not 0 <= t < vocab_size)
            _fail(source, f"{where} node {node}", f"node_draws holds {s.node_draws[node]}, outside the vocabulary "
                  f"[0, {vocab_size}) (-1 = not exposed)")
        for node, row in enumerate(s.topk_ids):
            if (j := bad(row)) is not None:
                _fail(source, f"{where} node {node}", f"topk_ids holds {row[j]}, outside the vocabulary [0, {vocab_size})")
        for name, ids in (("bonus", [s.bonus]), ("emitted", s.emitted), ("draft_topk_ids", [t for r in s.draft_topk_ids for t in r])):
            i = bad(ids)
            if i is not None:
                _fail(source, where, f"{name} holds {ids[i]}, outside the vocabulary [0, {vocab_size})")


def _validate_sampling(r: RequestRow, source: str) -> None:
    """A request's sampling parameters are in range (a writer's bug or a corrupt file otherwise)."""
    where = f"request {r.request_id!r}"
    t, p, k = r.temperature, r.top_p, r.top_k
    if not (t == t and 0 <= t < float("inf")):
        _fail(source, where, f"temperature {t} is not a finite number >= 0")
    if not 0 < p <= 1:
        _fail(source, where, f"top_p {p} outside (0, 1]")
    if k < 0:
        _fail(source, where, f"top_k {k} < 0")
    if r.rng not in RNG_KINDS:
        _fail(source, where, f"rng {r.rng!r} is not one of {RNG_KINDS}")
    u = r.first_uniform
    if u == u and not 0 <= u < 1:
        _fail(source, where, f"first_uniform {u} outside [0, 1)")
    if r.max_new_tokens == 0 or r.max_new_tokens < -1:
        _fail(source, where, f"max_new_tokens {r.max_new_tokens} is neither a limit >= 1 nor -1 (the run's)")


def _validate_trace(trace: Trace, source: str) -> None:
    if not trace.requests:
        raise TraceValidationError(f"{source}: empty trace (no requests)")
    known: set[str] = set()
    for r in trace.requests:
        _validate_sampling(r, source)
        if r.request_id in known:
            raise TraceValidationError(f"{source}: duplicate request id {r.request_id!r}")
        known.add(r.request_id)
    seen: set[tuple[str, int]] = set()
    for s in trace.steps:
        if s.request_id not in known:
            raise TraceValidationError(f"{source}: step {s.step} names unknown request {s.request_id!r}")
        key = (s.request_id, s.step)
        if key in seen:
            raise TraceValidationError(f"{source}: request {s.request_id!r} has step {s.step} twice")
        seen.add(key)
        _validate_step(s, source)
    _validate_step_numbers(trace, source)


def _provenance_json(provenance: dict[str, Any]) -> bytes:
    if not isinstance(provenance, dict):
        raise TraceValidationError(f"provenance must be a dict, got {type(provenance).__name__}")
    try:
        text = json.dumps(provenance, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TraceValidationError(f"provenance is not JSON-serializable: {exc}") from None
    if json.loads(text) != provenance:
        raise TraceValidationError(
            "provenance does not round-trip through JSON (use str keys, lists not tuples)"
        )
    return text.encode("utf-8")


# --------------------------------------------------------------------------------- encoding
def _plain(x: Any) -> Any:
    """Lists stay lists; numpy arrays / torch tensors become nested lists."""
    return x.tolist() if hasattr(x, "tolist") else x


def _encode(col: Column, value: Any) -> Any:
    """A field's value as its Arrow column holds it (:class:`~refcheck.trace.rows.Column` kinds)."""
    if col.nullable and value is None:
        return None
    if col.kind == "tensor":
        return encode_tensor(value)
    if col.kind == "state[]":
        return [_record(e, _STATE_COLUMNS) for e in value]
    if col.kind == "timings":
        return {k: value[k] for k in TIMING_FIELDS}
    if col.kind.endswith("[]"):
        return _plain(value)
    return value


def _record(row: Any, cols: tuple[tuple[str, Column], ...]) -> dict[str, Any]:
    """One row as an Arrow record: every column of the field list, encoded."""
    return {name: _encode(col, getattr(row, name)) for name, col in cols}


def _tensor_bytes(col: Column, value: Any) -> int:
    """Bytes of the encoded tensors in one encoded column value."""
    if value is None:
        return 0
    if col.kind == "tensor":
        return len(value["data"])
    if col.kind == "state[]":
        return sum(_tensor_bytes(c, e[name]) for e in value for name, c in _STATE_COLUMNS)
    return 0


def _record_bytes(rec: dict[str, Any]) -> int:
    return sum(_tensor_bytes(col, rec[name]) for name, col in _STEP_COLUMNS)


def _to_batch(records: list[dict[str, Any]], schema: pa.Schema, what: str) -> pa.RecordBatch:
    try:
        # float32 columns: Python floats are rounded to float32 here (the format's precision).
        batch = pa.RecordBatch.from_pylist(records, schema=schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise TraceValidationError(f"{what} do not fit the trace schema: {exc}") from None
    check_no_nulls(zip(schema, batch.columns), what, TraceValidationError)
    return batch


def _step_batches(steps: Sequence[StepRow]) -> list[pa.RecordBatch]:
    batches: list[pa.RecordBatch] = []
    pending: list[dict[str, Any]] = []
    size = 0
    for s in steps:
        rec = _record(s, _STEP_COLUMNS)
        pending.append(rec)
        size += _record_bytes(rec)
        if len(pending) >= _BATCH_ROWS or size >= _BATCH_BYTES:
            batches.append(_to_batch(pending, STEPS_SCHEMA, "steps"))
            pending, size = [], 0
    if pending or not batches:
        batches.append(_to_batch(pending, STEPS_SCHEMA, "steps"))
    return batches


def _requests_stream(requests: Sequence[RequestRow]) -> bytes:
    records = [_record(r, _REQUEST_COLUMNS) for r in requests]
    batch = _to_batch(records, REQUESTS_SCHEMA, "requests")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, REQUESTS_SCHEMA, options=IPC_OPTIONS) as writer:
        writer.write_batch(batch)
    out: bytes = sink.getvalue().to_pybytes()
    return out


def trace_bytes(trace: Trace) -> bytes:
    """The trace serialized exactly as :func:`write_trace` writes it."""
    return sealed_file_bytes(_file_schema(trace), _step_batches(trace.steps))


def fixed_bytes(trace: Trace) -> int:
    """The bytes of ``trace``'s file that do not grow with its steps: the file :func:`trace_bytes` makes with no
    record batch at all, its header, provenance (a timed run's holds every round's books) and requests."""
    return len(sealed_file_bytes(_file_schema(dataclasses.replace(trace, steps=[])), []))


def _file_schema(trace: Trace) -> pa.Schema:
    """The steps' schema with the file's metadata (magic, version, provenance, requests), ``trace`` validated."""
    try:
        _validate_trace(trace, "trace")
    except (TypeError, AttributeError) as exc:  # e.g. None where a list or int belongs
        raise TraceValidationError(f"trace has a wrongly typed field: {exc}") from None
    metadata = {
        KEY_MAGIC: MAGIC.encode(),
        KEY_VERSION: SCHEMA_VERSION.encode(),
        KEY_PROVENANCE: _provenance_json(trace.provenance),
        KEY_REQUESTS: _requests_stream(trace.requests),
    }
    return STEPS_SCHEMA.with_metadata(metadata)


# ----------------------------------------------------------------------------- write
def write_trace(trace: Trace, path: Path) -> int:
    """Validate, serialize and atomically write ``trace`` to ``path``; returns bytes written."""
    return atomic_write_bytes(Path(path), trace_bytes(trace))


# ---------------------------------------------------------------------------------- reading
def _tensor(d: dict[str, Any], source: str, what: str) -> torch.Tensor:
    try:
        return decode_tensor(d)
    except CorruptTraceError as exc:
        raise CorruptTraceError(f"{source}: {what}: {exc}") from None


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def _decode(col: Column, value: Any, source: str, what: str) -> Any:
    """A field's value from its Arrow column (the inverse of :func:`_encode`); ``what`` names it in errors."""
    if col.nullable and value is None:
        return None
    if col.kind == "tensor":
        return _tensor(value, source, what)
    if col.kind == "state[]":
        return [StateEntry(**{name: _decode(c, e[name], source, f"{what} {e['name']!r} {name}")
                              for name, c in _STATE_COLUMNS}) for e in value]
    if col.kind == "timings":
        return dict(value)
    return value


def _step_from(rec: dict[str, Any], source: str) -> StepRow:
    where = f"request {rec['request_id']!r} step {rec['step']}"
    return StepRow(**{name: _decode(col, rec[name], source, f"{where} {name}") for name, col in _STEP_COLUMNS})


def _request_from(rec: dict[str, Any], source: str) -> RequestRow:
    where = f"request {rec['request_id']!r}"
    return RequestRow(**{name: _decode(col, rec[name], source, f"{where} {name}") for name, col in _REQUEST_COLUMNS})


def _read_requests(blob: bytes, source: str) -> pa.Table:
    try:
        table = pa.ipc.open_stream(pa.py_buffer(blob)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptTraceError(f"{source}: requests table is corrupt: {exc}") from None
    return table


def trace_from_bytes(data: bytes, source: str = "<bytes>") -> Trace:
    """Parse a serialized trace; the typed errors of :func:`read_trace` (``source`` names it)."""
    if not data:
        raise CorruptTraceError(f"{source}: empty trace file (0 bytes)")
    if data[: len(ARROW_MAGIC)] != ARROW_MAGIC:
        raise CorruptTraceError(f"{source}: not an Arrow IPC file (bad magic)")
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptTraceError(f"{source}: truncated or corrupt Arrow file: {exc}") from None
    meta = reader.schema.metadata or {}
    checksummed = check_checksums(data, reader, _version_or_none(meta), source)
    try:
        steps = reader.read_all()
        steps.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptTraceError(f"{source}: truncated or corrupt Arrow file: {exc}") from None
    if meta.get(KEY_MAGIC) != MAGIC.encode():
        raise CorruptTraceError(f"{source}: an Arrow file but not a refcheck trace (no refcheck.magic)")
    for key in (KEY_VERSION, KEY_REQUESTS, KEY_PROVENANCE):
        if key not in meta:
            raise CorruptTraceError(f"{source}: trace metadata lacks {key.decode()}")
    try:
        version_text = meta[KEY_VERSION].decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptTraceError(f"{source}: schema version is not UTF-8 text") from None
    version = check_version(version_text, source)
    requests = _read_requests(meta[KEY_REQUESTS], source)
    steps, requests, _ = migrate(steps, requests, version, source)
    steps = check_columns(steps, STEPS_SCHEMA, "steps", source)
    requests = check_columns(requests, REQUESTS_SCHEMA, "requests", source)
    check_no_nulls(zip(STEPS_SCHEMA, steps.columns), source)
    check_no_nulls(zip(REQUESTS_SCHEMA, requests.columns), source)
    if requests.num_rows == 0:
        raise CorruptTraceError(f"{source}: empty trace (no requests)")
    try:
        provenance = json.loads(meta[KEY_PROVENANCE].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptTraceError(f"{source}: provenance is not valid JSON: {exc}") from None
    if not isinstance(provenance, dict):
        raise CorruptTraceError(f"{source}: provenance is a JSON {type(provenance).__name__}, not an object")
    trace = Trace(
        provenance=provenance,
        requests=[_request_from(rec, source) for rec in _rows(requests)],
        steps=[_step_from(rec, source) for rec in _rows(steps)],
        schema_version=version_text,
        checksummed=checksummed,
        source=source,
    )
    _validate_trace(trace, source)
    return trace


def file_checksummed(path: Path) -> bool:
    """Whether the trace file at ``path`` carries checksums (reads the footer only; False for a
    1.0 file, and for a file that is not an Arrow file at all)."""
    try:
        meta = pa.ipc.open_file(pa.memory_map(str(path))).schema.metadata or {}
    except (pa.ArrowException, OSError, ValueError):
        return False
    return KEY_FILE_SHA256 in meta


def _version_or_none(meta: dict[bytes, bytes]) -> tuple[int, int] | None:
    try:
        major, minor = meta[KEY_VERSION].decode("ascii").split(".")
        return int(major), int(minor)
    except (KeyError, UnicodeDecodeError, ValueError):
        return None  # the full version check below reports it


def read_trace(path: Path) -> Trace:
    """Read a trace file; see the module docstring for the errors it raises."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GoldenError(f"no trace at {path}") from None
    except OSError as exc:
        raise CorruptTraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    return trace_from_bytes(data, source=str(path))
