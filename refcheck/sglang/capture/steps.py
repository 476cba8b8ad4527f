"""SGLang verify tensors -> per-request step records (pure functions, no SGLang import).

Contract: the logits of a verify forward are reduced where they are, inside the engine's step, to a
:class:`NodeSummary` (:func:`summarise_nodes`: per node row the top-k log-probs, the raw argmax and the
log-prob of the token the row emits); the record ships that and the step's small tensors to the host
(:mod:`refcheck.sglang.capture.shipper`). Each builder then takes those tensors of one verify step for a
whole batch (flat ``[bs*N]`` node tensors, ``[bs, N]`` tree links, the node summary, the accept outputs)
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

from refcheck.sglang.layout import accepted_from_accept_index, depths_from_parents, parents_from_links
from refcheck.sglang.vocab_rows import by_row_chunks

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
    #: the drafter's side (refcheck.sglang.draft_side): its top-k per depth [L][k]; [] = not exposed
    draft_ids: list[list[int]] = field(default_factory=list)
    draft_logprobs: list[list[float]] = field(default_factory=list)
    #: positions and feature sketch [A, r] of the context the engine fed its drafter from this step
    context_positions: list[int] = field(default_factory=list)
    context_sketch: torch.Tensor | None = None
    #: shadow mode: the tree the drafter built when the engine verified its chain (root first); [] = none
    shadow_tokens: list[int] = field(default_factory=list)
    shadow_parents: list[int] = field(default_factory=list)
    #: the request's context tokens this record carries, [start, tokens], and its sampling parameters at its first
    #: record (:mod:`refcheck.sglang.capture.contexts`); None = not carried
    context: list[Any] | None = None
    params: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _fields(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCapture:
        return cls(**d)

    def attach_draft(self, side: dict[str, Any] | None) -> None:
        """Set the drafter's side from a record of :mod:`refcheck.sglang.draft_side` (None: not exposed)."""
        if not side:
            return
        self.draft_ids, self.draft_logprobs = side.get("ids", []), side.get("logprobs", [])
        self.context_positions, self.context_sketch = side.get("positions", []), side.get("sketch")
        self.shadow_tokens, self.shadow_parents = side.get("shadow_tokens", []), side.get("shadow_parents", [])


@dataclass(slots=True)
class NodeSummary:
    """What a record keeps of a verify forward's logits, per node row (on the logits' device until shipped)."""

    topk_ids: torch.Tensor  # [M, k]
    topk_logprobs: torch.Tensor  # [M, k] float32
    argmax: torch.Tensor  # [M]: of the raw logits, as SGLang's greedy kernels take it
    picked: torch.Tensor  # [M] float32: each row's log-prob of the token the step emits from it (where it emits)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs, "argmax": self.argmax,
                "picked": self.picked}

    @classmethod
    def of(cls, d: dict[str, torch.Tensor]) -> NodeSummary:
        return cls(d["topk_ids"], d["topk_logprobs"], d["argmax"], d["picked"])


def node_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32 log-probs. float32: SGLang hands verify logits over as float32 already;
    bf16 logits (other builds) are upcast so the log-softmax is not computed at bf16 precision."""
    return torch.log_softmax(logits.float(), dim=-1)


def summarise_nodes(logits: torch.Tensor, picks: torch.Tensor | None, k: int = TOPK,
                    logp: torch.Tensor | None = None) -> NodeSummary:
    """[M, V] logits and the token each row emits [M] (None: picked later, :func:`pick`) -> a
    :class:`NodeSummary`, computed where the logits are (no host copy). Without the caller's ``logp``, in row chunks
    (:func:`refcheck.sglang.vocab_rows.by_row_chunks`: each chunk's float32 log-probs bounded in size)."""
    if logp is not None:
        return _summary(logits, picks, k, logp)
    return NodeSummary.of(by_row_chunks(lambda lg, pk: _summary(lg, pk, k, node_logprobs(lg)).tensors(),
                                        (logits, picks), logits.shape[0], logits.shape[-1]))


def _summary(logits: torch.Tensor, picks: torch.Tensor | None, k: int, logp: torch.Tensor) -> NodeSummary:
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    picked = pick(logp, picks) if picks is not None else torch.full_like(logp[:, 0], math.nan)
    return NodeSummary(top.indices, top.values, logits.argmax(dim=-1), picked)


def pick(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[M, V] log-probs at one token per row [M] -> [M] (a row's token outside the vocabulary: NaN)."""
    t = tokens.reshape(-1).long()
    inside = (t >= 0) & (t < logp.shape[-1])
    got = logp.gather(1, t.clamp(0, logp.shape[-1] - 1)[:, None])[:, 0]  # [M]
    return torch.where(inside, got, torch.full_like(got, math.nan))


def _host(nodes: NodeSummary) -> tuple[list[list[int]], list[list[float]], list[int], list[float]]:
    return (nodes.topk_ids.cpu().tolist(), nodes.topk_logprobs.cpu().tolist(), nodes.argmax.cpu().tolist(),
            nodes.picked.cpu().tolist())


def _check_batch(name: str, n: int, rids: Sequence[str], committed: Sequence[int]) -> None:
    if len(rids) != n or len(committed) != n:
        raise ValueError(f"{name}: {n} batch rows but {len(rids)} rids and {len(committed)} committed lengths")


def tree_steps(tokens: torch.Tensor, next_token: torch.Tensor | None, next_sibling: torch.Tensor | None,
               nodes: NodeSummary, accept_index: torch.Tensor, accept_lens: torch.Tensor, predict: torch.Tensor,
               rids: Sequence[str], committed: Sequence[int], positions: torch.Tensor | None = None,
               meta: dict[str, Any] | None = None, draws: torch.Tensor | None = None,
               uniforms: torch.Tensor | None = None, residuals: torch.Tensor | None = None,
               origin: Sequence[int] | None = None) -> list[StepCapture]:
    """Records of one ``eagle_sample`` call (or the recorded requests of one: ``origin`` gives each row's place in
    SGLang's batch, which ``accept_index``'s flat indices count in). tokens/predict [bs*N], links [bs, N] (None: a chain),
    nodes: the [bs*N] rows' summary (picked at ``predict``), accept_index [bs, W] (flat indices, -1 padded),
    accept_lens [bs] (bonus counted); draws [bs*N] / uniforms [bs*N] where the sampler exposes them (-1 / NaN at
    a greedy request's nodes); residuals [bs] with uniforms and no draws: SGLang's tree sampler's coins (node
    coins, bonus coin)."""
    bs = int(accept_lens.shape[0])
    _check_batch("tree_steps", bs, rids, committed)
    n = int(tokens.shape[0]) // bs if bs else 0
    toks = tokens.view(bs, n).cpu().tolist()  # [bs*N] -> [bs, N]
    nt = next_token.cpu().tolist() if next_token is not None else None
    ns = next_sibling.cpu().tolist() if next_sibling is not None else None
    pos = positions.view(bs, n).cpu().tolist() if positions is not None else None  # [bs*N] -> [bs, N]
    acc_rows, acc_lens, pred = accept_index.cpu().tolist(), accept_lens.cpu().tolist(), predict.cpu().tolist()
    top_ids, top_lps, amax, picked = _host(nodes)
    dr = draws.cpu().tolist() if draws is not None else None
    un = uniforms.cpu().tolist() if uniforms is not None else None
    rs = residuals.cpu().tolist() if residuals is not None else None
    out = []
    for b in range(bs):
        parents = parents_from_links(nt[b], ns[b]) if nt is not None else [-1] + list(range(n - 1))
        depths = depths_from_parents(parents)
        accepted = accepted_from_accept_index(acc_rows[b][: int(acc_lens[b])], origin[b] if origin is not None else b, n)
        emitted = [int(pred[b * n + j]) for j in accepted]
        m = dict(meta or {})
        m["branching"] = len(set(parents[1:])) < n - 1
        if pos is not None:
            m["positions_match_depths"] = [p - pos[b][0] for p in pos[b]] == depths
        out.append(StepCapture(
            rid=rids[b], committed_len=int(committed[b]), tokens=[int(t) for t in toks[b]], parents=parents, depths=depths,
            topk_ids=top_ids[b * n:(b + 1) * n], topk_logprobs=top_lps[b * n:(b + 1) * n],
            argmax=amax[b * n:(b + 1) * n], accepted=accepted, bonus=emitted[-1] if emitted else -1, emitted=emitted,
            emitted_logprobs=[picked[b * n + j] for j in accepted], layout="tree", meta=m))
        if dr is not None and un is not None and any(d >= 0 for d in dr[b * n:(b + 1) * n]):  # a sampled request
            out[-1].draws, out[-1].uniforms = [int(d) for d in dr[b * n:(b + 1) * n]], list(un[b * n:(b + 1) * n])
        elif un is not None and rs is not None:  # the tree sampler's coins, float32 (exact in float64)
            out[-1].uniforms, out[-1].residual_uniform = [float(u) for u in un[b * n:(b + 1) * n]], float(rs[b])
    return out


def chain_steps(candidates: torch.Tensor, nodes: NodeSummary, commit_lens: torch.Tensor, out_tokens: torch.Tensor,
                rids: Sequence[str], committed: Sequence[int], meta: dict[str, Any] | None = None) -> list[StepCapture]:
    """Records of one DFLASH verify: candidates [bs, B] (column 0 the root), nodes: the [bs*B] rows' summary
    (picked at ``out_tokens``), commit_lens [bs] (accepted drafts + 1), out_tokens [bs, B] (emitted tokens first)."""
    bs, block = int(candidates.shape[0]), int(candidates.shape[1])
    _check_batch("chain_steps", bs, rids, committed)
    cand, lens, outs = candidates.cpu().tolist(), commit_lens.cpu().tolist(), out_tokens.reshape(bs, block).cpu().tolist()
    top_ids, top_lps, amax, picked = _host(nodes)
    parents, depths = [-1] + list(range(block - 1)), list(range(block))
    out = []
    for b in range(bs):
        c = int(lens[b])
        if not 1 <= c <= block:
            raise ValueError(f"chain_steps: commit length {c} outside 1..{block}")
        emitted = [int(t) for t in outs[b][:c]]
        rows = slice(b * block, (b + 1) * block)
        out.append(StepCapture(
            rid=rids[b], committed_len=int(committed[b]), tokens=[int(t) for t in cand[b]], parents=list(parents),
            depths=list(depths), topk_ids=top_ids[rows], topk_logprobs=top_lps[rows], argmax=amax[rows],
            accepted=list(range(c)), bonus=emitted[-1], emitted=emitted, emitted_logprobs=picked[rows][:c],
            layout="chain", meta=dict(meta or {})))
    return out


def root_steps(roots: Sequence[int], nodes: NodeSummary, next_ids: torch.Tensor, rids: Sequence[str],
               committed: Sequence[int], meta: dict[str, Any] | None = None) -> list[StepCapture]:
    """Records of one target-only decode step: roots [bs] (the last emitted tokens), nodes: the [bs] rows' summary
    (picked at ``next_ids``)."""
    bs = len(roots)
    _check_batch("root_steps", bs, rids, committed)
    top_ids, top_lps, amax, picked = _host(nodes)
    nxt = [int(t) for t in next_ids.reshape(-1).cpu().tolist()]
    return [StepCapture(rid=rids[b], committed_len=int(committed[b]), tokens=[int(roots[b])], parents=[-1], depths=[0],
                        topk_ids=top_ids[b:b + 1], topk_logprobs=top_lps[b:b + 1], argmax=amax[b:b + 1],
                        accepted=[0], bonus=nxt[b], emitted=[nxt[b]], emitted_logprobs=[picked[b]], layout="root",
                        meta=dict(meta or {}))
            for b in range(bs)]


@dataclass(slots=True)
class PrefillCapture:
    """The first output token of a request, from its (last) prefill chunk."""

    rid: str
    prompt_len: int
    token: int
    logprob: float
    uniform: float = float("nan")  # the keyed first draw's uniform (REFCHECK_DDTREE at T > 0); NaN = not exposed
    context: list[Any] | None = None  # as StepCapture's
    params: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _fields(self)


def prefill_records(nodes: NodeSummary, next_ids: torch.Tensor, rids: Sequence[str], prompt_lens: Sequence[int],
                    uniforms: dict[str, float] | None = None) -> list[PrefillCapture]:
    """nodes: the summary of each request's last-position logits [bs] (picked at ``next_ids`` [bs]);
    uniforms: rid -> the first draw's uniform."""
    nxt = [int(t) for t in next_ids.reshape(-1).cpu().tolist()]
    lps = nodes.picked.cpu().tolist()
    u = uniforms or {}
    return [PrefillCapture(rids[b], int(prompt_lens[b]), nxt[b], lps[b], float(u.get(rids[b], math.nan)))
            for b in range(len(nxt))]
