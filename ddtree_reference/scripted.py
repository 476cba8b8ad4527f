"""A scripted drafter for tests: the target's own greedy continuation, with controlled noise.

Contract: ``propose(bonus, start)`` returns [L, V] float32 log-probs in which, at every depth d,
the target's true greedy token (the continuation of committed tokens + bonus) is ranked first,
unless the step's seeded dice say otherwise:

* with probability ``decoy_prob`` one to ``max_decoys`` random *decoy* tokens are ranked above it
  (so the tree must accept a non-first sibling, and a leaky engine sees a wrong sibling earlier in
  the flattened order — the testing trap in DESIGN §3);
* with probability ``miss_prob`` it is pushed down to rank 3..12 (so acceptance stops early at
  small budgets but deeper trees can still recover it).

The continuation comes from the oracle (a plain forward of the target), so the drafter shares no
state with the decoder. Everything is a deterministic function of (seed, start, bonus).
"""

from __future__ import annotations

import torch

from ddtree_reference.oracle import GreedyMemo, greedy_decode


class ScriptedDrafter:
    target_layer_ids: list[int] = []

    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        mask_token_id: int,
        block_size: int = 16,
        seed: int = 0,
        decoy_prob: float = 0.35,
        max_decoys: int = 2,
        miss_prob: float = 0.08,
        oracle: GreedyMemo | None = None,
    ) -> None:
        self.model = model
        #: where the true continuation comes from: ``greedy_decode`` on ``model``, or a memo of it
        #: (:class:`ddtree_reference.oracle.GreedyMemo` on the same weights; same tokens, fewer forwards)
        self.oracle = oracle
        self.vocab_size = vocab_size
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.seed = seed
        self.decoy_prob = decoy_prob
        self.max_decoys = max_decoys
        self.miss_prob = miss_prob
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.tokens = []

    def extend(self, context: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, bonus: int, start: int, depth: int | None = None) -> torch.Tensor:
        depth = self.block_size - 1 if depth is None else min(depth, self.block_size - 1)
        truth = (self.oracle.decode(self.tokens + [bonus], depth) if self.oracle is not None
                 else greedy_decode(self.model, self.tokens + [bonus], depth))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + start * 7919 + bonus)
        logits = torch.randn(depth, self.vocab_size, generator=gen)  # [L, V] background noise
        for d, tok in enumerate(truth):
            logits[d, tok] = 6.0
            if torch.rand((), generator=gen) < self.miss_prob:
                rank = int(torch.randint(3, 13, (), generator=gen))
                others = torch.randperm(self.vocab_size, generator=gen)
                others = others[others != tok][:rank]
                logits[d, others] = 7.0 + torch.rand(len(others), generator=gen)
            elif torch.rand((), generator=gen) < self.decoy_prob:
                n = int(torch.randint(1, self.max_decoys + 1, (), generator=gen))
                others = torch.randperm(self.vocab_size, generator=gen)
                others = others[others != tok][:n]
                logits[d, others] = 6.5 + torch.rand(len(others), generator=gen)
        return torch.log_softmax(logits, dim=-1)
