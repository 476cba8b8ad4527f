"""What a verify step records of itself: the tree verify's (``eagle_sample``) and the DFLASH chain's parts.

Contract: :func:`tree_inputs` (before ``eagle_sample`` runs: it adds penalties to the logits in place) and
:func:`tree_part` (after) reduce a tree verify to its record: the tree, every node's log-probs summarised on the
device, the accept outputs and the sampler's coins; :func:`chain_part` does the same for a DFLASH decode step, with
the drafter's side from its taps. The committed state is added when the batch is recorded
(:mod:`refcheck.sglang.capture.committed`). No SGLang import.
"""

from __future__ import annotations

from typing import Any

import torch

from refcheck.sglang.capture.batch import Batch, host_lens, on_device, rows_of
from refcheck.sglang.capture.dflash_taps import DFlashTaps
from refcheck.sglang.capture.graphs import GraphCache
from refcheck.sglang.capture.graphs import run as graphs_run
from refcheck.sglang.capture.packing import Packed, prepack
from refcheck.sglang.capture.steps import node_logprobs, pick, summarise_nodes


def call_arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    """A hooked call's argument ``i``, passed by position or as ``name``."""
    return args[i] if len(args) > i else kwargs[name]


def tree_inputs(snap: Batch, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    verify_input, batch, logits_output = (call_arg(args, kwargs, 0, "verify_input"), call_arg(args, kwargs, 1, "batch"),
                                          call_arg(args, kwargs, 2, "logits_output"))
    if batch.forward_mode.is_idle():
        return None
    tokens = verify_input.draft_token
    n = int(tokens.shape[0]) // len(snap.rids)
    # before the original runs: eagle_sample adds penalties and logit bias to the logits in place
    logits = snap.rows(logits_output.next_token_logits.detach(), n)  # [b*N, V]
    logp = node_logprobs(logits)
    lens = getattr(batch, "seq_lens", None)  # tokens with KV before the step (the roots' positions), on the device
    return {"n": n, "logp": logp, "nodes": summarise_nodes(logits, None, logp=logp),
            "tokens": rows_of(snap, tokens, n), "nt": rows_of(snap, getattr(verify_input, "retrieve_next_token", None)),
            "ns": rows_of(snap, getattr(verify_input, "retrieve_next_sibling", None)),
            "pos": rows_of(snap, getattr(verify_input, "positions", None), n),
            "seq_lens": rows_of(snap, lens) if isinstance(lens, torch.Tensor) and len(lens) == len(snap.rids) else None}


def tree_part(snap: Batch, pre: dict[str, Any], result: tuple) -> dict[str, Any]:
    predict, accept_lens, accept_index = result[:3]
    draws, uniforms = result[3:5] if len(result) >= 5 else (None, None)  # the keyed sampler's
    n, residuals = pre["n"], None
    coins, snap.coins = snap.coins, None
    if coins is not None and uniforms is None:  # SGLang's tree sampler ran inside this eagle_sample
        uniforms, residuals = coins[0].reshape(-1), coins[1]  # [bs, N] -> [bs*N]
    pred = snap.rows(predict.detach(), n)
    nodes = pre["nodes"]
    nodes.picked = pick(pre["logp"], pred)
    t = {"tokens": pre["tokens"], "nt": pre["nt"], "ns": pre["ns"], "pos": pre["pos"], "nodes": nodes.tensors(),
         "accept_index": rows_of(snap, accept_index), "accept_lens": rows_of(snap, accept_lens), "predict": pred,
         "draws": rows_of(snap, draws, n), "uniforms": rows_of(snap, uniforms, n), "residuals": rows_of(snap, residuals)}
    committed = pre["seq_lens"]
    if committed is None:
        committed = host_lens(snap, pred.device)
    meta: dict[str, Any] = {"layout_in_engine": "tree" if (snap.topk or 0) > 1 else "chain"}
    if coins is not None:
        meta["accept_thresholds"] = list(coins[2])
    return {"layout": "tree", "t": t, "committed": committed, "width": n, "meta": meta}


def taken_rows(snap: Batch, part: Packed | dict[str, torch.Tensor] | None) -> Any:
    """A drafter tap's nest (its graph's :class:`~refcheck.sglang.capture.packing.Packed`) for the recorded
    requests: as it is when the step records every request, else each tensor's rows of those requests (a scalar as
    it is)."""
    if part is None or snap.index is None:
        return part
    nest = part.unpacked() if isinstance(part, Packed) else part
    return {k: (v if v.dim() == 0 else snap.rows(v)) for k, v in nest.items()}


def chain_part(worker: Any, snap: Batch, result: Any, taps: DFlashTaps, graphs: GraphCache | None) -> dict[str, Any]:
    """A DFLASH decode step's chain record (``graphs``: its node reductions replayed from there, the batch's first
    verify call only: a cache replays one graph per batch)."""
    bs = len(snap.rids)
    logits = result.logits_output.next_token_logits
    if logits is None:
        raise RuntimeError("DFLASH verify result carries no logits (skipped for TP > 1 greedy in newer SGLang)")
    cand = worker._draft_block_tokens_buf[:bs]  # [bs, B]: column 0 the root, then the drafts
    block = int(cand.shape[1])
    outs = snap.rows(on_device(result.next_token_ids, logits.device).reshape(bs, -1))  # [b, B]
    rows = snap.rows(logits.detach(), block)  # [b*B, V]
    flat = outs.reshape(-1)  # [b, B] -> [b*B]
    graphs = graphs if not snap.pending else None  # one replay of the cache per batch
    key = ("chain", tuple(rows.shape), rows.dtype, tuple(flat.shape), flat.dtype)
    nodes = graphs_run(graphs, key, lambda lg, o: prepack(summarise_nodes(lg, o).tensors()), rows, flat)
    new_lens = getattr(result, "new_seq_lens", None)
    committed = (snap.rows(new_lens) - snap.rows(result.accept_lens) if isinstance(new_lens, torch.Tensor)
                 else host_lens(snap, logits.device))  # after the step minus what it appended
    t = {"cand": snap.rows(cand).clone(), "nodes": nodes, "accept_lens": rows_of(snap, result.accept_lens),
         "out_tokens": outs.clone()}
    draft, context = taken_rows(snap, taps.draft), taken_rows(snap, taps.context)
    meta: dict[str, Any] = {"layout_in_engine": "chain"}
    if taps.missing:
        meta["draft_not_captured"] = taps.missing
    return {"layout": "chain", "t": t, "committed": committed, "width": block, "meta": meta, "draft": draft,
            "context": context}
