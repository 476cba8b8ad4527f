"""The Arrow schema of a refcheck trace, its version rule, and the migration registry.

Contract:

* A trace is one Arrow IPC *file* holding the **steps table** (:data:`STEPS_SCHEMA`, one row per
  (request, verify step)). The **requests table** (:data:`REQUESTS_SCHEMA`) is an Arrow IPC
  *stream* stored as bytes in the steps schema's metadata under :data:`KEY_REQUESTS`. The other
  metadata keys are :data:`KEY_MAGIC` (= :data:`MAGIC`), :data:`KEY_VERSION` (= "major.minor"),
  :data:`KEY_PROVENANCE` (a JSON object) and, from 1.1, the checksums :data:`CHECKSUM_KEYS`.
* Versioning: a minor bump only *adds* columns (old readers ignore them, new readers get them
  through a migration); a major bump may change or remove anything. A reader accepts every file
  whose major is <= its own major, whatever the minor, and raises :class:`SchemaVersionError`
  for a newer major. Before the column check, :func:`migrate` upgrades the tables of an older
  version step by step through :data:`_MIGRATIONS` (1.1 only adds metadata keys, so 1.0 needs no
  table step; a 1.0 file is read as *unchecked*, see :mod:`refcheck.trace.io`).
* :func:`check_columns` and :func:`check_no_nulls` turn every structural defect (missing column,
  wrong type, null in a required value) into :class:`~refcheck.errors.CorruptTraceError`.
* The columns are the fields of the row classes (:mod:`refcheck.trace.rows`, the one field list), in
  their order; :func:`arrow_type` maps each field's :class:`~refcheck.trace.rows.Column` kind to its
  Arrow type. Every field and list item is non-nullable except ``layer_sketch`` and ``state[].full``.
* 1.2 adds the sampling columns (:data:`SAMPLING_REQUEST_FIELDS`, :data:`SAMPLING_STEP_FIELDS`):
  per request the parameters and how its randomness is keyed, per step the engine's draw and
  uniform at every node where it exposes them. Older files migrate with greedy defaults
  (temperature 0, nothing exposed).
* 1.3 adds ``residual_uniform`` per step (the children-first sampler's bonus uniform, NaN where not exposed)
  and the rng kind ``engine-children-first``; older files migrate with NaN.
* 1.4 adds the drafter's side per step: the positions and a feature sketch of the context the engine fed its
  drafter, and the shadow tree of an engine that builds trees but verifies a chain; older files migrate with
  nothing exposed (empty lists, no sketch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa

from refcheck.errors import CorruptTraceError, SchemaVersionError
from refcheck.trace.rows import SCHEMA_VERSION as SCHEMA_VERSION  # (defined beside the rows, without pyarrow)
from refcheck.trace.rows import Column, RequestRow, StateEntry, StepRow, columns, defaults

MAGIC = "refcheck-trace"
CHECKSUM_VERSION = (1, 1)  # the first version whose files must carry checksums

KEY_MAGIC = b"refcheck.magic"
KEY_VERSION = b"refcheck.schema_version"
KEY_PROVENANCE = b"refcheck.provenance"
KEY_REQUESTS = b"refcheck.requests"
KEY_FILE_SHA256 = b"refcheck.file_sha256"  # sha256 of the file with both copies of this value zeroed
KEY_BATCH_SHA256 = b"refcheck.batch_sha256"  # JSON list: sha256 of each record batch's uncompressed IPC bytes
KEY_REQUESTS_SHA256 = b"refcheck.requests_sha256"  # sha256 of the refcheck.requests bytes
CHECKSUM_KEYS = (KEY_FILE_SHA256, KEY_BATCH_SHA256, KEY_REQUESTS_SHA256)

STATE_KINDS = ("kv_k", "kv_v", "conv", "rec")
TIMING_FIELDS = ("draft", "tree", "verify", "commit")


class TraceValidationError(CorruptTraceError):
    """A trace (being written, or just read) breaks a structural rule of the format."""


# ------------------------------------------------------------------------------------- types
def _req(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


def _list(type_: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", type_, nullable=False))


I32_LIST = _list(pa.int32())  # [n]

# An exact tensor: logical dtype name, shape, raw little-endian bytes (see codec.py).
TENSOR_TYPE = pa.struct(
    [
        _req("dtype", pa.string()),
        _req("shape", I32_LIST),
        _req("data", pa.binary()),
    ]
)

TIMINGS_TYPE = pa.struct([_req(name, pa.float64()) for name in TIMING_FIELDS])  # seconds

_SCALARS: dict[str, pa.DataType] = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(),
                                    "float64": pa.float64(), "float32": pa.float32()}


def _fields_of(row: type) -> list[pa.Field]:
    return [pa.field(name, arrow_type(col), nullable=col.nullable) for name, col in columns(row)]


def arrow_type(col: Column) -> pa.DataType:
    """The Arrow type of a column kind (:class:`refcheck.trace.rows.Column`)."""
    kind = col.kind
    if kind == "tensor":
        return TENSOR_TYPE
    if kind == "timings":
        return TIMINGS_TYPE
    if kind == "state[]":
        return _list(STATE_ENTRY_TYPE)
    if kind.endswith("[]"):
        return _list(arrow_type(Column(kind[:-2])))
    if kind in _SCALARS:
        return _SCALARS[kind]
    raise ValueError(f"unknown column kind {kind!r}")


STATE_ENTRY_TYPE = pa.struct(_fields_of(StateEntry))
STEPS_SCHEMA = pa.schema(_fields_of(StepRow))  # one row per (request, verify step)
REQUESTS_SCHEMA = pa.schema(_fields_of(RequestRow))  # one row per request

#: how an engine's uniforms were produced and used: "" greedy / unknown; refcheck's keyed Philox by position
#: or by (step, node) (each node's draw the inverse CDF of its uniform, token-id order); "engine": the engine's
#: own generator (uniforms usable for replay, not recomputable); "engine-children-first": the engine's own
#: generator, each node's uniform tried against its children first and the step's residual uniform drawing the
#: bonus (:mod:`ddtree_reference.children_first`, SGLang's target-only tree sampler)
RNG_KINDS = ("", "refcheck-philox-position", "refcheck-philox-node", "engine", "engine-children-first")


def added_in(row: type, version: tuple[int, int]) -> tuple[str, ...]:
    """The columns of ``row`` that schema ``version`` added."""
    return tuple(name for name, col in columns(row) if col.since == version)


SAMPLING_REQUEST_FIELDS = added_in(RequestRow, (1, 2))
SAMPLING_STEP_FIELDS = added_in(StepRow, (1, 2))
#: what a request row of an older file reads as in the sampling columns (greedy): the row's defaults
SAMPLING_DEFAULTS: dict[str, object] = {name: defaults(RequestRow)[name] for name in SAMPLING_REQUEST_FIELDS}


# ---------------------------------------------------------------------------------- version
def parse_version(text: str, source: str = "trace") -> tuple[int, int]:
    """``"major.minor"`` -> ``(major, minor)``; anything else is a :class:`CorruptTraceError`."""
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise CorruptTraceError(f"{source}: unparsable schema version {text!r} (want 'major.minor')")
    return int(parts[0]), int(parts[1])


CURRENT_VERSION = parse_version(SCHEMA_VERSION)


def check_version(text: str, source: str = "trace") -> tuple[int, int]:
    """Parse the file's version and refuse a newer major; any minor of an older/equal major passes."""
    version = parse_version(text, source)
    if version[0] > CURRENT_VERSION[0]:
        raise SchemaVersionError(
            f"{source}: trace schema version {text} is newer than this refcheck supports "
            f"({SCHEMA_VERSION}); upgrade refcheck to read it"
        )
    return version


@dataclass(slots=True, frozen=True)
class Migration:
    """One upgrade step: tables of the registry key's version -> tables of version ``to``."""

    to: tuple[int, int]
    upgrade: Callable[[pa.Table, pa.Table], tuple[pa.Table, pa.Table]]  # (steps, requests)


def _same_tables(steps: pa.Table, requests: pa.Table) -> tuple[pa.Table, pa.Table]:
    """1.0 -> 1.1 added only metadata keys (checksums): the tables are unchanged."""
    return steps, requests


def _add_columns(version: tuple[int, int]) -> Callable[[pa.Table, pa.Table], tuple[pa.Table, pa.Table]]:
    """The upgrade to ``version``: the columns it added, each filled with its row field's default."""

    def upgrade(steps: pa.Table, requests: pa.Table) -> tuple[pa.Table, pa.Table]:
        tables = []
        for table, row, table_schema in ((steps, StepRow, STEPS_SCHEMA), (requests, RequestRow, REQUESTS_SCHEMA)):
            fill = defaults(row)
            for name in added_in(row, version):
                if name not in table.column_names:
                    f = table_schema.field(name)
                    table = table.append_column(f, pa.array([fill[name]] * table.num_rows, type=f.type))
            tables.append(table)
        return tables[0], tables[1]

    return upgrade


# (major, minor) of the file -> the step that upgrades it.
_MIGRATIONS: dict[tuple[int, int], Migration] = {
    (1, 0): Migration(to=(1, 1), upgrade=_same_tables),
    (1, 1): Migration(to=(1, 2), upgrade=_add_columns((1, 2))),  # the sampling columns, greedy defaults
    (1, 2): Migration(to=(1, 3), upgrade=_add_columns((1, 3))),  # residual_uniform, NaN (not exposed)
    (1, 3): Migration(to=(1, 4), upgrade=_add_columns((1, 4))),  # the drafter's side, not exposed
    (1, 4): Migration(to=(1, 5), upgrade=_add_columns((1, 5))),  # each request's token limit: the run's (-1)
}


def migrate(
    steps: pa.Table, requests: pa.Table, version: tuple[int, int], source: str = "trace"
) -> tuple[pa.Table, pa.Table, tuple[int, int]]:
    """Upgrade ``(steps, requests)`` of ``version`` through :data:`_MIGRATIONS` as far as it goes.

    Files of the current version or a newer minor need no step. An older version with no
    registered step is read as is: the column check then decides whether it is readable.
    """
    while version < CURRENT_VERSION and version in _MIGRATIONS:
        step = _MIGRATIONS[version]
        if step.to <= version:
            raise CorruptTraceError(f"{source}: migration from {version} does not move forward")
        steps, requests = step.upgrade(steps, requests)
        version = step.to
    return steps, requests, version


# ------------------------------------------------------------------------------ structure
def check_columns(table: pa.Table, schema: pa.Schema, what: str, source: str) -> pa.Table:
    """The table restricted to ``schema``'s columns, in schema order; extra columns (a newer
    minor) are dropped. Missing columns and wrong types raise :class:`CorruptTraceError`."""
    present = set(table.column_names)
    missing = [f.name for f in schema if f.name not in present]
    if missing:
        raise CorruptTraceError(
            f"{source}: {what} table lacks required column(s): {', '.join(missing)}"
        )
    for f in schema:
        actual = table.schema.field(f.name).type
        if actual != f.type:
            raise CorruptTraceError(
                f"{source}: {what} column {f.name!r} has type {actual}, expected {f.type}"
            )
    return table.select(schema.names)


def _check_array(
    arr: pa.Array, field: pa.Field, path: str, source: str, error: type[CorruptTraceError]
) -> None:
    if arr.null_count:
        if not field.nullable:
            raise error(f"{source}: null value in required field {path}")
        arr = arr.filter(arr.is_valid())  # the children of a null struct slot are meaningless
    t = field.type
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            child = t.field(i)
            _check_array(arr.field(i), child, f"{path}.{child.name}", source, error)
    elif pa.types.is_list(t):
        _check_array(arr.flatten(), t.value_field, f"{path}[]", source, error)


def check_no_nulls(
    columns: Iterable[tuple[pa.Field, pa.ChunkedArray | pa.Array]],
    source: str,
    error: type[CorruptTraceError] = CorruptTraceError,
) -> None:
    """Raise ``error`` where a value the schema marks required is null, at any nesting depth
    (Arrow itself does not enforce non-nullable fields)."""
    for field, col in columns:
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        for chunk in chunks:
            _check_array(chunk, field, field.name, source, error)
