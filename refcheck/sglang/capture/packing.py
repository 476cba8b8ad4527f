"""A capture record as one header and one byte buffer: packed on the engine's side, unpacked by the reader.

Contract: a record is a nest of dicts, lists and tuples whose leaves are JSON values or tensors.
:func:`pack` replaces each tensor by ``{"__tensor__": i}`` and returns the tensors in order, the CUDA ones first
(a :class:`Plain` part it takes as it is, unwalked);
:func:`flatten` turns tensors of one device into one ``uint8`` buffer where they live (one ``cat``: a record leaves
the device in one copy), and :func:`table` gives each tensor's dtype, shape and byte range in it. :func:`encode`
writes ``MAGIC``, the header's length (u64, little-endian), the header (the record's skeleton and its tensor table:
JSON's values, in :mod:`refcheck.sglang.capture.header_codec`'s bytes) and the bytes (:func:`encode_parts`: the
same as buffers, the tensors' bytes not copied); :func:`decode` reads it back, every tensor a copy of its bytes
(tuples come back as lists, as from JSON). Bytes that are not such a record raise ``ValueError``. The engine's
thread pays for :func:`pack`, :func:`flatten` and :func:`table` at every recorded batch: each tensor costs two calls
into torch (``ravel``, ``view``) and the table reads only shapes and dtypes.

A :class:`Packed` is a nest packed ahead of the record (:func:`prepack`), where its tensors are made: inside a CUDA
graph (:mod:`refcheck.sglang.capture.graphs`) the ``cat`` is one more kernel of the replay, and the graph's output is
one byte buffer with its skeleton and table fixed at capture. A record holding it packs it as one tensor (its table
entry carries the nest's skeleton and table under ``"packed"``), so the engine's thread pays for one buffer where it
paid for each of the nest's tensors; :func:`decode` restores the nest in its place, as if it had been packed with the
record.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from refcheck.sglang.capture import header_codec

MAGIC = b"RCAP2\n"
_KEY = "__tensor__"
_PLAIN = frozenset({int, float, str, bool, type(None)})


@dataclass(frozen=True, slots=True)
class Plain:
    """A part of a record that holds JSON values only (no tensor), such as the requests' context tokens:
    :func:`pack` puts it in the skeleton as it is, without walking it, and the writer's thread encodes it. The part
    must not change once shipped."""

    value: Any


@dataclass(frozen=True)
class Packed:
    """A nest packed ahead of its record (module docstring): its tensors' bytes in one buffer on their device."""

    data: torch.Tensor  # [nbytes] uint8: the nest's tensors, one after the other
    skeleton: Any  # the nest, each tensor replaced by {"__tensor__": i}
    entries: list[dict[str, Any]]  # the tensors' dtype, shape and byte range in ``data`` (:func:`table`)
    nbytes: int

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def unpacked(self) -> Any:
        """The nest with each tensor a view of :attr:`data` (three calls into torch per tensor)."""
        return _fill(self.skeleton, [_view(self.data, e) for e in self.entries])


def prepack(nest: Any) -> Packed:
    """``nest`` (its tensors on one device) as a :class:`Packed`."""
    skeleton, tensors, _ = pack(nest)
    entries = table(tensors)
    return Packed(flatten(tensors), skeleton, entries, sum(e["bytes"] for e in entries))


def _view(data: torch.Tensor, e: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, e["dtype"])
    flat = data[e["offset"]: e["offset"] + e["bytes"]]  # the tensor's bytes
    return (flat.view(dtype) if e["bytes"] else torch.empty(0, dtype=dtype, device=data.device)).reshape(e["shape"])


def _fill(skeleton: Any, tensors: list[Any]) -> Any:
    """``skeleton`` with each ``{"__tensor__": i}`` replaced by ``tensors[i]``."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_KEY}:
            return tensors[skeleton[_KEY]]
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, tensors) for v in skeleton]
    return skeleton


def pack(nest: Any) -> tuple[Any, list[Any], int]:
    """(the nest with every tensor and :class:`Packed` replaced by its index, those tensors and packs, how many of
    them are on CUDA): the CUDA ones numbered first (they leave the device as one buffer, the CPU ones follow it in
    the file), each group in the nest's order; one walk of the nest."""
    device: list[tuple[dict[str, int], Any]] = []
    host: list[tuple[dict[str, int], Any]] = []

    def walk(obj: Any) -> Any:
        if type(obj) in _PLAIN:  # most leaves
            return obj
        if type(obj) is Plain:  # a part with no tensor in it (thousands of context tokens): not walked
            return obj.value
        if isinstance(obj, (torch.Tensor, Packed)):
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


def table(tensors: list[Any]) -> list[dict[str, Any]]:
    """Each tensor's dtype, shape and byte range in the flattened buffer, in order (from its shape and dtype: no
    call into the tensor, the engine's thread pays for every one); a :class:`Packed` is its bytes, with its
    skeleton and table under ``"packed"``."""
    out, offset = [], 0
    for t in tensors:
        if type(t) is Packed:
            out.append({"dtype": "uint8", "shape": [t.nbytes], "offset": offset, "bytes": t.nbytes,
                        "packed": {"record": t.skeleton, "tensors": t.entries}})
            offset += t.nbytes
            continue
        dtype, shape = t.dtype, list(t.shape)
        n = math.prod(shape) * dtype.itemsize
        out.append({"dtype": _dtype_name(dtype), "shape": shape, "offset": offset, "bytes": n})
        offset += n
    return out


def flatten(tensors: list[Any]) -> torch.Tensor:
    """The tensors' bytes (a :class:`Packed`'s as they are), one after the other, as one ``uint8`` tensor on their
    device."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    # each [*shape] -> [numel] contiguous (ravel copies only a tensor that is not) -> [numel * itemsize] bytes: two
    # calls per tensor (a record's tensors carry no autograd history); a pack's buffer is already such bytes
    return torch.cat([t.data if type(t) is Packed else t.ravel().view(torch.uint8) for t in tensors])


def encode_parts(skeleton: Any, entries: list[dict[str, Any]], *data: bytes | memoryview) -> list[bytes | memoryview]:
    """The record's file contents as buffers to write one after the other (``data``: the tensors' bytes, in the
    table's order, not copied)."""
    header = header_codec.dumps({"record": skeleton, "tensors": entries})
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
    head = header_codec.loads(memoryview(raw)[start:start + n])
    return _fill(head["record"], _restore(head["tensors"], memoryview(raw)[start + n:]))


def _restore(entries: list[dict[str, Any]], data: memoryview) -> list[Any]:
    """The tensors of a table (a pack's entry: its nest) from the bytes it indexes, each a copy."""
    tensors: list[Any] = []
    for e in entries:
        if e["offset"] + e["bytes"] > len(data):
            raise ValueError("capture record cut short")
        if "packed" in e:
            inner = e["packed"]
            tensors.append(_fill(inner["record"], _restore(inner["tensors"], data[e["offset"]: e["offset"] + e["bytes"]])))
            continue
        chunk = bytearray(data[e["offset"]: e["offset"] + e["bytes"]])
        flat = torch.frombuffer(chunk, dtype=getattr(torch, e["dtype"])) if chunk else \
            torch.empty(0, dtype=getattr(torch, e["dtype"]))
        tensors.append(flat.reshape(e["shape"]))
    return tensors
