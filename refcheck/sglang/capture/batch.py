"""One scheduler batch as the capture hooks see it: the snapshot taken before it runs, and helpers over its rows.

Contract: :class:`Batch` holds what the scheduler's batch looked like before it ran (rids, committed lengths, pool
rows, ...), which of its requests the step records (``take``, ``index``), the verify calls' pending records and the
hooks' own time by part (:func:`timed_part`). :func:`device_index` and :func:`on_device` put host values on the device
without a stream synchronisation; :func:`rows_of` and :func:`host_lens` are the recorded requests' rows of a batch
tensor and their committed lengths on the device. No SGLang import.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from refcheck.sglang.capture import profiling


@dataclass
class Batch:
    """What the scheduler's batch looked like before it ran, and which of its requests this step records."""

    mode: str  # "extend", "decode" or "other"
    speculative: bool
    rids: list[str]
    # the rest is read only for a batch that records (the hooks' snapshot)
    committed: list[int] = field(default_factory=list)  # decode: tokens with KV before the step (the root's position)
    roots: list[int] = field(default_factory=list)  # decode
    prompt_lens: list[int] = field(default_factory=list)  # prefill
    #: prefill: the taken rows whose prompt this chunk finishes for the first time (a long prompt's middle chunks do
    #: not; a request retracted and prefilled again, its output already begun, is not at its first token)
    done: list[int] = field(default_factory=list)
    pool_rows: torch.Tensor | None = None  # decode: [bs] the requests' rows of req_to_token, on the device
    topk: int | None = None  # decode
    take: list[int] = field(default_factory=list)  # batch rows recorded at this step
    steps: list[int] = field(default_factory=list)  # their step numbers
    index: torch.Tensor | None = None  # ``take`` on the device (None: every row)
    pending: list[dict[str, Any]] = field(default_factory=list)  # the verify calls' records, tensors on the device
    events: tuple[Any, Any] | None = None  # CUDA events around the scheduler's step
    #: the hooks' own time on the scheduler's thread at this step by part (the ledger's PARTS), in seconds
    parts: dict[str, float] = field(default_factory=dict)
    after_t0: float = 0.0  # when recording the finished batch began
    raw_logits: torch.Tensor | None = None  # [bs, V] before a sampling batch's sampler overwrote them
    #: the tree sampler's coins [bs, N], bonus coins [bs] and (threshold_single, threshold_acc) of this batch's verify
    coins: tuple[torch.Tensor, torch.Tensor, tuple[float, float]] | None = None
    # target-only decode, from the forward batch on the device: [bs] input ids (the roots) and seq lens (with the
    # root): right even under the overlap scheduler, whose per-request lists lag one step behind
    decode_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    #: per recorded request: the piece of its context its record carries, and its sampling parameters at its first
    #: record (:meth:`~refcheck.sglang.capture.step_clock.StepClock.context`)
    contexts: list[list[Any]] = field(default_factory=list)
    params: list[dict[str, Any] | None] = field(default_factory=list)

    def rows(self, t: torch.Tensor, per: int = 1) -> torch.Tensor:
        """The recorded requests' rows of a batch tensor [bs*per, ...] (or [bs, ...] with per=1)."""
        if self.index is None:
            return t
        bs = len(self.rids)
        shaped = t.reshape(bs, per, *t.shape[1:]) if per > 1 else t  # [bs*per, ...] -> [bs, per, ...]
        sel = shaped[self.index.to(t.device)]
        return sel.reshape(-1, *t.shape[1:]) if per > 1 else sel

    @property
    def host_s(self) -> float:
        """The hooks' time at this step before the batch is recorded (the snapshot, the verify calls, the taps)."""
        return sum(self.parts.get(k, 0.0) for k in ("snapshot", "verify", "taps"))

    def host(self, values: list[Any]) -> list[Any]:
        return [values[i] for i in self.take]


@contextmanager
def timed_part(snap: Batch, name: str, label: str | None = None) -> Iterator[None]:
    """One part of the hooks' work at this step: its wall time into ``snap.parts[name]`` (the cost ledger's
    ``{name}_ns``), and labelled ``refcheck.{label or name}`` in an open profiler window."""
    t0 = time.perf_counter()
    try:
        with profiling.section(label or name):
            yield
    finally:
        snap.parts[name] = snap.parts.get(name, 0.0) + time.perf_counter() - t0


def device_index(rows: list[int], device: Any) -> torch.Tensor:
    """A host index list on ``device`` without a stream synchronisation (pinned source, asynchronous copy)."""
    t = torch.tensor(rows, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def on_device(t: Any, device: Any, ready: Any = None) -> torch.Tensor:
    """A batch output (a tensor on either side, or a list) on ``device``, without a host synchronisation.

    ``ready``: the event after which a host tensor holds its values, when a copy still in flight fills it (SGLang's
    overlap scheduler copies a batch's results into pinned host memory on a stream of its own, ``copy_done`` marking
    the end, after ``run_batch`` has returned): the current stream waits for it on the device, and the pinned tensor
    is copied from there, never read by the host before the copy has landed."""
    t = torch.as_tensor(t)
    if t.device == torch.device(device) or torch.device(device).type != "cuda":
        return t.to(device)
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)
    if t.is_pinned():  # read by the device copy, in stream order: after ``ready``
        return t.to(device, non_blocking=True)
    return t.pin_memory().to(device, non_blocking=True)  # a host tensor: pinned first, so the copy is asynchronous


def rows_of(snap: Batch, t: torch.Tensor | None, per: int = 1) -> torch.Tensor | None:
    return None if t is None else snap.rows(t.detach(), per).clone()


def host_lens(snap: Batch, device: Any) -> torch.Tensor:
    """The scheduler's committed lengths of the recorded requests, on ``device`` (no device lengths to use)."""
    return device_index(snap.host(snap.committed), device)
