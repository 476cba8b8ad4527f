"""SGLang verify tensors -> per-request step records (pure functions, no SGLang import).

Contract: each builder takes the tensors SGLang holds at one verify step for a whole batch (flat
``[bs*N]`` node tensors, ``[bs, N]`` tree links, ``[bs*N, V]`` float32 logits, the accept outputs)
plus, per request, its rid and committed length (tokens whose KV was in the cache before the step,
i.e. the root's position), and returns one :class:`StepCapture` per request, in refcheck's
conventions: node 0 is the root, ``parents[0] == -1``, ``accepted`` are local node indices root
first, ``emitted`` are the tokens the step appends (accepted drafts, then the bonus) with the
engine's own log-probs of them, ``accept_length`` = len(accepted) (bonus counted).

Three layouts: ``tree`` (EAGLE-family/NGRAM: ``eagle_sample``'s ``accept_index``/``predict``),
``chain`` (DFLASH: candidates and ``out_tokens``) and ``root`` (target-only decoding: one node).
Committed state is attached later (``state``), after SGLang's commit has run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from refcheck.sglang_capture.layout import accepted_from_accept_index, depths_from_parents, parents_from_links

TOPK = 5


def _fields(record) -> dict[str, Any]:
    """A record's fields as a plain dict (shallow: tensors are not copied), for ``torch.save``."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


@dataclass(slots=True, eq=False)
class StepCapture:
    rid: str
    committed_len: int
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    argmax: list[int]
    accepted: list[int]
    bonus: int
    emitted: list[int]
    emitted_logprobs: list[float]
    layout: str
    meta: dict[str, Any] = field(default_factory=dict)
    # name -> (layer, kind, sketch [rows, r] float32, full rows or None), set after the commit
    state: dict[str, tuple[int, str, torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    layer_sketch: torch.Tensor | None = None  # [layers, N, r] when the layer hooks ran
    # the keyed sampler's (REFCHECK_DDTREE at T > 0): every node's draw [N] and uniform [N]; [] = not exposed
    draws: list[int] = field(default_factory=list)
    uniforms: list[float] = field(default_factory=list)
    #: SGLang's tree sampler (NGRAM at T > 0): the coin of the bonus draw; NaN = not exposed
    residual_uniform: float = float("nan")
    #: the drafter's side (refcheck.sglang_capture.drafts): its top-k per depth [L][k]; [] = not exposed
    draft_ids: list[list[int]] = field(default_factory=list)
    draft_logprobs: list[list[float]] = field(default_factory=list)
    #: positions and feature sketch [A, r] of the context the engine fed its drafter from this step
    context_positions: list[int] = field(default_factory=list)
    context_sketch: torch.Tensor | None = None
    #: shadow mode: the tree the drafter built when the engine verified its chain (root first); [] = none
    shadow_tokens: list[int] = field(default_factory=list)
    shadow_parents: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _fields(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCapture:
        return cls(**d)

    def attach_draft(self, side: dict[str, Any] | None) -> None:
        """Set the drafter's side from a record of :mod:`refcheck.sglang_capture.drafts` (None: not exposed)."""
        if not side:
            return
        self.draft_ids, self.draft_logprobs = side.get("ids", []), side.get("logprobs", [])
        self.context_positions, self.context_sketch = side.get("positions", []), side.get("sketch")
        self.shadow_tokens, self.shadow_parents = side.get("shadow_tokens", []), side.get("shadow_parents", [])


@dataclass(slots=True)
class NodeLogprobs:
    """Per-node log-prob summary of a verify forward (all on the CPU)."""

    logp: torch.Tensor  # [M, V] float32, on the logits' device (for gathers at emitted tokens)
    topk_ids: list[list[int]]  # [M][k]
    topk_logprobs: list[list[float]]  # [M][k]
    argmax: list[int]  # [M]


def node_logprobs(logits: torch.Tensor, k: int = TOPK) -> NodeLogprobs:
    """[M, V] logits -> log-softmax, top-k and argmax per node (argmax of the raw logits, as SGLang's
    greedy kernels take it)."""
    # float32: SGLang hands verify logits over as float32 already; bf16 logits (other builds) are upcast
    # so the log-softmax is not computed at bf16 precision.
    logp = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return NodeLogprobs(logp, top.indices.cpu().tolist(), top.values.cpu().tolist(), logits.argmax(dim=-1).cpu().tolist())


def _emitted_logprobs(logp: torch.Tensor, rows: list[int], tokens: list[int]) -> list[float]:
    if not rows:
        return []
    r = torch.tensor(rows, device=logp.device)
    t = torch.tensor(tokens, device=logp.device)
    return logp[r, t].cpu().tolist()


def _check_batch(name: str, n: int, rids: Sequence[str], committed: Sequence[int]) -> None:
    if len(rids) != n or len(committed) != n:
        raise ValueError(f"{name}: {n} batch rows but {len(rids)} rids and {len(committed)} committed lengths")


def tree_steps(tokens: torch.Tensor, next_token: torch.Tensor | None, next_sibling: torch.Tensor | None,
               logits: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor, predict: torch.Tensor,
               rids: Sequence[str], committed: Sequence[int], positions: torch.Tensor | None = None,
               meta: dict[str, Any] | None = None, draws: torch.Tensor | None = None,
               uniforms: torch.Tensor | None = None, residuals: torch.Tensor | None = None) -> list[StepCapture]:
    """Records of one ``eagle_sample`` call. tokens/predict [bs*N], links [bs, N] (None: a chain),
    logits [bs*N, V], accept_index [bs, W] (flat indices, -1 padded), accept_lens [bs] (bonus counted);
    draws [bs*N] / uniforms [bs*N] where the sampler exposes them (-1 / NaN at a greedy request's nodes);
    residuals [bs] with uniforms and no draws: SGLang's tree sampler's coins (node coins, bonus coin)."""
    bs = int(accept_lens.shape[0])
    _check_batch("tree_steps", bs, rids, committed)
    n = int(tokens.shape[0]) // bs if bs else 0
    toks = tokens.view(bs, n).cpu().tolist()  # [bs*N] -> [bs, N]
    nt = next_token.cpu().tolist() if next_token is not None else None
    ns = next_sibling.cpu().tolist() if next_sibling is not None else None
    pos = positions.view(bs, n).cpu().tolist() if positions is not None else None  # [bs*N] -> [bs, N]
    acc_rows, acc_lens, pred = accept_index.cpu().tolist(), accept_lens.cpu().tolist(), predict.cpu().tolist()
    lp = node_logprobs(logits)
    dr = draws.cpu().tolist() if draws is not None else None
    un = uniforms.cpu().tolist() if uniforms is not None else None
    rs = residuals.cpu().tolist() if residuals is not None else None
    out = []
    for b in range(bs):
        parents = parents_from_links(nt[b], ns[b]) if nt is not None else [-1] + list(range(n - 1))
        depths = depths_from_parents(parents)
        accepted = accepted_from_accept_index(acc_rows[b][: int(acc_lens[b])], b, n)
        emitted = [int(pred[b * n + j]) for j in accepted]
        m = dict(meta or {})
        m["branching"] = len(set(parents[1:])) < n - 1
        if pos is not None:
            m["positions_match_depths"] = [p - pos[b][0] for p in pos[b]] == depths
        out.append(StepCapture(
            rid=rids[b], committed_len=int(committed[b]), tokens=[int(t) for t in toks[b]], parents=parents, depths=depths,
            topk_ids=lp.topk_ids[b * n:(b + 1) * n], topk_logprobs=lp.topk_logprobs[b * n:(b + 1) * n],
            argmax=lp.argmax[b * n:(b + 1) * n], accepted=accepted, bonus=emitted[-1] if emitted else -1, emitted=emitted,
            emitted_logprobs=_emitted_logprobs(lp.logp, [b * n + j for j in accepted], emitted), layout="tree", meta=m))
        if dr is not None and un is not None and any(d >= 0 for d in dr[b * n:(b + 1) * n]):  # a sampled request
            out[-1].draws, out[-1].uniforms = [int(d) for d in dr[b * n:(b + 1) * n]], list(un[b * n:(b + 1) * n])
        elif un is not None and rs is not None:  # the tree sampler's coins, float32 (exact in float64)
            out[-1].uniforms, out[-1].residual_uniform = [float(u) for u in un[b * n:(b + 1) * n]], float(rs[b])
    return out


def chain_steps(candidates: torch.Tensor, logits: torch.Tensor, commit_lens: torch.Tensor, out_tokens: torch.Tensor,
                rids: Sequence[str], committed: Sequence[int], meta: dict[str, Any] | None = None) -> list[StepCapture]:
    """Records of one DFLASH verify: candidates [bs, B] (column 0 the root), logits [bs*B, V],
    commit_lens [bs] (accepted drafts + 1), out_tokens [bs, B] (emitted tokens first)."""
    bs, block = int(candidates.shape[0]), int(candidates.shape[1])
    _check_batch("chain_steps", bs, rids, committed)
    cand, lens, outs = candidates.cpu().tolist(), commit_lens.cpu().tolist(), out_tokens.reshape(bs, block).cpu().tolist()
    lp = node_logprobs(logits)
    parents, depths = [-1] + list(range(block - 1)), list(range(block))
    out = []
    for b in range(bs):
        c = int(lens[b])
        if not 1 <= c <= block:
            raise ValueError(f"chain_steps: commit length {c} outside 1..{block}")
        emitted = [int(t) for t in outs[b][:c]]
        out.append(StepCapture(
            rid=rids[b], committed_len=int(committed[b]), tokens=[int(t) for t in cand[b]], parents=list(parents),
            depths=list(depths), topk_ids=lp.topk_ids[b * block:(b + 1) * block],
            topk_logprobs=lp.topk_logprobs[b * block:(b + 1) * block], argmax=lp.argmax[b * block:(b + 1) * block],
            accepted=list(range(c)), bonus=emitted[-1], emitted=emitted,
            emitted_logprobs=_emitted_logprobs(lp.logp, [b * block + j for j in range(c)], emitted), layout="chain",
            meta=dict(meta or {})))
    return out


def root_steps(roots: Sequence[int], logits: torch.Tensor, next_ids: torch.Tensor, rids: Sequence[str],
               committed: Sequence[int], meta: dict[str, Any] | None = None) -> list[StepCapture]:
    """Records of one target-only decode step: roots [bs] (the last emitted tokens), logits [bs, V]."""
    bs = len(roots)
    _check_batch("root_steps", bs, rids, committed)
    lp = node_logprobs(logits)
    nxt = [int(t) for t in next_ids.reshape(-1).cpu().tolist()]
    return [StepCapture(rid=rids[b], committed_len=int(committed[b]), tokens=[int(roots[b])], parents=[-1], depths=[0],
                        topk_ids=lp.topk_ids[b:b + 1], topk_logprobs=lp.topk_logprobs[b:b + 1], argmax=lp.argmax[b:b + 1],
                        accepted=[0], bonus=nxt[b], emitted=[nxt[b]],
                        emitted_logprobs=_emitted_logprobs(lp.logp, [b], [nxt[b]]), layout="root", meta=dict(meta or {}))
            for b in range(bs)]


@dataclass(slots=True)
class PrefillCapture:
    """The first output token of a request, from its (last) prefill chunk."""

    rid: str
    prompt_len: int
    token: int
    logprob: float
    uniform: float = float("nan")  # the keyed first draw's uniform (REFCHECK_DDTREE at T > 0); NaN = not exposed

    def to_dict(self) -> dict[str, Any]:
        return _fields(self)


def prefill_records(logits: torch.Tensor, next_ids: torch.Tensor, rids: Sequence[str], prompt_lens: Sequence[int],
                    uniforms: dict[str, float] | None = None) -> list[PrefillCapture]:
    """logits [bs, V] (last position of each request), next_ids [bs]; uniforms: rid -> the first draw's uniform."""
    lp = node_logprobs(logits)
    nxt = [int(t) for t in next_ids.reshape(-1).cpu().tolist()]
    lps = _emitted_logprobs(lp.logp, list(range(len(nxt))), nxt)
    u = uniforms or {}
    return [PrefillCapture(rids[b], int(prompt_lens[b]), nxt[b], lps[b], float(u.get(rids[b], math.nan)))
            for b in range(len(nxt))]
