"""A trace file's own checksums (trace schema >= 1.1; the layout is in docs/trace-format.md).

Contract: :func:`sealed_file_bytes` writes an Arrow IPC file whose schema metadata carries a sha256
per record batch, one of the requests table and one of the whole file (computed with both copies
of its own value zeroed, then written into them); :func:`check_checksums` verifies a file read back
and names where a damaged one is damaged (a record batch, the requests table, or elsewhere) in a
:class:`~refcheck.errors.CorruptTraceError`. Pure bytes in, bytes out: no trace rows here.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence

import pyarrow as pa

from refcheck.errors import CorruptTraceError
from refcheck.trace.schema import (
    CHECKSUM_KEYS,
    CHECKSUM_VERSION,
    KEY_BATCH_SHA256,
    KEY_FILE_SHA256,
    KEY_REQUESTS,
    KEY_REQUESTS_SHA256,
    TraceValidationError,
)

IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")  # every Arrow stream and file a trace writes
_SLOT = 64  # hex characters of a sha256
_ZERO_SLOT = b"0" * _SLOT
_SLOT_COPIES = 2  # the schema is written twice in an Arrow file: the header message and the footer


def batch_sha256(batch: pa.RecordBatch) -> str:
    """sha256 of a record batch's uncompressed IPC serialization (the same for a written batch and
    the batch read back)."""
    return hashlib.sha256(batch.serialize()).hexdigest()


def _find_all(data: bytes, needle: bytes) -> list[int]:
    out, i = [], data.find(needle)
    while i >= 0:
        out.append(i)
        i = data.find(needle, i + 1)
    return out


def _file_digest(data: bytes, positions: list[int]) -> bytes:
    buf = bytearray(data)
    for p in positions:
        buf[p:p + _SLOT] = _ZERO_SLOT
    return hashlib.sha256(buf).hexdigest().encode()


def sealed_file_bytes(schema: pa.Schema, batches: Sequence[pa.RecordBatch]) -> bytes:
    """An Arrow IPC file of ``batches`` whose schema metadata is ``schema``'s plus the checksum keys
    (any old ones replaced): per-batch and requests sha256, and the file's own sha256, computed
    with both copies of its value zeroed and then written into them in place."""
    meta = {k: v for k, v in (schema.metadata or {}).items() if k not in CHECKSUM_KEYS}
    meta[KEY_BATCH_SHA256] = json.dumps([batch_sha256(b) for b in batches]).encode()
    if KEY_REQUESTS in meta:
        meta[KEY_REQUESTS_SHA256] = hashlib.sha256(meta[KEY_REQUESTS]).hexdigest().encode()
    slot = secrets.token_hex(_SLOT // 2).encode()  # unique placeholder, replaced below: output is deterministic
    meta[KEY_FILE_SHA256] = slot
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema.with_metadata(meta), options=IPC_OPTIONS) as writer:
        for batch in batches:
            writer.write_batch(batch)
    data = sink.getvalue().to_pybytes()
    positions = _find_all(data, slot)
    if len(positions) != _SLOT_COPIES:
        raise TraceValidationError(f"cannot seal the trace: {len(positions)} copies of the checksum slot, "
                                   f"expected {_SLOT_COPIES}")
    digest = _file_digest(data, positions)
    buf = bytearray(data)
    for p in positions:
        buf[p:p + _SLOT] = digest
    return bytes(buf)


def _locate_damage(reader: pa.ipc.RecordBatchFileReader, meta: dict[bytes, bytes]) -> str:
    """Where a file whose checksum fails is damaged: a record batch, the requests table, or elsewhere."""
    try:
        expected = json.loads(meta[KEY_BATCH_SHA256])
        assert isinstance(expected, list)
    except (KeyError, ValueError, UnicodeDecodeError, AssertionError):
        return "in the record batch checksum table (schema metadata)"
    for i in range(reader.num_record_batches):
        try:
            batch = reader.get_batch(i)
            batch.validate(full=True)
            digest = batch_sha256(batch)
        except (pa.ArrowException, OSError, ValueError) as exc:
            return f"in record batch {i} (unreadable: {str(exc).splitlines()[0][:120]})"
        if i >= len(expected) or digest != expected[i]:
            return f"in record batch {i} ({batch.num_rows} step rows; its sha256 differs)"
    if len(expected) != reader.num_record_batches:
        return f"in the record batch count ({reader.num_record_batches}, checksums for {len(expected)})"
    requests = meta.get(KEY_REQUESTS, b"")
    if hashlib.sha256(requests).hexdigest().encode() != meta.get(KEY_REQUESTS_SHA256):
        return "in the requests table (schema metadata)"
    return "outside the record batches (file header, schema message or footer)"


def check_checksums(data: bytes, reader: pa.ipc.RecordBatchFileReader, version: tuple[int, int] | None,
                    source: str) -> bool:
    """Verify a file's own checksums (module docstring). True when checked, False for a legacy
    file without them (schema < 1.1); a mismatch is a :class:`CorruptTraceError` naming the place."""
    meta = reader.schema.metadata or {}
    digest = meta.get(KEY_FILE_SHA256)
    if digest is None:
        if version is not None and version >= CHECKSUM_VERSION:
            raise CorruptTraceError(f"{source}: a schema {version[0]}.{version[1]} trace without its checksums "
                                    f"({KEY_FILE_SHA256.decode()} is missing)")
        return False
    positions = _find_all(data, digest) if len(digest) == _SLOT else []
    if len(positions) != _SLOT_COPIES or _file_digest(data, positions) != digest:
        raise CorruptTraceError(f"{source}: checksum mismatch {_locate_damage(reader, meta)}: the file is corrupt")
    return True
