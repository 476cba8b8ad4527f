"""Vocabulary-wide reductions in row chunks: the device memory of their float32 intermediates stays bounded
whatever the batch.

Contract: a capture reduces ``[rows, V]`` scores inside the engine's step (the verify's node summary, the drafter's
top ranks), and each reduction makes float32 ``[rows, V]`` intermediates: at a 248k vocabulary, 32 requests of
16-token blocks make 508 MB of them per intermediate, taken from the memory SGLang leaves outside its pools (and
kept in a CUDA graph's pool when the reduction is graphed). :func:`row_chunks` splits the rows into consecutive
slices whose float32 ``[chunk, V]`` takes at most ``chunk_bytes`` (:data:`CHUNK_BYTES` by default, read at call
time; one row at least); :func:`by_row_chunks` calls a row-wise function on each slice of its ``[rows, ...]``
inputs and joins each output along its rows (a 0-dim output is the first slice's). For a row-wise function the
result is the whole call's, row for row; where everything fits one slice it is the same call. ``vocab`` is a row's
width in elements: the recurrent state sketch (:mod:`refcheck.sglang.capture.state`) chunks its rows of
``HV*V*K`` state the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: the most bytes a float32 ``[chunk, V]`` intermediate of one slice may take (67 rows at a 248k vocabulary)
CHUNK_BYTES = 64 * 2**20


def row_chunks(rows: int, vocab: int, chunk_bytes: int | None = None) -> list[slice]:
    """Consecutive slices covering ``range(rows)``, each of at most ``chunk_bytes // (4 * vocab)`` rows (at least
    one); one empty slice for no rows."""
    per = max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // max(1, 4 * vocab))
    return [slice(i, min(i + per, rows)) for i in range(0, rows, per)] or [slice(0, 0)]


def by_row_chunks(fn: Callable[..., dict[str, torch.Tensor]], inputs: Sequence[torch.Tensor | None], rows: int,
                  vocab: int) -> dict[str, torch.Tensor]:
    """``fn(*inputs)`` for a row-wise ``fn`` of ``[rows, ...]`` inputs (None passed through), slice by slice
    (:func:`row_chunks`), its outputs joined along their rows."""
    parts = [fn(*(None if t is None else t[s] for t in inputs)) for s in row_chunks(rows, vocab)]
    if len(parts) == 1:
        return parts[0]
    return {name: t if t.dim() == 0 else torch.cat([p[name] for p in parts]) for name, t in parts[0].items()}
