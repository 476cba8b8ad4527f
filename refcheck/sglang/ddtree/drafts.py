"""The DFlash drafter inside SGLang: refcheck's drafter over SGLang's embedding and LM head.

Contract: :class:`TargetView` gives :class:`~ddtree_reference.drafter.DFlashDrafter` the few target
attributes it reads (hidden and vocabulary sizes, layer count, device, dtype, the token embedding
and the LM head) from SGLang's loaded target model, without a second copy of the weights
(tensor parallelism 1: the embedding and head must be whole). :class:`DrafterPool` keeps one drafter
context (its KV over target hidden states) per request id and swaps it in around each call; a
request's context is dropped when it leaves the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import torch
import torch.nn.functional as F


class TargetView:
    def __init__(self, embed_weight: torch.Tensor, head_weight: torch.Tensor, vocab_size: int, num_layers: int) -> None:
        if embed_weight.shape[0] < vocab_size or head_weight.shape[0] < vocab_size:
            raise ValueError(f"embedding {tuple(embed_weight.shape)} / head {tuple(head_weight.shape)} do not cover the "
                             f"vocabulary of {vocab_size} (a tensor-parallel shard?)")
        self.hidden_size = int(embed_weight.shape[1])
        self.vocab_size = int(vocab_size)
        self.layers = range(num_layers)  # only its length is read
        head = head_weight[:vocab_size]  # [V, H]: padded vocabulary rows dropped
        self.body = SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed_weight[:vocab_size]))
        self.model = SimpleNamespace(lm_head=lambda h: F.linear(h, head))  # [n, H] -> [n, V]
        self.device, self.dtype = embed_weight.device, embed_weight.dtype

    @classmethod
    def from_sglang(cls, model, vocab_size: int, num_layers: int) -> TargetView:
        return cls(model.model.embed_tokens.weight, model.lm_head.weight, vocab_size, num_layers)


class DrafterPool:
    """One drafter, many request contexts."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.contexts: dict[str, tuple] = {}
        #: requests whose context misses a prefix the engine's prefix cache served (its target hidden states were never
        #: computed, so never fed): their drafts are the engine's own, not the reference drafter's
        self.partial: set[str] = set()

    def admit(self, rid: str, prefix: int) -> None:
        """A prefill chunk of ``rid`` after ``prefix`` context tokens the engine already holds: a request new to the
        pool (or prefilled from scratch) starts a fresh context, partial when the prefix came from the prefix cache."""
        if prefix == 0 or rid not in self.contexts:
            self.contexts.pop(rid, None)
            if prefix > 0:
                self.partial.add(rid)
            else:
                self.partial.discard(rid)

    @contextlib.contextmanager
    def context(self, rid: str) -> Iterator[object]:
        d = self.drafter
        if rid in self.contexts:
            d.ctx_keys, d.ctx_values, d.ctx_len = self.contexts[rid]
        else:
            d.reset()
        try:
            yield d
        finally:
            self.contexts[rid] = (list(d.ctx_keys), list(d.ctx_values), d.ctx_len)

    def drop(self, rids) -> None:
        for rid in rids:
            self.contexts.pop(rid, None)
            self.partial.discard(rid)

    def clear(self) -> None:
        self.contexts.clear()
        self.partial.clear()


def draft_tree(pool: DrafterPool, rid: str, root: int, start: int, budget: int | None,
               depth: int | None = None, temperature: float | None = None,
               depth_shift: bool = False) -> tuple[list[int], list[int], torch.Tensor]:
    """One request's tree below ``root`` (at position ``start``): (tokens, parents, draft log-probs [L, V] float32
    on the host), root first. ``budget`` None: the chain (the top-1 token per depth). ``depth``: draft depths
    (default the block's); the reference decoder, like z-lab's dflash, drafts only as deep as the tokens still to
    generate, so its last block is shorter. ``temperature`` (a sampled request): the tree is built from the draft
    at that temperature, as the reference builds it. ``depth_shift`` (an injected fault): depth d's tokens are
    taken from the draft's row for depth d + 1 (the last depth keeps its own)."""
    from ddtree_reference.tree import build_chain, build_ddtree

    with pool.context(rid) as drafter:
        logp = drafter.propose(root, start, depth).cpu()  # [L, V] float32
    tree_lp = logp
    if temperature is not None and logp.numel():  # log_softmax(lp / T) = log_softmax(logits / T)
        tree_lp = torch.log_softmax(logp / temperature, dim=-1)
    if depth_shift and tree_lp.shape[0] > 1:
        tree_lp = torch.cat([tree_lp[1:], tree_lp[-1:]])  # [L, V]: row d holds depth d + 2's draft
    tree = build_chain(root, tree_lp) if budget is None else build_ddtree(root, tree_lp, budget)
    return tree.tokens.tolist(), tree.parents.tolist(), logp


def extend_context(pool: DrafterPool, rid: str, hidden: torch.Tensor, start: int) -> None:
    """Append target hidden states [n, n_ids*H] of consecutive positions from ``start``."""
    with pool.context(rid) as drafter:
        drafter.extend(hidden, torch.arange(start, start + int(hidden.shape[0]), device=hidden.device))
