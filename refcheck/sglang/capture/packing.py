"""A capture record as one header and one byte buffer: packed on the engine's side, unpacked by the reader.

Contract: a record is a nest of dicts, lists and tuples whose leaves are JSON values or tensors.
:func:`pack` replaces each tensor by ``{"__tensor__": i}`` and returns the tensors in order, the CUDA ones first;
:func:`flatten` turns tensors of one device into one ``uint8`` buffer where they live (one ``cat``: a record leaves
the device in one copy), and :func:`table` gives each tensor's dtype, shape and byte range in it. :func:`encode`
writes ``MAGIC``, the header's length (u64, little-endian), the header (JSON: the record's skeleton and its tensor
table) and the bytes (:func:`encode_parts`: the same as buffers, the tensors' bytes not copied); :func:`decode`
reads it back, every tensor a copy of its bytes (tuples come back as lists). A file that is not such a record
raises ``ValueError``. The engine's thread pays for :func:`pack`, :func:`flatten` and :func:`table` at every
recorded batch: each tensor costs two calls into torch (``ravel``, ``view``) and the table reads only shapes
and dtypes.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any

import torch

MAGIC = b"RCAP1\n"
_KEY = "__tensor__"
_PLAIN = frozenset({int, float, str, bool, type(None)})


def pack(nest: Any) -> tuple[Any, list[torch.Tensor], int]:
    """(the nest with every tensor replaced by its index, the tensors, how many of them are CUDA tensors): the CUDA
    tensors numbered first (they leave the device as one buffer, the CPU ones follow it in the file), each group in
    the nest's order; one walk of the nest."""
    device: list[tuple[dict[str, int], torch.Tensor]] = []
    host: list[tuple[dict[str, int], torch.Tensor]] = []

    def walk(obj: Any) -> Any:
        if type(obj) in _PLAIN:  # most leaves
            return obj
        if isinstance(obj, torch.Tensor):
            slot = {_KEY: 0}
            (device if obj.is_cuda else host).append((slot, obj))
            return slot
        if isinstance(obj, dict):
            return {k if type(k) is str else str(k): walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            # a record's longest lists (rids, steps, lengths per request) are plain values: copied, not walked
            return list(obj) if _PLAIN.issuperset(map(type, obj)) else [walk(v) for v in obj]
        return obj

    skeleton = walk(nest)
    for i, (slot, _) in enumerate(device + host):
        slot[_KEY] = i
    return skeleton, [t for _, t in device + host], len(device)


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def table(tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Each tensor's dtype, shape and byte range in the flattened buffer, in order (from its shape and dtype: no
    call into the tensor, the engine's thread pays for every one)."""
    out, offset = [], 0
    for t in tensors:
        dtype, shape = t.dtype, list(t.shape)
        n = math.prod(shape) * dtype.itemsize
        out.append({"dtype": _dtype_name(dtype), "shape": shape, "offset": offset, "bytes": n})
        offset += n
    return out


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after the other, as one ``uint8`` tensor on their device."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    # each [*shape] -> [numel] contiguous (ravel copies only a tensor that is not) -> [numel * itemsize] bytes: two
    # calls per tensor (a record's tensors carry no autograd history)
    return torch.cat([t.ravel().view(torch.uint8) for t in tensors])


def encode_parts(skeleton: Any, entries: list[dict[str, Any]], *data: bytes | memoryview) -> list[bytes | memoryview]:
    """The record's file contents as buffers to write one after the other (``data``: the tensors' bytes, in the
    table's order, not copied)."""
    header = json.dumps({"record": skeleton, "tensors": entries}).encode()
    return [MAGIC + struct.pack("<Q", len(header)) + header, *data]


def encode(skeleton: Any, entries: list[dict[str, Any]], *data: bytes | memoryview) -> bytes:
    """:func:`encode_parts` as one ``bytes``."""
    return b"".join(encode_parts(skeleton, entries, *data))


def decode(raw: bytes) -> Any:
    """A record file's bytes -> the nest, tensors restored."""
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 8:
        raise ValueError("not a refcheck capture record")
    (n,) = struct.unpack_from("<Q", raw, len(MAGIC))
    start = len(MAGIC) + 8
    head = json.loads(raw[start:start + n])
    data = memoryview(raw)[start + n:]
    tensors = []
    for e in head["tensors"]:
        if e["offset"] + e["bytes"] > len(data):
            raise ValueError("capture record cut short")
        chunk = bytearray(data[e["offset"]: e["offset"] + e["bytes"]])
        flat = torch.frombuffer(chunk, dtype=getattr(torch, e["dtype"])) if chunk else \
            torch.empty(0, dtype=getattr(torch, e["dtype"]))
        tensors.append(flat.reshape(e["shape"]))

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_KEY}:
                return tensors[obj[_KEY]]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(head["record"])
