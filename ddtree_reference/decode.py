"""The reference DDTree decoder: draft -> tree -> verify -> walk -> commit, one step per screen.

Contract: :meth:`DDTreeDecoder.generate` decodes one prompt greedily and returns every verify
step as a :class:`StepRecord`. With any drafter its output equals target-only greedy decoding
(the lossless invariant); the drafter only changes how many tokens each step emits.

Conventions (these are what traces and diffs compare):

* the root of every tree is the bonus token of the previous step, at position ``committed_len``;
* ``accept_length`` (τ) = root + accepted drafted nodes = drafted tokens accepted + 1, i.e. the
  bonus is counted (max = block size); ``emitted`` = the tokens this step appended to the output
  (accepted drafts, then the new bonus), cut at a stop token or ``max_new_tokens``;
* ``budget=None`` is chain mode (top-1 per depth: vanilla DFlash);
* the draft depth of a step is ``min(block_size - 1, max_new_tokens - len(output))``, as in
  z-lab's ``dflash_generate``, so per-step numbers are comparable with it;
* tokens equal to the drafter's ``mask_token_id`` are ordinary output tokens and are kept.

Sampling (``DecodeConfig.sampling`` with temperature T > 0, :mod:`ddtree_reference.sampling`): every
node draws one token from the target's tempered (top-k, top-p) distribution with its keyed
uniform; the walk follows the child whose token equals the node's draw; the bonus is the draw at
the last accepted node; the first token after the prefill is a draw too. The tree is built from
the drafter's log-probs tempered by the same T (losslessness does not depend on the draft). With
the default "position" keying the output equals :func:`ddtree_reference.oracle.sample_decode` token for
token. ``sampling=None`` or T = 0 is the greedy decoder, unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ddtree_reference.drafter import Drafter
from ddtree_reference.errors import BudgetError, PromptError
from ddtree_reference.sampling import Sampling, inverse_cdf, node_uniforms, tempered_probs
from ddtree_reference.state import TargetState, TreeForward
from ddtree_reference.target import Target
from ddtree_reference.tree import Tree, build_chain, build_ddtree


@dataclass(slots=True)
class DecodeConfig:
    budget: int | None = 15  # None = chain mode
    max_new_tokens: int = 64
    stop_token_ids: frozenset[int] = frozenset()
    topk: int = 5  # per-node target top-k kept in each StepRecord
    keep_states: bool = False  # keep the committed TargetState and draft log-probs after every step
    keep_layers: bool = False  # keep every layer's output at every node (for layer bisection)
    sampling: Sampling | None = None  # None or temperature 0 = greedy

    @property
    def sampled(self) -> bool:
        return self.sampling is not None and not self.sampling.greedy

    def validate(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise BudgetError(f"budget must be >= 0 (or chain mode), got {self.budget}")
        if self.max_new_tokens < 1:
            raise BudgetError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(slots=True)
class StepRecord:
    step: int
    committed_len: int  # committed tokens before the step = the root's position
    tree: Tree
    target_argmax: torch.Tensor  # [N] int64
    topk_ids: torch.Tensor  # [N, k] int64, target's top-k at every node
    topk_logprobs: torch.Tensor  # [N, k] float32
    accepted: list[int]  # node indices, root first
    accept_length: int  # τ: accepted drafted tokens + 1 (the bonus is counted) = len(accepted)
    bonus: int
    emitted: list[int]  # accepted drafted tokens then the bonus (cut at stop / max_new_tokens)
    emitted_logprobs: list[float]  # target log-prob of each emitted token at its parent node
    timings: dict[str, float] = field(default_factory=dict)  # seconds: draft, tree, verify, commit
    state: TargetState | None = None  # committed state after the step (keep_states only)
    draft_logprobs: torch.Tensor | None = None  # [L, V] float32 drafter log-probs (keep_states only)
    layer_outputs: torch.Tensor | None = None  # [layers, N, H] per-layer node outputs (keep_layers only)
    draws: torch.Tensor | None = None  # [N] int64: the token drawn at every node (sampling only)
    uniforms: torch.Tensor | None = None  # [N] float64: the uniform each draw used (sampling only)


@dataclass(slots=True)
class DecodeResult:
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    steps: list[StepRecord]
    prefill_state: TargetState | None = None
    first_uniform: float | None = None  # the uniform of the prefill's draw (sampling only)
    request: int = 0  # the request key of the sampling generator

    @property
    def accept_lengths(self) -> list[int]:
        return [s.accept_length for s in self.steps]

    @property
    def mean_tau(self) -> float:
        return sum(self.accept_lengths) / max(len(self.steps), 1)


@dataclass(slots=True)
class _Acceptance:
    """What one step's walk decided."""

    accepted: list[int]  # node indices, root first
    source: int  # the node whose prediction is the bonus
    bonus: int
    draws: torch.Tensor | None = None  # [N] int64 (sampling only)
    uniforms: torch.Tensor | None = None  # [N] float64 (sampling only)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DDTreeDecoder:
    def __init__(self, target: Target, drafter: Drafter, config: DecodeConfig) -> None:
        config.validate()
        self.target, self.drafter, self.cfg = target, drafter, config

    def generate(self, prompt_ids: list[int], request: int = 0) -> DecodeResult:
        """Decode one prompt; ``request`` keys the sampling generator (unused when greedy)."""
        cfg = self.cfg
        self._check_prompt(prompt_ids)
        state, bonus, bonus_lp, first_u = self._prefill(prompt_ids, request)
        out, out_lp = [bonus], [bonus_lp]
        result = DecodeResult(list(prompt_ids), out, out_lp, [], state if cfg.keep_states else None, first_u, request)
        while len(out) < cfg.max_new_tokens and bonus not in cfg.stop_token_ids:
            record, emitted, state = self._step(state, bonus, request, len(result.steps), cfg.max_new_tokens - len(out))
            bonus = record.bonus
            out.extend(record.emitted)
            out_lp.extend(record.emitted_logprobs)
            result.steps.append(record)
            if any(t in cfg.stop_token_ids for t in emitted):
                break
        return result

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptError("empty prompt")
        if len(prompt_ids) + self.cfg.max_new_tokens > self.target.max_positions:
            raise PromptError(
                f"prompt of {len(prompt_ids)} tokens + {self.cfg.max_new_tokens} new tokens exceeds the target's "
                f"context of {self.target.max_positions}"
            )

    def _prefill(self, prompt_ids: list[int], request: int) -> tuple[TargetState, int, float, float | None]:
        """Prefill the target and the drafter's context; returns the state, the first token (the first
        step's root), its log-prob and, when sampling, the uniform it was drawn with."""
        target, drafter, dev = self.target, self.drafter, self.target.device
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        state, fwd = target.prefill(prompt, capture=tuple(drafter.target_layer_ids))
        drafter.reset()
        drafter.extend(fwd.context, torch.arange(len(prompt_ids), device=dev), prompt)
        logp = torch.log_softmax(fwd.logits[-1], dim=-1)
        first_u = None
        if self.cfg.sampled:
            u0 = self.node_uniforms(request, -1, [len(prompt_ids)])
            bonus = int(self.draw(self.sample_probs(fwd.logits[-1:]), u0)[0])
            first_u = float(u0[0])
        else:
            bonus = int(logp.argmax())
        return state, bonus, float(logp[bonus]), first_u

    def _step(self, state: TargetState, bonus: int, request: int, step: int,
              room: int) -> tuple[StepRecord, list[int], TargetState]:
        """One verify step below root ``bonus`` with ``room`` tokens left to emit: draft -> tree -> verify ->
        walk -> commit. Returns its record, the tokens it emitted (before the engine reports them: they decide
        the stop) and the committed state."""
        cfg, dev = self.cfg, self.target.device
        t0 = _clock(dev)
        draft_lp, tree_lp = self._draft(bonus, state.length, min(self.drafter.block_size - 1, room))
        t1 = _clock(dev)
        tree = build_chain(bonus, tree_lp) if cfg.budget is None else build_ddtree(bonus, tree_lp, cfg.budget)
        t2 = _clock(dev)
        fwd = self.verify(state, tree, tuple(self.drafter.target_layer_ids))
        logp = torch.log_softmax(fwd.logits, dim=-1)  # [N, V]
        argmax = logp.argmax(dim=-1)
        t3 = _clock(dev)
        acc = self._accept(tree, fwd.logits, argmax, tree_lp, request, step, state.length)
        prev_len = state.length
        state = self.commit(state, fwd, acc.accepted)
        self._extend_draft_context(fwd, tree, acc.accepted, prev_len)
        t4 = _clock(dev)
        emitted, lps = self._emitted(tree, logp, acc, room)
        timings = {"draft": t1 - t0, "tree": t2 - t1, "verify": t3 - t2, "commit": t4 - t3}
        record = self._record(step, prev_len, tree, logp, argmax, acc, emitted, lps, timings)
        if cfg.keep_states:
            record.state, record.draft_logprobs = state, draft_lp.cpu()
        if cfg.keep_layers:
            record.layer_outputs = torch.stack(fwd.layer_outputs).cpu()
        return record, emitted, state

    def _draft(self, bonus: int, committed_len: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's log-probs [L, V] fp32 for ``depth`` positions below ``bonus``, and what the tree is
        built from: the same, or when sampling the draft at the target's temperature."""
        if self.cfg.budget == 0:  # root-only trees: one token per step, nothing to draft
            draft_lp = torch.empty(0, self.target.vocab_size)
        else:
            draft_lp = self.drafter.propose(bonus, committed_len, depth)  # [L, V] fp32
        tree_lp = draft_lp
        if self.cfg.sampled and draft_lp.numel():  # log_softmax(lp / T) = log_softmax(logits / T)
            tree_lp = torch.log_softmax(draft_lp / self.cfg.sampling.temperature, dim=-1)
        return draft_lp, tree_lp

    def _accept(self, tree: Tree, logits: torch.Tensor, argmax: torch.Tensor, tree_lp: torch.Tensor, request: int,
                step: int, committed_len: int) -> _Acceptance:
        """The walk and the bonus: follow the target's argmax, or when sampling each node's draw."""
        if not self.cfg.sampled:
            accepted = self.walk(tree, argmax.cpu())
            source = self.bonus_node(accepted)
            return _Acceptance(accepted, source, int(argmax[source]))
        probs = self.sample_probs(logits)  # [N, V] float64
        uniforms = self.node_uniforms(request, step, (committed_len + 1 + tree.depths).tolist())
        draws = self.draw(probs, uniforms)  # [N] int64
        accepted = self.sample_walk(tree, draws, uniforms, tree_lp)
        source = self.bonus_node(accepted)
        bonus = self.bonus_token(logits, probs, draws, uniforms, source)
        return _Acceptance(accepted, source, bonus, draws, uniforms)

    def _extend_draft_context(self, fwd: TreeForward, tree: Tree, accepted: list[int], prev_len: int) -> None:
        """Append the context nodes' target hidden states to the drafter's context, at their positions."""
        dev = self.target.device
        ctx = torch.tensor(self.context_nodes(tree, accepted), dtype=torch.long, device=dev)
        self.drafter.extend(fwd.context[ctx], prev_len + tree.depths.to(dev)[ctx], tree.tokens.to(dev)[ctx])

    def _emitted(self, tree: Tree, logp: torch.Tensor, acc: _Acceptance,
                 room: int) -> tuple[list[int], list[float]]:
        """The accepted drafted tokens then the bonus, with the target log-prob of each at its parent, cut."""
        emitted = [int(tree.tokens[i]) for i in acc.accepted[1:]] + [acc.bonus]
        lps = [float(logp[p, tok]) for p, tok in zip(acc.accepted[:-1] + [acc.source], emitted)]
        return self._cut(emitted, lps, room)

    def _record(self, step: int, committed_len: int, tree: Tree, logp: torch.Tensor, argmax: torch.Tensor,
                acc: _Acceptance, emitted: list[int], lps: list[float], timings: dict[str, float]) -> StepRecord:
        """The step as the engine reports it (what it returns, its top-k and its τ)."""
        shown, shown_lps = self.report_emitted(emitted, lps)
        top = logp.topk(min(self.cfg.topk, logp.shape[-1]), dim=-1)
        topk_ids, topk_lps = self.report_topk(top.indices.cpu(), top.values.cpu())
        return StepRecord(
            step=step,
            committed_len=committed_len,
            tree=tree,
            target_argmax=argmax.cpu(),
            topk_ids=topk_ids,
            topk_logprobs=topk_lps,
            accepted=acc.accepted,
            accept_length=self.report_accept_length(acc.accepted),
            bonus=acc.bonus,
            emitted=shown,
            emitted_logprobs=shown_lps,
            timings=timings,
            draws=acc.draws,
            uniforms=acc.uniforms,
        )

    # -- the steps an engine can get wrong; refcheck's fault injection overrides these ---------------
    def verify(self, state: TargetState, tree: Tree, capture: tuple[int, ...]) -> TreeForward:
        """One target forward over the whole tree with exact per-branch state."""
        return self.target.forward(
            state, tree.tokens, tree.parents, tree.depths, capture=capture, keep_layer_outputs=self.cfg.keep_layers
        )

    def walk(self, tree: Tree, argmax: torch.Tensor) -> list[int]:
        """Accepted nodes, root first: follow the target's argmax ([N] int64, host) down the tree."""
        return tree.walk_greedy(argmax)

    def bonus_node(self, accepted: list[int]) -> int:
        """The node whose argmax is the step's bonus token (and whose log-prob it reports): the last accepted."""
        return accepted[-1]

    def commit(self, state: TargetState, fwd: TreeForward, accepted: list[int]) -> TargetState:
        """KV of the accepted path in path order; conv/recurrent state of the last accepted node."""
        return state.commit(fwd, accepted)

    def context_nodes(self, tree: Tree, accepted: list[int]) -> list[int]:
        """Nodes whose target hidden states extend the drafter's context: root + accepted only."""
        return accepted

    # -- sampling (temperature > 0) ---------------------------------------------------------------
    def sample_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution every node draws from: ``[N, V]`` logits -> ``[N, V]`` float64."""
        s = self.cfg.sampling
        return tempered_probs(logits, s.temperature, s.top_k, s.top_p)

    def node_uniforms(self, request: int, step: int, positions: list[int]) -> torch.Tensor:
        """Each node's uniform ``[N]`` float64 (``positions``: the position each draw produces)."""
        return node_uniforms(self.cfg.sampling, request, step, positions)

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """The token each node draws: ``[N]`` int64 (host)."""
        return inverse_cdf(probs.cpu(), uniforms)

    def sample_walk(self, tree: Tree, draws: torch.Tensor, uniforms: torch.Tensor, draft_lp: torch.Tensor) -> list[int]:
        """Accepted nodes, root first: follow the child equal to each node's draw."""
        return tree.walk_greedy(draws)

    def bonus_token(self, logits: torch.Tensor, probs: torch.Tensor, draws: torch.Tensor, uniforms: torch.Tensor,
                    node: int) -> int:
        """The bonus: the draw at the last accepted node."""
        return int(draws[node])

    def report_emitted(self, emitted: list[int], lps: list[float]) -> tuple[list[int], list[float]]:
        """What the engine returns to the user for this step (every token, mask id included)."""
        return emitted, lps

    def report_topk(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-node target top-k the engine reports: ids [N, k] int64 and their log-probs [N, k] fp32."""
        return ids, logprobs

    def report_accept_length(self, accepted: list[int]) -> int:
        """τ of the step, bonus counted."""
        return len(accepted)

    def _cut(self, emitted: list[int], lps: list[float], room: int) -> tuple[list[int], list[float]]:
        """Cut a step's emitted tokens after the first stop token and at the remaining room."""
        for i, tok in enumerate(emitted):
            if tok in self.cfg.stop_token_ids:
                room = min(room, i + 1)
                break
        return emitted[:room], lps[:room]


def autoregressive_decode(target: Target, prompt_ids: list[int], max_new_tokens: int,
                          stop_token_ids: frozenset[int] = frozenset(), sampling: Sampling | None = None,
                          request: int = 0) -> list[int]:
    """Target-only decoding, one token per forward, with the same machinery as the decoder: greedy, or
    with ``sampling`` (T > 0) each token drawn with the decoder's keyed uniform for its position.

    The speed baseline of sweeps (same implementation, so the ratio measures speculation alone);
    correctness oracles use :func:`ddtree_reference.oracle.greedy_decode` / ``sample_decode`` instead.
    """
    dev = target.device
    sampled = sampling is not None and not sampling.greedy

    def pick(logits: torch.Tensor, position: int) -> int:  # logits [1, V] -> the token at ``position``
        if not sampled:
            return int(logits[0].argmax())
        probs = tempered_probs(logits.cpu(), sampling.temperature, sampling.top_k, sampling.top_p)  # [1, V]
        return int(inverse_cdf(probs, node_uniforms(sampling, request, -1, [position]))[0])

    state, fwd = target.prefill(torch.tensor(prompt_ids, dtype=torch.long, device=dev))
    tok = pick(fwd.logits[-1:], len(prompt_ids))
    out = [tok]
    one = torch.zeros(1, dtype=torch.long)
    while len(out) < max_new_tokens and tok not in stop_token_ids:
        fwd = target.forward(state, torch.tensor([tok]), one - 1, one)
        state = state.commit(fwd, [0])
        tok = pick(fwd.logits[:1], state.length)
        out.append(tok)
    return out
