"""A capture computation replayed as one CUDA graph per input shape: the launches of a recorded batch's device
work cost the scheduler's thread one graph launch.

Contract: :class:`GraphCache` maps a key (the shapes and settings a computation depends on) to a captured
:class:`torch.cuda.CUDAGraph` of ``fn(*inputs)``, where ``fn`` takes device tensors and returns a nest (dicts,
lists, tuples) of device tensors and plain values, reads nothing else that changes between calls but
fixed-address buffers (SGLang's pools and refcheck's cached projections) and never synchronises with the
host. :meth:`GraphCache.run` copies the inputs into the graph's static inputs and replays it on the current
stream (every input on the GPU; otherwise it runs eagerly); the returned nest is the graph's static outputs. The
graphs of one cache share one memory pool (a computation's intermediates, as large as a batch's logits, are held
once per cache, not once per shape), so a replay may overwrite the outputs of any graph of the same cache: a
caller replays at most one graph of a cache between copying its outputs out on the same stream (the shipper's
packing does, once per batch). Each graph keeps a copy of its inputs (its static inputs, outside the pool): a
cache captures at most ``limit`` graphs and holds at most ``max_bytes`` (:data:`MAX_STATIC_BYTES`) of static
inputs; a key past either runs eagerly (:meth:`GraphCache.admits`). The first call of a key runs ``fn`` once
eagerly on a side stream (its lazy caches and allocations), then captures it there with
``thread_local`` capture mode (other threads' CUDA calls are not disturbed), without
:func:`torch.cuda.graph`'s device-wide synchronise, garbage collection and cache emptying. Off CUDA, or for a
key whose capture failed (the failure is handed to ``on_error`` once, a capture that ends well clears what the
failed one left in the CUDA generator, and the key runs eagerly from then on),
:meth:`GraphCache.run` is ``fn(*inputs)``. A replay computes what the eager call computes, kernel for kernel. A
cache counts its calls on the GPU, replayed from a graph or run eagerly (refused or not capturable), until
:meth:`GraphCache.take_counts` takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Captured:
    def __init__(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], pool: Any) -> None:
        self.inputs = tuple(t.clone() for t in inputs)  # the graph's static inputs
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn(*self.inputs)  # warm-up: lazy projections and the allocator's blocks exist before capture
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.outputs = fn(*self.inputs)
            finally:
                self.graph.capture_end()
        current.wait_stream(side)

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        for static, t in zip(self.inputs, inputs):
            static.copy_(t, non_blocking=True)
        self.graph.replay()
        return self.outputs


def _end_capturing_state() -> None:
    """After a failed capture: a capture that ends well on the device. A capture whose ``capture_end`` raised never
    ran the default CUDA generator's epilogue, so the generator still counts itself as capturing and every later
    random op of the process on that device (SGLang's sampling among them) raises "Offset increment outside graph
    capture encountered unexpectedly" (pytorch/pytorch#171263); the epilogue of any successful capture clears it."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        x = torch.zeros(1, device=current.device)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        x.add_(1)
        graph.capture_end()
    current.wait_stream(side)


#: the device memory a cache's graphs may hold in static inputs (each graph keeps a copy of its inputs: a verify
#: reduction's are the batch's float32 logits, [rows, vocab], ~16 MB per request of a 16-token block at a 248k
#: vocabulary)
MAX_STATIC_BYTES = 256 * 2**20


class GraphCache:
    """Captured graphs of one computation by key (module docstring)."""

    def __init__(self, on_error: Callable[[Hashable, Exception], None] | None = None, limit: int = 64,
                 max_bytes: int = MAX_STATIC_BYTES) -> None:
        self._graphs: dict[Hashable, _Captured] = {}
        self._eager: set[Hashable] = set()  # keys whose capture failed, or past ``limit`` graphs or ``max_bytes``
        self._on_error = on_error
        self.limit, self.max_bytes = limit, max_bytes
        self.static_bytes = 0  # the static inputs of the graphs captured so far
        self._pool: Any = None  # the memory pool every graph of this cache is captured into
        self.replayed = 0  # calls on the GPU replayed from a graph (its capture's first call included) ...
        self.ran_eagerly = 0  # ... and run eagerly (a key refused, or not capturable), since take_counts

    def __len__(self) -> int:
        return len(self._graphs)

    def take_counts(self) -> tuple[int, int]:
        """(replayed, ran eagerly): the calls on the GPU since the last take, the counts then reset."""
        got = (self.replayed, self.ran_eagerly)
        self.replayed = self.ran_eagerly = 0
        return got

    def admits(self, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``key`` may have a graph: fewer than ``limit`` graphs so far, and its static inputs within what
        ``max_bytes`` leaves; a key refused runs eagerly from then on (its work is the same, only not replayed)."""
        if len(self._graphs) >= self.limit or self.static_bytes + _nbytes(inputs) > self.max_bytes:
            self._eager.add(key)
            return False
        return True

    def run(self, key: Hashable, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        """``fn(*inputs)``, replayed from the key's graph where it can be (module docstring)."""
        if not inputs or any(t.device.type != "cuda" for t in inputs):
            return fn(*inputs)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(key, fn, inputs)
            if captured is None:
                self.ran_eagerly += 1
                return fn(*inputs)
        self.replayed += 1
        return captured(inputs)

    def _capture(self, key: Hashable, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> _Captured | None:
        """The key's new graph, or None where it runs eagerly: refused (:meth:`admits`), its capture failed now (the
        failure handed to ``on_error``) or before."""
        if key in self._eager or not self.admits(key, inputs):
            return None
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            captured = self._graphs[key] = _Captured(fn, inputs, self._pool)
        except Exception as exc:  # a computation that cannot be captured runs eagerly; the engine carries on
            self._eager.add(key)
            if self._on_error is not None:
                self._on_error(key, exc)
            _end_capturing_state()
            return None
        self.static_bytes += _nbytes(captured.inputs)
        return captured


def run(cache: GraphCache | None, key: Hashable, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """``fn(*inputs)``: through ``cache`` (:meth:`GraphCache.run`) when there is one, else eagerly."""
    return fn(*inputs) if cache is None else cache.run(key, fn, *inputs)
