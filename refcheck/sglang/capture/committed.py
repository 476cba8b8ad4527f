"""A recorded batch's committed state after its step: SGLang's pools read in place, sketched on the device.

Contract: :func:`pool_views` resolves the scheduler's KV buffers by layer, its stacked mamba pools and its
req_to_token pool; :func:`committed_state` gathers the recorded requests' KV rows and mamba slots and sketches them
(:func:`refcheck.sglang.capture.state.batch_state`), as one CUDA graph replay per batch where a
:class:`~refcheck.sglang.capture.graphs.GraphCache` is given, from the graph of the batch size's :func:`bucket`
(:func:`bucketed`). No SGLang import: the scheduler is passed in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from refcheck.sglang.capture import versions
from refcheck.sglang.capture.batch import Batch
from refcheck.sglang.capture.graphs import GraphCache
from refcheck.sglang.capture.packing import Packed, prepack
from refcheck.sglang.capture.state import MambaPools, batch_state
from refcheck.sglang.env import ENV_FULL


def pools(scheduler: Any) -> tuple[Any, Any]:
    runner = scheduler.tp_worker.model_runner
    return runner.token_to_kv_pool, runner.req_to_token_pool


def pool_views(scheduler: Any) -> tuple[dict, MambaPools | None, Any]:
    """(kv buffers by layer, the stacked mamba pools or None, req_to_token pool)."""
    kv_pool, rtp = pools(scheduler)
    if hasattr(kv_pool, "full_attention_layer_id_mapping"):
        kv_layers = sorted(kv_pool.full_attention_layer_id_mapping)
    else:
        start = int(getattr(kv_pool, "start_layer", 0) or 0)
        kv_layers = list(range(start, start + int(kv_pool.layer_num)))
    kv = {layer: (kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer)) for layer in kv_layers}
    mamba = None
    if hasattr(rtp, "mamba_map"):
        pool = rtp.mamba_pool
        order = sorted(rtp.mamba_map.items(), key=lambda item: item[1])  # (global layer id, row in the stack)
        mamba = MambaPools([layer for layer, _ in order], [int(i) for _, i in order], pool.mamba_cache.conv[0],
                           pool.mamba_cache.temporal, int(getattr(pool, "conv_window_axis", -1)))
    return kv, mamba, rtp


def bucket(b: int) -> int:
    """The batch size a state graph is captured for: the next power of two (a serving engine's batch size changes
    from step to step; one graph per size would be captured at every new one)."""
    return 1 << max(b - 1, 0).bit_length()


def bucketed(graphs: GraphCache, key: tuple, sketch: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]],
              rows: torch.Tensor, lens: torch.Tensor) -> Packed:
    """:func:`~refcheck.sglang.capture.state.batch_state` of ``b`` requests from the graph of :func:`bucket` (b)
    rows, packed in the graph (:class:`~refcheck.sglang.capture.packing.Packed`): the first request's row repeated
    to fill it. The filler rows stay in the record (request ``i``'s sketches are row ``i`` of every tensor, and
    each reads only its own slots; the reader reads the first ``b``), so the engine's thread cuts nothing."""
    b = int(rows.shape[0])
    pad = bucket(b) - b
    if pad:
        rows = torch.cat([rows, rows[:1].expand(pad)])  # [b] -> [B]
        lens = torch.cat([lens, lens[:1].expand(pad)])
    return graphs.run((bucket(b), *key), lambda r, n: prepack(sketch(r, n)), rows, lens)


def committed_state(scheduler: Any, snap: Batch, committed: torch.Tensor, width: int,
                    graphs: GraphCache | None) -> dict[str, Any]:
    """The recorded requests' committed state after the step, sketched on the device (``state``, ``tp``): one
    graph replay per batch from ``graphs``, the graph of the batch's :func:`bucket` (eagerly without ``graphs``, and
    for the full rows of ``REFCHECK_CAPTURE_FULL``)."""
    kv, mamba, rtp = pool_views(scheduler)
    table = rtp.req_to_token
    tp_rank, tp_size = versions.tp_of(scheduler)
    groups = getattr(getattr(rtp, "mamba_pool", None), "conv_shard_groups", None)
    groups = tuple(groups) if groups else None
    replicas = versions.kv_replicas(scheduler, tp_size)
    shard = (tp_rank, tp_size, groups, replicas) if tp_size > 1 else None
    full = bool(os.environ.get(ENV_FULL))

    def sketch(rows: torch.Tensor, lens: torch.Tensor) -> dict[str, Any]:
        cols = lens[:, None] + torch.arange(width, device=table.device)  # [b, W]
        slots = table[rows[:, None], cols.clamp(max=table.shape[1] - 1)]  # [b, W]: rows past the commit dropped later
        mslots = rtp.req_index_to_mamba_index_mapping[rows] if mamba else None
        return batch_state(kv, slots, mamba, mslots, full, shard)

    rows = snap.rows(snap.pool_rows).to(table.device).long()  # type: ignore[arg-type]
    lens = committed.to(table.device).long()
    # the graph reads the pools at the addresses it was captured with: they are part of its key
    pools = (table.data_ptr(), *(k.data_ptr() for k, _ in kv.values()), mamba.ssm.data_ptr() if mamba else 0)
    graphs = None if full else graphs
    state = sketch(rows, lens) if graphs is None else bucketed(graphs, (width, shard, pools), sketch, rows, lens)
    out: dict[str, Any] = {"state": state}
    if shard is not None:
        out["tp"] = {"tp_rank": tp_rank, "tp_size": tp_size, "conv_groups": list(groups) if groups else None,
                     "kv_replicas": replicas}
    return out
