"""A capture record's header as bytes: JSON's values (dicts, lists, strings, numbers, booleans, None) in a fifth of
JSON's time, read back by a loader that can build nothing else.

Contract: :func:`dumps` takes what ``json.dumps`` takes and refuses, with ``TypeError``, what it refuses (a value of
another type: a NumPy scalar that is no ``float``, a tensor, an arbitrary object), save the types the C pickler
writes natively (a set, bytes, a complex number, a tuple as a dict key), which :func:`loads` refuses instead. A
subclass of ``int``, ``float``, ``str``, ``dict``, ``list`` or ``tuple`` goes as its base type's value, as JSON
writes it. The bytes are a pickle (protocol 5), written by the C pickler: the record's writer thread holds the
interpreter lock while it encodes a header, and each microsecond of that the engine's thread may wait for (a DFLASH
record's 4 KB header on a 2-core CPU: 25–29 µs against 87–95 µs for ``json.dumps``,
``scripts/bench_capture_ship.py --sites``). :func:`loads` reads them back as
``json.loads`` would read JSON's text of the same value: tuples as lists, every dict key a string (JSON's way:
``true``, ``null``, ``1.5``). Its unpickler finds no global but the five base types, so a capture file, whoever made
it, cannot make the reader run code; bytes that are not such a header raise ``ValueError``.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

_BASES: tuple[type, ...] = (int, float, str, dict, list, tuple)  # JSON's types that can be subclassed
_GLOBALS = {("builtins", t.__name__): t for t in (int, float, str, dict, list)}  # what a base type's value needs


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        """A value the C pickler does not write natively: a subclass of a JSON type as its base type's value; any
        other type is refused, as ``json.dumps`` refuses it. Exact JSON types never reach this; the base types
        themselves do (a subclass's value names its base), and go as the globals they are."""
        if any(obj is t for t in _GLOBALS.values()):
            return NotImplemented
        for base in _BASES:
            if isinstance(obj, base):
                if base is tuple:
                    return list, (list(obj),)
                return base, (base(obj),)
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"a capture header names {module}.{name}: not a JSON value")
        return found


def dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(value)
    return buf.getvalue()


def loads(data: bytes | memoryview) -> Any:
    try:
        value = _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any malformed pickle: truncated, a refused global, a bad opcode
        raise ValueError(f"not a capture record header ({type(exc).__name__}: {exc})") from None
    return _as_json(value)


def _as_json(value: Any) -> Any:
    """``value`` as ``json.loads(json.dumps(value))`` gives it; ValueError for a type JSON has no value for."""
    kind = type(value)
    if kind is dict:
        return {k if type(k) is str else _key(k): _as_json(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [_as_json(v) for v in value]
    if value is None or kind in (str, int, float, bool):
        return value
    raise ValueError(f"a capture header holds a {kind.__name__}: not a JSON value")


def _key(key: Any) -> str:
    """A dict key as JSON writes it (``json.dumps`` turns a number, boolean or None key into its text)."""
    if key is None or type(key) in (int, float, bool):
        return str(json.dumps(key))
    raise ValueError(f"a capture header has a {type(key).__name__} key: not a JSON value")
