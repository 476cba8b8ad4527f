"""Exact tensor encoding for traces: ``{"dtype": str, "shape": [int], "data": bytes}``.

Contract: :func:`decode_tensor` of :func:`encode_tensor` of ``t`` is a CPU, contiguous tensor with
``t``'s dtype, shape and *bits* (NaN payloads, signed zeros and all). ``dtype`` is the logical
dtype name (``"float32"``, ``"bfloat16"``, ...; see :data:`DTYPE_NAMES`); ``data`` is the raw
little-endian element bytes in C order. Dtypes Arrow and numpy lack (bfloat16, float8) are
stored as their raw integer words of the same width, so they round-trip bit-exactly.
:func:`encode_tensor` raises :class:`~refcheck.trace.schema.TraceValidationError` for a dtype
outside the table; :func:`decode_tensor` raises :class:`~refcheck.errors.CorruptTraceError` for
an unknown dtype, a bad shape, or a byte count that does not match the shape.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refcheck.errors import CorruptTraceError
from refcheck.trace.schema import TraceValidationError


@dataclass(slots=True, frozen=True)
class _Storage:
    torch_dtype: torch.dtype  # the logical dtype
    word: torch.dtype  # the dtype whose bits are stored (== torch_dtype when numpy has it)
    numpy_le: np.dtype  # little-endian numpy view of one stored word


def _s(logical: torch.dtype, word: torch.dtype, np_code: str) -> _Storage:
    return _Storage(logical, word, np.dtype(np_code))


_TABLE: dict[str, _Storage] = {
    "float64": _s(torch.float64, torch.float64, "<f8"),
    "float32": _s(torch.float32, torch.float32, "<f4"),
    "float16": _s(torch.float16, torch.float16, "<f2"),
    # No numpy/Arrow bfloat16: keep the raw 16-bit words (bit-exact, NaN payloads included).
    "bfloat16": _s(torch.bfloat16, torch.int16, "<i2"),
    # FP8 KV caches: raw bytes.
    "float8_e4m3fn": _s(torch.float8_e4m3fn, torch.uint8, "u1"),
    "float8_e5m2": _s(torch.float8_e5m2, torch.uint8, "u1"),
    "int64": _s(torch.int64, torch.int64, "<i8"),
    "int32": _s(torch.int32, torch.int32, "<i4"),
    "int16": _s(torch.int16, torch.int16, "<i2"),
    "int8": _s(torch.int8, torch.int8, "i1"),
    "uint8": _s(torch.uint8, torch.uint8, "u1"),
    "bool": _s(torch.bool, torch.bool, "?"),
}
_NAME_OF: dict[torch.dtype, str] = {s.torch_dtype: name for name, s in _TABLE.items()}
DTYPE_NAMES: tuple[str, ...] = tuple(_TABLE)


def dtype_name(dtype: torch.dtype) -> str:
    """The logical name stored for ``dtype``."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TraceValidationError(
            f"cannot store a tensor of dtype {dtype} in a trace "
            f"(supported: {', '.join(DTYPE_NAMES)})"
        ) from None


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """``t`` (any device, any layout) -> ``{"dtype", "shape", "data"}`` with the exact bits."""
    if not isinstance(t, torch.Tensor):
        raise TraceValidationError(f"expected a torch.Tensor, got {type(t).__name__}")
    name = dtype_name(t.dtype)
    storage = _TABLE[name]
    flat = t.detach().to("cpu").contiguous()
    if storage.word != storage.torch_dtype:
        # Reinterpret (no value conversion) as same-width integer words numpy can hold.
        flat = flat.view(storage.word)
    arr = flat.numpy()
    if sys.byteorder != "little" and arr.dtype.itemsize > 1:
        # The format stores little-endian bytes; swap on a big-endian host (value-preserving).
        arr = arr.astype(storage.numpy_le)
    return {"dtype": name, "shape": list(t.shape), "data": arr.tobytes(order="C")}


def decode_tensor(d: dict[str, Any]) -> torch.Tensor:
    """``{"dtype", "shape", "data"}`` -> a CPU, contiguous tensor with the stored bits."""
    try:
        name, shape, data = d["dtype"], d["shape"], d["data"]
    except (KeyError, TypeError):
        raise CorruptTraceError("tensor record lacks dtype/shape/data") from None
    storage = _TABLE.get(name) if isinstance(name, str) else None
    if storage is None:
        raise CorruptTraceError(f"tensor has unknown dtype {name!r} (known: {', '.join(DTYPE_NAMES)})")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise CorruptTraceError(f"tensor has an invalid shape {shape!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptTraceError(f"tensor data is {type(data).__name__}, not bytes")
    expected = math.prod(shape) * storage.numpy_le.itemsize
    if len(data) != expected:
        raise CorruptTraceError(
            f"{name} tensor of shape {list(shape)} needs {expected} bytes, the trace holds {len(data)}"
        )
    # bytearray: a writable copy, so torch owns memory it may write to.
    arr = np.frombuffer(bytearray(data), dtype=storage.numpy_le)
    if storage.torch_dtype == torch.bool:
        raw = arr.view(np.uint8)  # reinterpret to check the bytes are valid bools (0 or 1)
        if raw.size and int(raw.max()) > 1:
            raise CorruptTraceError("bool tensor holds bytes other than 0 and 1")
    if not arr.dtype.isnative:
        # Little-endian stored data on a big-endian host: convert to native order (value-preserving).
        arr = arr.astype(arr.dtype.newbyteorder("="))
    out = torch.from_numpy(arr.reshape(shape))
    if storage.word != storage.torch_dtype:
        # Reinterpret the stored integer words back as the logical dtype (same width, no conversion).
        out = out.view(storage.torch_dtype)
    return out
