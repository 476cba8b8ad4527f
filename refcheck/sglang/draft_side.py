"""The drafter's side of a captured step: its top-k per depth and the context the engine fed it.

Contract: pure torch, no SGLang import; shared by the capture (DFLASH's taps,
:mod:`refcheck.sglang.capture.dflash_taps`) and REFCHECK_DDTREE's worker (:mod:`refcheck.sglang.ddtree.worker`),
which import it and not each other. :func:`draft_side` turns a drafter's output for one request (logits or
log-probs ``[L, V]``, depths 1..L) into its top-k per depth (``k`` = :func:`topk_for`: enough ranks that the
diff can rebuild a DDTree of the budget from the record alone); :func:`context_side` turns the target
features the engine fed its drafter from one verify step (``[A, F]``: the root, then the accepted nodes, in
path order) and their positions into their positions and feature sketch (:func:`refcheck.sketch.sketch_rows`).
Both return plain dicts of lists and CPU tensors, ready for a capture record
(:meth:`refcheck.sglang.capture.steps.StepCapture.attach_draft`).

Inside the engine's step the drafter's scores are reduced on the device instead (:func:`draft_top`: the top
``k + DRAFT_MARGIN`` per depth and how many scores reach the k-th), and :func:`draft_side_of_top` orders them
on the host as the tree builder does. When no more than ``k + DRAFT_MARGIN`` scores reach the k-th value,
every tie at the k-th rank is among the kept ones, so the host's order is the full sort's; a wider tie is
reported as not captured rather than recorded in another order.
"""

from __future__ import annotations

from typing import Any

import torch

from refcheck.sglang.vocab_rows import by_row_chunks
from refcheck.sketch import sketch_rows

#: draft ranks recorded per depth for a chain drafter (as the reference's own traces record)
DRAFT_TOPK = 8


def topk_for(budget: int | None, vocab: int) -> int:
    """Ranks to record per depth: a DDTree of ``budget`` nodes uses ranks below ``min(budget, V)``."""
    return min(max(DRAFT_TOPK, budget or 0), vocab)


def draft_side(scores: torch.Tensor, k: int, logits: bool = True) -> dict[str, Any]:
    """``scores`` [L, V] (logits, or log-probs when ``logits`` is False) -> ids / log-probs of the top ``k`` per
    depth. Log-softmax in float32: the engine's logits may be bf16, and bf16 log-probs would be coarser than the
    engine's own choice of tokens."""
    lp = torch.log_softmax(scores.float(), dim=-1) if logits else scores.float()  # [L, V]
    # the tree builder's order (ddtree_reference.tree): log-prob descending, equal values in ascending token id; torch.topk
    # breaks ties its own way, and a tie at the k-th rank would record another token than the one the tree used
    vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    k = min(k, lp.shape[-1])
    return {"ids": ids[:, :k].cpu().tolist(), "logprobs": vals[:, :k].cpu().tolist()}


#: extra ranks kept on the device so that a tie at the k-th rank is still ordered exactly on the host
DRAFT_MARGIN = 8


def draft_top(scores: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """``scores`` [..., V] logits -> on their device: ``ids`` / ``logprobs`` [..., k + margin] (any order within
    equal values) and ``reach`` [...] (how many log-probs are >= the k-th largest); in row chunks
    (:func:`refcheck.sglang.vocab_rows.by_row_chunks`: each chunk's float32 log-probs bounded in size)."""
    lead, vocab = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(-1, vocab)  # [..., V] -> [R, V]
    got = by_row_chunks(lambda s: _top_rows(s, k), (flat,), flat.shape[0], vocab)
    k2 = got["ids"].shape[-1]
    return {"ids": got["ids"].view(*lead, k2), "logprobs": got["logprobs"].view(*lead, k2),  # [R, K2] -> [..., K2]
            "reach": got["reach"].view(lead), "k": got["k"]}  # [R] -> [...]


def _top_rows(scores: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """:func:`draft_top` of ``[R, V]`` scores."""
    lp = torch.log_softmax(scores.float(), dim=-1)  # float32: see draft_side
    k = min(k, lp.shape[-1])
    top = lp.topk(min(k + DRAFT_MARGIN, lp.shape[-1]), dim=-1)
    reach = (lp >= top.values[..., k - 1: k]).sum(dim=-1)
    # k on the same device as the rest (a fill, not a copy from the host: capturable in a CUDA graph, which packs
    # its outputs into one buffer of one device)
    return {"ids": top.indices, "logprobs": top.values, "reach": reach,
            "k": torch.full((), k, dtype=torch.long, device=lp.device)}


def draft_side_of_top(ids: torch.Tensor, logprobs: torch.Tensor, reach: torch.Tensor, k: int) -> dict[str, Any] | None:
    """One request's :func:`draft_top` rows ([L, K2], [L, K2], [L], host) -> :func:`draft_side`'s dict; None when a
    tie at the k-th rank is wider than the kept ranks."""
    if int(reach.max()) > ids.shape[-1]:
        return None
    out_ids, out_lps = [], []
    for row_ids, row_lps in zip(ids.tolist(), logprobs.tolist()):
        order = sorted(range(len(row_ids)), key=lambda j: (-row_lps[j], row_ids[j]))[:k]
        out_ids.append([row_ids[j] for j in order])
        out_lps.append([row_lps[j] for j in order])
    return {"ids": out_ids, "logprobs": out_lps}


def context_side(hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The context rows fed to the drafter: ``hidden`` [A, F] target features, ``positions`` [A]."""
    return {"positions": [int(p) for p in positions.reshape(-1).tolist()], "sketch": sketch_rows(hidden)}
