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
* Every field and list item is non-nullable except ``layer_sketch`` and ``state[].full``.
* 1.2 adds the sampling columns (:data:`SAMPLING_REQUEST_FIELDS`, :data:`SAMPLING_STEP_FIELDS`):
  per request the parameters and how its randomness is keyed, per step the engine's draw and
  uniform at every node where it exposes them. Older files migrate with greedy defaults
  (temperature 0, nothing exposed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa

from refcheck.errors import CorruptTraceError

SCHEMA_VERSION = "1.2"  # 1.1 adds the checksum keys, 1.2 the sampling columns (docs/trace-format.md)
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


class SchemaVersionError(CorruptTraceError):
    """The trace was written with a newer major schema version than this refcheck reads."""


class TraceValidationError(CorruptTraceError):
    """A trace (being written, or just read) breaks a structural rule of the format."""


# ------------------------------------------------------------------------------------- types
def _req(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


def _list(type_: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", type_, nullable=False))


I32_LIST = _list(pa.int32())  # [n]
F32_LIST = _list(pa.float32())  # [n]
F64_LIST = _list(pa.float64())  # [n]
I32_LIST2 = _list(I32_LIST)  # [n][k]
F32_LIST2 = _list(F32_LIST)  # [n][k]

# An exact tensor: logical dtype name, shape, raw little-endian bytes (see codec.py).
TENSOR_TYPE = pa.struct(
    [
        _req("dtype", pa.string()),
        _req("shape", I32_LIST),
        _req("data", pa.binary()),
    ]
)

STATE_ENTRY_TYPE = pa.struct(
    [
        _req("name", pa.string()),
        _req("layer", pa.int32()),
        _req("kind", pa.string()),  # one of STATE_KINDS
        _req("sketch", TENSOR_TYPE),
        pa.field("full", TENSOR_TYPE, nullable=True),
    ]
)

TIMINGS_TYPE = pa.struct([_req(name, pa.float64()) for name in TIMING_FIELDS])  # seconds

STEPS_SCHEMA = pa.schema(
    [
        _req("request_id", pa.string()),
        _req("step", pa.int32()),
        _req("committed_len", pa.int32()),  # committed tokens before the step = root position
        _req("tree_tokens", I32_LIST),  # [N], index 0 = root
        _req("tree_parents", I32_LIST),  # [N], parents[0] = -1
        _req("tree_depths", I32_LIST),  # [N]
        _req("tree_ranks", I32_LIST),  # [N]
        _req("draft_topk_ids", I32_LIST2),  # [L][k], depths 1..L
        _req("draft_topk_logprobs", F32_LIST2),  # [L][k]
        _req("topk_ids", I32_LIST2),  # [N][k]
        _req("topk_logprobs", F32_LIST2),  # [N][k]
        _req("target_argmax", I32_LIST),  # [N]
        _req("accepted", I32_LIST),  # node indices, root first
        _req("accept_length", pa.int32()),  # tau = accepted drafted tokens + 1 (bonus included)
        _req("bonus", pa.int32()),
        _req("emitted", I32_LIST),  # [E]
        _req("emitted_logprobs", F32_LIST),  # [E], NaN where the engine reports none
        _req("state", _list(STATE_ENTRY_TYPE)),  # one entry per (layer, kind)
        pa.field("layer_sketch", TENSOR_TYPE, nullable=True),  # [layers, N, r]
        _req("timings", TIMINGS_TYPE),
        # 1.2: sampling. [N] or [] (the engine exposes nothing); -1 / NaN at a node it does not expose.
        _req("node_draws", I32_LIST),  # [N] token the target drew at each node
        _req("node_uniforms", F64_LIST),  # [N] the uniform in [0, 1) each draw used (inverse CDF, token-id order)
    ]
)

REQUESTS_SCHEMA = pa.schema(
    [
        _req("request_id", pa.string()),
        _req("kind", pa.string()),
        _req("prompt_ids", I32_LIST),  # [P]
        _req("output_ids", I32_LIST),  # [T]
        _req("output_logprobs", F32_LIST),  # [T] normally; NaN where unknown
        # 1.2: sampling parameters of the request (temperature 0 = greedy; the others then unused)
        _req("temperature", pa.float64()),
        _req("top_k", pa.int32()),  # 0 = off
        _req("top_p", pa.float64()),  # 1 = off
        _req("seed", pa.int64()),  # -1 = unknown
        _req("rng", pa.string()),  # how uniforms are keyed: RNG_KINDS
        _req("rng_request", pa.int64()),  # the request word of the keyed generator; -1 = unknown
        _req("first_uniform", pa.float64()),  # uniform of the draw after the prefill; NaN = not exposed
    ]
)

#: how an engine's uniforms were produced: "" greedy / unknown; refcheck's keyed Philox by position
#: or by (step, node); "engine": the engine's own generator (uniforms usable for replay, not recomputable)
RNG_KINDS = ("", "refcheck-philox-position", "refcheck-philox-node", "engine")
SAMPLING_REQUEST_FIELDS = ("temperature", "top_k", "top_p", "seed", "rng", "rng_request", "first_uniform")
SAMPLING_STEP_FIELDS = ("node_draws", "node_uniforms")
SAMPLING_DEFAULTS: dict[str, object] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": -1, "rng": "",
                                        "rng_request": -1, "first_uniform": float("nan")}


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


def _add_sampling(steps: pa.Table, requests: pa.Table) -> tuple[pa.Table, pa.Table]:
    """1.1 -> 1.2: the sampling columns with greedy defaults (temperature 0, no draws exposed)."""
    for name in SAMPLING_STEP_FIELDS:
        if name not in steps.column_names:
            f = STEPS_SCHEMA.field(name)
            steps = steps.append_column(f, pa.array([[]] * steps.num_rows, type=f.type))
    for name in SAMPLING_REQUEST_FIELDS:
        if name not in requests.column_names:
            f = REQUESTS_SCHEMA.field(name)
            requests = requests.append_column(f, pa.array([SAMPLING_DEFAULTS[name]] * requests.num_rows, type=f.type))
    return steps, requests


# (major, minor) of the file -> the step that upgrades it.
_MIGRATIONS: dict[tuple[int, int], Migration] = {
    (1, 0): Migration(to=(1, 1), upgrade=_same_tables),
    (1, 1): Migration(to=(1, 2), upgrade=_add_sampling),
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
