"""refcheck trace format: one Arrow IPC file per trace, schema version :data:`SCHEMA_VERSION`.

Contract: :func:`write_trace` / :func:`read_trace` round-trip a :class:`Trace` (requests, per-step
rows with tree, top-k, acceptance, emitted tokens, state sketches and timings, free-form JSON
provenance) exactly, with tensors bit-exact; writes are atomic; every read failure is a typed
:mod:`refcheck.errors` error (see :mod:`refcheck.trace.io`). :mod:`refcheck.trace.manifest` keeps
the sha256 ``MANIFEST.json`` beside stored traces. The format is documented in
``docs/trace-format.md``.
"""

from __future__ import annotations

from refcheck.trace.codec import DTYPE_NAMES, decode_tensor, encode_tensor
from refcheck.trace.io import (
    RequestRow,
    StateEntry,
    StepRow,
    Trace,
    atomic_write_bytes,
    read_trace,
    trace_bytes,
    trace_from_bytes,
    write_trace,
)
from refcheck.trace.manifest import (
    MANIFEST_NAME,
    HistoryEntry,
    Manifest,
    ManifestEntry,
    load_manifest,
    sha256_file,
)
from refcheck.trace.schema import (
    REQUESTS_SCHEMA,
    SCHEMA_VERSION,
    STATE_KINDS,
    STEPS_SCHEMA,
    TIMING_FIELDS,
    SchemaVersionError,
    TraceValidationError,
)

__all__ = [
    "DTYPE_NAMES",
    "MANIFEST_NAME",
    "REQUESTS_SCHEMA",
    "SCHEMA_VERSION",
    "STATE_KINDS",
    "STEPS_SCHEMA",
    "TIMING_FIELDS",
    "HistoryEntry",
    "Manifest",
    "ManifestEntry",
    "RequestRow",
    "SchemaVersionError",
    "StateEntry",
    "StepRow",
    "Trace",
    "TraceValidationError",
    "atomic_write_bytes",
    "decode_tensor",
    "encode_tensor",
    "load_manifest",
    "read_trace",
    "sha256_file",
    "trace_bytes",
    "trace_from_bytes",
    "write_trace",
]
