"""Strict checkpoint contents: every tensor the model needs is in the files, with its shape and dtype.

Contract: a loader reads the tensor index of a checkpoint directory (:func:`read_tensor_index`: the
name, shape and dtype of every tensor in the ``*.safetensors`` files it loads, from the headers only:
:func:`transformers_files` for a transformers model; a name in two files is refused) and,
after building the model, compares the two into a :class:`TensorReport`:

* missing: a parameter or persistent buffer the model has and the files do not provide (it would
  otherwise keep its random initialisation, and two runs of the "same" model would differ);
* unexpected: a tensor in the files that the model has no place for (a different architecture or
  a broken conversion); tensors the model's own loader deliberately skips (transformers'
  ``_keys_to_ignore_on_load_unexpected``, e.g. Qwen3.5's vision tower and MTP head) are not counted;
* wrong shape: a tensor whose shape differs from the model's;
* wrong dtype: a non-floating-point tensor (integer, bool) where the model holds floating-point
  values (it would be cast to float silently); floating-point dtypes are all accepted, the loader
  casts them to the dtype asked for.

:meth:`TensorReport.raise_if_bad` raises :class:`~ddtree_reference.errors.CheckpointTensorsError` (a
:class:`~ddtree_reference.errors.CheckpointError`: refcheck exits 6) naming the first few tensors of each
kind and their count. :func:`transformers_report` builds the report of a transformers
``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)`` (transformers maps
checkpoint names to the model's, e.g. ``model.language_model.*`` of a composite checkpoint);
:func:`state_report` builds it for a model whose state names equal the checkpoint's (the drafter).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddtree_reference.errors import CheckpointError, CheckpointTensorsError

SHOWN = 5  # tensor names shown per kind in an error message


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a checkpoint, from its safetensors header."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", "I64", ...
    file: str

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))  # F64 .. F4 and the F8 variants, BF16


def transformers_files(directory: Path) -> list[Path]:
    """The safetensors files transformers loads from ``directory``: the shards its
    ``model.safetensors.index.json`` names, else ``model.safetensors``, else every ``*.safetensors``."""
    directory = Path(directory)
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            shards = sorted({str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"malformed {index_file}: {exc!r}") from None
        return [directory / f for f in shards]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else sorted(directory.glob("*.safetensors"))


def read_tensor_index(directory: Path, what: str, files: Sequence[Path] | None = None) -> dict[str, TensorInfo]:
    """Name -> :class:`TensorInfo` of every tensor in ``files`` (default: every ``*.safetensors`` of
    ``directory``).

    Raises CheckpointError for a missing file, an unreadable header or a name held by two files (which
    of the two a loader takes is not defined)."""
    index: dict[str, TensorInfo] = {}
    for f in sorted(Path(directory).glob("*.safetensors")) if files is None else files:
        for name, info in _header(Path(f), what).items():
            if name in index:
                raise CheckpointError(f"{what} checkpoint {directory}: tensor {name} is in both "
                                      f"{index[name].file} and {info.file}")
            index[name] = info
    return index


def _header(f: Path, what: str) -> dict[str, TensorInfo]:
    from safetensors import safe_open

    if not f.is_file():
        raise CheckpointError(f"{what} weights {f} not found")
    try:
        with safe_open(str(f), framework="pt") as handle:
            slices = {k: handle.get_slice(k) for k in handle.keys()}
            return {k: TensorInfo(tuple(s.get_shape()), str(s.get_dtype()), f.name) for k, s in slices.items()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{what} weights {f} are not a valid safetensors file: {first}") from None


def _shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _listing(items: list[str], one: str, many: str) -> str:
    shown = ", ".join(items[:SHOWN]) + (f", and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
    return f"{len(items)} {one if len(items) == 1 else many}: {shown}"


def _shapes(name: str, checkpoint: tuple[int, ...], model: tuple[int, ...]) -> str:
    return f"{name} (checkpoint {_shape(checkpoint)}, model {_shape(model)})" if checkpoint or model else name


@dataclass(slots=True)
class TensorReport:
    """What a checkpoint lacks or holds wrongly for a model (each list sorted by name)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # name, file, model shapes
    wrong_dtype: list[tuple[str, str]] = field(default_factory=list)  # name, the file's dtype
    errors: list[str] = field(default_factory=list)  # the loader's own error messages

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype or self.errors)

    def message(self, what: str) -> str:
        parts = []
        if self.missing:
            parts.append(_listing(self.missing, "missing tensor", "missing tensors")
                         + " (the model would otherwise run on random values for them)")
        if self.wrong_shape:
            parts.append(_listing([_shapes(*e) for e in self.wrong_shape], "tensor of the wrong shape",
                                  "tensors of the wrong shape"))
        if self.wrong_dtype:
            parts.append(_listing([f"{n} ({d})" for n, d in self.wrong_dtype], "non-floating-point tensor",
                                  "non-floating-point tensors") + " where the model holds floating-point values")
        if self.unexpected:
            parts.append(_listing(self.unexpected, "unexpected tensor", "unexpected tensors")
                         + " (the model has no such tensor)")
        if self.errors:
            parts.append(_listing(self.errors, "loader error", "loader errors"))
        return f"{what} does not match the model: " + "; ".join(parts)

    def raise_if_bad(self, what: str) -> None:
        """Raise CheckpointTensorsError naming the faults; ``what`` names the checkpoint ("target checkpoint DIR")."""
        if not self.ok:
            raise CheckpointTensorsError(self.message(what), missing=self.missing, unexpected=self.unexpected,
                                         wrong_shape=[n for n, _, _ in self.wrong_shape],
                                         wrong_dtype=[n for n, _ in self.wrong_dtype])


def _dtype_faults(index: Mapping[str, TensorInfo], state: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """Tensors of the files that are not floating point where the model's tensor of that name is (or where
    the model has none of that name: every tensor of the supported architectures is floating point)."""
    return sorted((name, info.dtype) for name, info in index.items()
                  if not info.floating and (name not in state or state[name].is_floating_point()))


def _mismatch_entry(entry: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """transformers' mismatched-keys entry: (name, checkpoint shape, model shape), or a bare name."""
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        return str(entry[0]), tuple(int(d) for d in entry[1]), tuple(int(d) for d in entry[2])
    return str(entry), (), ()


def transformers_report(info: Mapping[str, Any], index: Mapping[str, TensorInfo],
                        state: Mapping[str, torch.Tensor]) -> TensorReport:
    """The report of a transformers load: its loading ``info`` plus the dtype check of ``index``."""
    return TensorReport(
        missing=sorted(str(k) for k in info.get("missing_keys") or ()),
        unexpected=sorted(str(k) for k in info.get("unexpected_keys") or ()),
        wrong_shape=sorted(_mismatch_entry(e) for e in info.get("mismatched_keys") or ()),
        wrong_dtype=_dtype_faults(index, state),
        errors=[str(e) for e in info.get("error_msgs") or ()],
    )


def state_report(index: Mapping[str, TensorInfo], state: Mapping[str, torch.Tensor]) -> TensorReport:
    """The report of a checkpoint whose tensor names are the model's state names (``state``: the
    parameters and persistent buffers the checkpoint must provide)."""
    return TensorReport(
        missing=sorted(set(state) - set(index)),
        unexpected=sorted(set(index) - set(state)),
        wrong_shape=sorted((name, info.shape, tuple(state[name].shape)) for name, info in index.items()
                           if name in state and info.shape != tuple(state[name].shape)),
        wrong_dtype=_dtype_faults(index, state),
    )
