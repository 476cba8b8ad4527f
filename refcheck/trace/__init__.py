"""refcheck trace format: one Arrow IPC file per trace, schema version :data:`SCHEMA_VERSION`.

Contract: :func:`write_trace` / :func:`read_trace` round-trip a :class:`Trace` (requests, per-step
rows with tree, top-k, acceptance, emitted tokens, state sketches and timings, free-form JSON
provenance) exactly, with tensors bit-exact; writes are atomic; every read failure is a typed
:mod:`refcheck.errors` error (see :mod:`refcheck.trace.io`). The format is documented in
``docs/trace-format.md``. This package is the format alone: golden directories of traces (their
manifest and store) are :mod:`refcheck.goldens`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refcheck.lazy import lazy_exports

# Names are loaded on first use (PEP 562): importing the package alone loads neither pyarrow nor torch.
_EXPORTS = {
    "DTYPE_NAMES": "codec",
    "decode_tensor": "codec",
    "encode_tensor": "codec",
    "RequestRow": "io",
    "StateEntry": "io",
    "StepRow": "io",
    "Trace": "io",
    "atomic_write_bytes": "io",
    "read_trace": "io",
    "trace_bytes": "io",
    "trace_from_bytes": "io",
    "write_trace": "io",
    "REQUESTS_SCHEMA": "schema",
    "SCHEMA_VERSION": "schema",
    "STATE_KINDS": "schema",
    "STEPS_SCHEMA": "schema",
    "TIMING_FIELDS": "schema",
    "TraceValidationError": "schema",
}


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # the same names, eagerly, for type checkers
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
    from refcheck.trace.schema import (
        REQUESTS_SCHEMA,
        SCHEMA_VERSION,
        STATE_KINDS,
        STEPS_SCHEMA,
        TIMING_FIELDS,
        TraceValidationError,
    )

__all__ = [
    "DTYPE_NAMES",
    "REQUESTS_SCHEMA",
    "SCHEMA_VERSION",
    "STATE_KINDS",
    "STEPS_SCHEMA",
    "TIMING_FIELDS",
    "RequestRow",
    "StateEntry",
    "StepRow",
    "Trace",
    "TraceValidationError",
    "atomic_write_bytes",
    "decode_tensor",
    "encode_tensor",
    "read_trace",
    "trace_bytes",
    "trace_from_bytes",
    "write_trace",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
