"""CUDA-graph capture of a fixed-shape step, with an eager stand-in that reads the same way.

Contract: :func:`capture` returns ``(replay, outputs)`` for ``fn``. With graphs it warms ``fn`` up
twice on a side stream (as ``torch.cuda.graph`` wants), calling ``undo`` after each run so the
warm-ups leave no trace in the state ``fn`` commits to, then captures one run. Each replay rewrites
the captured output tensors. Without graphs, ``fn`` must return a tuple of tensors: the stand-in
runs it once for the outputs, then each replay re-runs it and copies into those same tensors. A
caller therefore reads results identically either way, and the eager path runs on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any], undo: Callable[[], None] | None = None,
            use_graphs: bool = True) -> tuple[Callable[[], None], Any]:
    undo = undo or (lambda: None)
    if not use_graphs:
        outputs = fn()
        undo()

        def replay() -> None:
            for dst, src in zip(outputs, fn()):
                dst.copy_(src)

        return replay, outputs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            undo()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    undo()
    return graph.replay, outputs
