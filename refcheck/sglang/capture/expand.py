"""Batch records, as the engine shipped them, -> per-request step and prefill records (host only, at read time).

Contract: inside SGLang the plugin ships one record per verify call (or target-only decode, or prefill) for the
requests of the batch it records, holding the batch's reduced tensors (:mod:`refcheck.sglang.capture.steps`'
node summary, the accept outputs, the committed state sketched on the device, layer sketches, the drafter's
top ranks and context). :func:`expand_batch` and :func:`expand_prefill` turn such a record into the
:class:`~refcheck.sglang.capture.steps.StepCapture` / ``PrefillCapture`` records the assembly reads, doing the
per-request, per-node Python work here, in refcheck's process, rather than in the engine's step.

A batch record's fields: ``layout`` (tree / chain / root), ``rids``, ``origin`` (each request's row in SGLang's
batch), ``steps`` (each request's step number in the engine, counted by the plugin), ``committed_host`` (the
scheduler's committed lengths), ``contexts`` and ``params`` (per request, :mod:`refcheck.sglang.capture.contexts`), ``meta``, ``sides`` (REFCHECK_DDTREE's drafter sides by rid, or None),
``step_s``; tensors ``t`` (per layout, below), ``state`` (:func:`~refcheck.sglang.capture.state.batch_state`),
``tp``, ``layers`` ``[layers, b*N, r]``, ``draft`` / ``context`` (:mod:`refcheck.sglang.capture.dflash_taps`).
"""

from __future__ import annotations

import math
from typing import Any

from refcheck.sglang.capture.state import request_state
from refcheck.sglang.capture.steps import (
    NodeSummary,
    PrefillCapture,
    StepCapture,
    chain_steps,
    prefill_records,
    root_steps,
    tree_steps,
)
from refcheck.sglang.draft_side import draft_side_of_top


def _lags(requests: list[int], used: list[int]) -> int:
    """How many steps' tokens the scheduler's request lists were behind the device (0 without overlap)."""
    return max((abs(a - b) for a, b in zip(requests, used)), default=0)


def _committed(rec: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """Committed lengths: the forward batch's (device) where the record has them, else the scheduler's."""
    host, t = list(rec["committed_host"]), rec["t"]
    device = t.get("committed")
    if device is None or len(device) != len(host):
        return host, {"committed_from": "requests"}
    used = [int(n) for n in device.tolist()]
    return used, {"committed_from": "forward_batch", "committed_lag": _lags(host, used)}


def _layout_steps(rec: dict[str, Any], committed: list[int], meta: dict[str, Any]) -> list[StepCapture]:
    t, rids, nodes = rec["t"], rec["rids"], NodeSummary.of(rec["t"]["nodes"])
    if rec["layout"] == "tree":
        return tree_steps(t["tokens"], t.get("nt"), t.get("ns"), nodes, t["accept_index"], t["accept_lens"], t["predict"],
                          rids, committed, positions=t.get("pos"), meta=meta, draws=t.get("draws"),
                          uniforms=t.get("uniforms"), residuals=t.get("residuals"), origin=rec["origin"])
    if rec["layout"] == "chain":
        return chain_steps(t["cand"], nodes, t["accept_lens"], t["out_tokens"], rids, committed, meta=meta)
    roots = t["roots"].tolist() if t.get("roots") is not None else rec["roots_host"]
    return root_steps([int(r) for r in roots], nodes, t["next_ids"], rids, committed, meta=meta)


def _draft_sides(rec: dict[str, Any], b: int, missing: list[str]) -> dict[str, Any]:
    side: dict[str, Any] = {}
    draft, ctx = rec.get("draft"), rec.get("context")
    if draft is not None:
        got = draft_side_of_top(draft["ids"][b], draft["logprobs"][b], draft["reach"][b], int(draft["k"]))
        if got is None:
            missing.append("a tie at the last recorded draft rank is wider than the ranks the capture keeps")
        else:
            side.update(got)
    if ctx is not None:
        n = int(ctx["lens"][b])
        side.update(positions=[int(p) for p in ctx["positions"][b, :n].tolist()], sketch=ctx["sketch"][b, :n].clone())
    return side


def _attach(rec: dict[str, Any], b: int, s: StepCapture) -> None:
    """Request ``b``'s state, layer sketches, drafter side and step metadata."""
    if rec.get("state"):
        s.state = request_state(rec["state"], b, len(s.accepted))
    if rec.get("tp"):
        s.meta.update(rec["tp"])
    layers = rec.get("layers")
    if layers is not None:
        n = len(s.tokens)
        s.layer_sketch = layers[:, b * n:(b + 1) * n].clone()  # [layers, N, r]
    missing: list[str] = []
    sides = rec.get("sides")
    s.attach_draft(sides.get(s.rid) if isinstance(sides, dict) else _draft_sides(rec, b, missing))
    reason = rec["meta"].get("draft_not_captured") or (missing[0] if missing else None)
    if reason:
        s.meta["draft_not_captured"] = reason
    s.meta["step_index"] = int(rec["steps"][b])
    s.meta["batch_step_s"] = float(rec.get("step_s", math.nan))
    s.context, s.params = _context_of(rec, b)


def _context_of(rec: dict[str, Any], b: int) -> tuple[list[Any] | None, dict[str, Any] | None]:
    """Request ``b``'s piece of its context and its first parameters (None where the record carries none)."""
    contexts, params = rec.get("contexts") or [], rec.get("params") or []
    return (contexts[b] if b < len(contexts) else None), (params[b] if b < len(params) else None)


def expand_batch(rec: dict[str, Any]) -> list[StepCapture]:
    """One shipped batch record -> its requests' step records, in batch order."""
    committed, from_meta = _committed(rec)
    meta = {k: v for k, v in rec["meta"].items() if k != "draft_not_captured"}
    steps = _layout_steps(rec, committed, {**meta, **from_meta})
    for b, s in enumerate(steps):
        _attach(rec, b, s)
    return steps


def expand_prefill(rec: dict[str, Any]) -> list[PrefillCapture]:
    """One shipped prefill record -> a first-token record per request that finished its prefill."""
    t = rec["t"]
    out = prefill_records(NodeSummary.of(t["nodes"]), t["next_ids"], rec["rids"], rec["prompt_lens"], rec.get("uniforms"))
    for b, p in enumerate(out):
        p.context, p.params = _context_of(rec, b)
    return out
