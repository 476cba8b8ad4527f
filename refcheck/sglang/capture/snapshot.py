"""A scheduler batch before it runs, as the capture's records need it: which of its requests this step records and
what of them must be read before SGLang changes them.

Contract: :func:`take` returns the batch's mode (a str: "extend", "decode" or "other") when the step records none of
its requests, else a :class:`~refcheck.sglang.capture.batch.Batch`. Which requests a step records: at a prefill or a
decode step, those the sampling rule takes on that kind's clock
(:class:`~refcheck.sglang.capture.step_clock.StepClock`); a prefill records only the requests whose prompt this chunk
finishes for the first time (a long prompt's middle chunks and a retracted request's re-prefill do not). A batch the
rule passes over costs its rids, its step counts and nothing more; one past the byte budget is counted and runs as if
not taken. What a release does not say is a capture error, never a guess (:func:`chunk_end`); decode steps run
inside prefill batches (``--enable-mixed-chunk``) are said once per process. No SGLang import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refcheck.sglang.capture import versions
from refcheck.sglang.capture.batch import Batch, device_index
from refcheck.sglang.capture.records import Recorder
from refcheck.sglang.capture.step_clock import StepClock

_mixed_said = False  # whether this process has said that it runs decode steps inside prefill batches


def take(scheduler: Any, batch: Any, clock: StepClock, recorder: Recorder | None,
         error: Callable[[str, str], None]) -> Batch | str:
    """The batch before it runs (module docstring); ``error(where, message)`` writes an error record."""
    fm = batch.forward_mode
    mode = "extend" if fm.is_extend() else "decode" if fm.is_decode() else "other"
    if mode == "other":
        return mode
    if mode == "extend" and not _mixed_said and getattr(fm, "is_mixed", lambda: False)():
        _say_mixed(error)
    reqs = list(batch.reqs)
    rids = [r.rid for r in reqs]
    steps: list[int] = []
    if mode == "extend":
        taken = clock.take_prefill(rids, reqs)
    else:
        taken, steps = clock.take(rids, reqs)
    if not taken:
        return mode
    if recorder is not None and recorder.budget.spent:  # past the byte budget: counted, then as if not taken
        recorder.shipper.counts.add(over_budget=1)
        return mode
    rows = batch.req_pool_indices
    snap = Batch(mode=mode, speculative=not batch.spec_algorithm.is_none(), rids=rids, take=taken, steps=steps)
    if mode == "decode" and len(taken) < len(rids):
        snap.index = device_index(taken, rows.device if isinstance(rows, torch.Tensor) else "cpu")
    if mode == "extend":  # what a prefill record needs: whose prompt this chunk finishes
        snap.prompt_lens = [len(r.origin_input_ids) for r in reqs]
        snap.done = [i for i in taken if not reqs[i].output_ids and chunk_end(reqs[i]) >= snap.prompt_lens[i]]
        if not snap.done:  # middle chunks and re-prefills only: nothing to record, the batch runs plain
            return mode
        carry(snap, clock, reqs, snap.done)
        return snap
    carry(snap, clock, reqs, taken)
    snap.committed = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in reqs]
    snap.roots = [int(r.output_ids[-1]) if r.output_ids else -1 for r in reqs]
    snap.pool_rows = rows.detach().clone() if isinstance(rows, torch.Tensor) else None
    snap.topk = versions.server_topk(scheduler)
    return snap


def _say_mixed(error: Callable[[str, str], None]) -> None:
    """``--enable-mixed-chunk`` (target-only decoding): SGLang runs running requests' decode steps inside prefill
    batches (``ForwardMode.MIXED``), which the capture does not record; said once, as a capture error, so the run's
    missing steps are never silent."""
    global _mixed_said
    _mixed_said = True
    error("run_batch:mixed", "SGLang runs decode steps inside prefill batches (--enable-mixed-chunk): the capture "
          "records none of them; run without --enable-mixed-chunk to have every step judged")


def chunk_end(req: Any) -> int:
    """Where this prefill chunk of ``req`` ends (:func:`versions.prefill_end`); a release that does not say is a
    capture error (the batch then records nothing), never a guess that could take a middle chunk's token for the
    request's first."""
    end = versions.prefill_end(req)
    if end is None:
        raise AttributeError("this SGLang release's requests carry neither extend_range nor fill_ids: a prefill chunk's "
                             "end cannot be read, so no first token is recorded")
    return end


def carry(snap: Batch, clock: StepClock, reqs: list[Any], rows: list[int]) -> None:
    """The pieces of their contexts (and first parameters) the records of ``rows`` carry, in that order."""
    for b in rows:
        piece, params = clock.context(snap.rids[b], reqs[b])
        snap.contexts.append(piece)
        snap.params.append(params)
