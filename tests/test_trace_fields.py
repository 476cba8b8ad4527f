"""The trace's one field list (refcheck/trace/rows.py) and the bytes it encodes: every golden reads and
re-encodes to the same record batches (by the format's own per-batch sha256), the same requests table
and the same provenance; a golden of the current schema version re-encodes to its very bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pytest

from refcheck.goldens import REPO_GOLDEN
from refcheck.goldens.manifest import load_manifest
from refcheck.trace import rows, schema
from refcheck.trace.checksums import batch_sha256
from refcheck.trace.io import read_trace, trace_bytes, trace_from_bytes

GOLDENS = sorted({e.file for e in load_manifest(REPO_GOLDEN).cases.values()})


def _requests(meta: dict[bytes, bytes]) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(meta[schema.KEY_REQUESTS])).read_all()


@pytest.mark.parametrize("name", GOLDENS)
def test_every_golden_re_encodes_to_the_same_batches(name: str) -> None:
    path = REPO_GOLDEN / name
    data = path.read_bytes()
    trace = read_trace(path)
    out = trace_bytes(trace)
    old, new = pa.ipc.open_file(pa.py_buffer(data)), pa.ipc.open_file(pa.py_buffer(out))
    old_meta, new_meta = old.schema.metadata, new.schema.metadata
    if trace.schema_version == schema.SCHEMA_VERSION:
        assert out == data, f"{name}: re-encoded bytes differ from the stored file"
    # Older versions gain the columns added since (migrated defaults); every column the file has must
    # encode exactly as it was: the batch restricted to them has the sha256 the file recorded for it.
    recorded = json.loads(old_meta[schema.KEY_BATCH_SHA256])
    assert new.num_record_batches == old.num_record_batches == len(recorded)
    for i in range(new.num_record_batches):
        kept = new.get_batch(i).select(old.schema.names)
        assert batch_sha256(kept) == recorded[i], f"{name}: record batch {i} encodes differently"
    old_req, new_req = _requests(old_meta), _requests(new_meta)
    # (compared as JSON text: Table.equals holds NaN != NaN, and a request's unexposed first uniform is NaN)
    assert json.dumps(new_req.select(old_req.column_names).to_pylist()) == json.dumps(old_req.to_pylist()), \
        f"{name}: the requests table differs"
    assert new_meta[schema.KEY_PROVENANCE] == old_meta[schema.KEY_PROVENANCE]
    # and the new bytes are a fixed point
    assert trace_bytes(trace_from_bytes(out, name)) == out


def test_the_schemas_are_the_row_fields_in_order() -> None:
    assert schema.STEPS_SCHEMA.names == [f.name for f in dataclasses.fields(rows.StepRow)]
    assert schema.REQUESTS_SCHEMA.names == [f.name for f in dataclasses.fields(rows.RequestRow)]
    state = schema.STEPS_SCHEMA.field("state").type.value_type
    assert [state.field(i).name for i in range(state.num_fields)] == [f.name for f in dataclasses.fields(rows.StateEntry)]
    # what a reader of an older file gets for the columns added since: the row's own defaults
    assert schema.SAMPLING_REQUEST_FIELDS == ("temperature", "top_k", "top_p", "seed", "rng", "rng_request",
                                              "first_uniform")
    assert schema.SAMPLING_STEP_FIELDS == ("node_draws", "node_uniforms")
    defaults = rows.RequestRow("r", "prose", [], [], [])
    for name, value in schema.SAMPLING_DEFAULTS.items():
        got = getattr(defaults, name)
        assert got == value or (got != got and value != value), name


def _digest(steps: pa.Schema, requests: pa.Schema) -> str:
    return hashlib.sha256(steps.serialize().to_pybytes() + requests.serialize().to_pybytes()).hexdigest()


def _without(s: pa.Schema, names: tuple[str, ...]) -> pa.Schema:
    return pa.schema([f for f in s if f.name not in names])


def test_the_frozen_schema_digest() -> None:
    """The Arrow schemas serialize as they did when each version was introduced (a changed type,
    nullability, order or name is a format change: bump SCHEMA_VERSION and add a migration), and each
    earlier version's schema is the current one without the columns added since."""
    assert _digest(schema.STEPS_SCHEMA, schema.REQUESTS_SCHEMA) == FROZEN_SCHEMA_SHA256[schema.SCHEMA_VERSION]
    steps_15, reqs_15 = schema.added_in(rows.StepRow, (1, 5)), schema.added_in(rows.RequestRow, (1, 5))
    assert steps_15 == () and reqs_15 == ("max_new_tokens",)
    requests_14 = _without(schema.REQUESTS_SCHEMA, reqs_15)
    assert _digest(schema.STEPS_SCHEMA, requests_14) == FROZEN_SCHEMA_SHA256["1.4"]
    steps_14, reqs_14 = schema.added_in(rows.StepRow, (1, 4)), schema.added_in(rows.RequestRow, (1, 4))
    assert steps_14 == ("draft_context_positions", "draft_context_sketch", "shadow_tree_tokens",
                        "shadow_tree_parents") and reqs_14 == ()
    steps_13, reqs_13 = schema.added_in(rows.StepRow, (1, 3)), schema.added_in(rows.RequestRow, (1, 3))
    assert steps_13 == ("residual_uniform",) and reqs_13 == ()
    assert _digest(_without(schema.STEPS_SCHEMA, steps_14), requests_14) == FROZEN_SCHEMA_SHA256["1.3"]
    assert _digest(_without(schema.STEPS_SCHEMA, steps_14 + steps_13), requests_14) == \
        FROZEN_SCHEMA_SHA256["1.2"]


FROZEN_SCHEMA_SHA256 = {
    "1.2": "51fb4dcacac40e48d7c14a3e8ccca0b54c62a1224a1753a53a8fff82da1341bb",
    "1.3": "8a9ba2a9059009709c98eba62e7f035181bc0880099cbc42260cd99a9a05ff50",
    "1.4": "cb91865b342bf793f2f4404549418bf14a589973bd626dc8e8c3c8010e13bb1f",
    "1.5": "4061671807ac7e613d722e6e2b0a9bc32056f82aca6ac8d97de391bf765c3e70",
}


def test_golden_list_is_not_empty() -> None:
    assert GOLDENS and all(Path(REPO_GOLDEN / g).exists() for g in GOLDENS)
