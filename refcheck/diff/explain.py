"""Explaining one failing node: which counterfactual makes the reference say what the engine said.

Contract: :func:`explain_node` takes an engine trace, a request, a step and a node. It rebuilds the
reference's committed state at that step by prefilling the committed tokens, then re-verifies the
step's tree under a set of hypotheses about what the engine got wrong. Each hypothesis is scored by
how well the reference's log-probs at the node fit the engine's recorded top-k: the largest
absolute difference over the engine's top-k ids, the same measure the replay diff uses.

| hypothesis | what it tests |
|---|---|
| the exact reference | the replay diff's own verdict |
| the per-path oracle | transformers' plain forward over the committed tokens and the node's root path: does the reference itself agree with the model? |
| another input token at the node | every token of the tree and of the engine's top-k, as the node's token |
| another recurrent parent | Gated DeltaNet layers only (conv window and recurrent state), for every earlier node; the previous node in flat order is the flattened-tree leak |
| another attention visibility | the flat causal order, self only, ancestors plus earlier siblings, the parent's row |
| rounding at the engine's dtype | the rounding ensemble of :mod:`refcheck.diff.triage` (8 seeded runs, every linear output perturbed by one unit roundoff): how far it moves this node (its *spread*) against the step's median node; it explains the node when the exact fit is within the triage factor of the spread (an ill-conditioned node) |

A hypothesis *explains* the node when its fit is within the trace's log-prob tolerance while the
exact reference's is not. The result says which hypotheses do, best first. Bad input (no such
request, step or node) is a :class:`~refcheck.errors.UsageError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree_reference.compat import full_forward_logits
from ddtree_reference.state import TargetState
from ddtree_reference.target import Target
from ddtree_reference.treechunk import ancestor_matrix
from refcheck.diff.tolerance import calibration_for, engine_numerics, tolerance_of
from refcheck.diff.triage import UNIT_ROUNDOFF, RoundingEnsemble, Rule, StepInputs, topk_spread
from refcheck.errors import UsageError
from refcheck.trace.rows import RequestRow, StepRow, Trace


@dataclass(slots=True)
class Hypothesis:
    kind: str  # exact | oracle | token | recurrent_parent | visibility | rounding
    detail: str
    fit: float  # max |Δ log-prob| over the engine's top-k ids at the node
    argmax: int  # the reference's argmax under this hypothesis
    explains: bool = False


@dataclass(slots=True)
class Explanation:
    request_id: str
    step: int
    node: int
    token: int
    parent: int
    depth: int
    engine_topk: list[tuple[int, float]]
    reference_topk: list[tuple[int, float]]
    tolerance: float
    oracle_vs_reference: float = float("nan")  # max |Δ log-prob| over the vocabulary at the node
    #: the rounding ensemble at the node: spread, the step's median spread, samples, factor, unit roundoff
    conditioning: dict[str, Any] = field(default_factory=dict)
    hypotheses: list[Hypothesis] = field(default_factory=list)

    @property
    def explained_by(self) -> list[Hypothesis]:
        return sorted((h for h in self.hypotheses if h.explains), key=lambda h: h.fit)


def find_step(trace: Trace, request_id: str, step: int, node: int) -> tuple[RequestRow, StepRow]:
    ids = [r.request_id for r in trace.requests]
    if request_id not in ids:
        raise UsageError(f"no request {request_id!r} in the trace (it has {', '.join(ids[:12])})")
    rows = [s for s in trace.steps_of(request_id) if s.step == step]
    if not rows:
        have = [s.step for s in trace.steps_of(request_id)]
        raise UsageError(f"request {request_id} has no step {step} (steps {min(have)}..{max(have)})" if have
                         else f"request {request_id} has no verify steps")
    s = rows[0]
    if not 0 <= node < len(s.tree_tokens):
        raise UsageError(f"step {step} of {request_id} has nodes 0..{len(s.tree_tokens) - 1}, not {node}")
    if not s.topk_ids:
        raise UsageError(f"the engine recorded no top-k log-probs at step {step} of {request_id}: nothing to fit")
    return [r for r in trace.requests if r.request_id == request_id][0], s


def committed_tokens(req: RequestRow, s: StepRow) -> list[int]:
    """The prompt plus the output tokens committed before step ``s`` of request ``req``."""
    return list(req.prompt_ids) + list(req.output_ids)[: s.committed_len - len(req.prompt_ids)]


def committed_state(req: RequestRow, s: StepRow, target: Target) -> TargetState:
    """The reference's committed state before step ``s``: a prefill of the committed tokens."""
    state: TargetState
    state, _ = target.prefill(torch.tensor(committed_tokens(req, s), device=target.device))
    return state


def visibility_variants(base: torch.Tensor, parents: torch.Tensor, node: int) -> dict[str, torch.Tensor]:
    """Wrong attention rows for ``node`` ([n] bool each), by what an engine might have got wrong;
    ``base`` is the tree's ancestor-or-self matrix [n, n] (``ancestor_matrix(parents)``)."""
    n, dev = parents.shape[0], parents.device
    sibs = [j for j in range(node) if int(parents[j]) == int(parents[node])]
    variants = {"the flat causal order (every earlier node)": torch.arange(n, device=dev) <= node,
                "itself only (and the committed prefix)": torch.arange(n, device=dev) == node}
    if sibs:
        variants["its ancestors and earlier siblings"] = base[node].clone().index_fill_(0, torch.tensor(sibs, device=dev), True)
    if int(parents[node]) >= 0:
        variants["its parent's row (an off-by-one row)"] = base[int(parents[node])] | (torch.arange(n, device=dev) == node)
    return variants


def explain_node(trace: Trace, request_id: str, step: int, node: int, target: Target) -> Explanation:
    req, s = find_step(trace, request_id, step, node)
    tol = tolerance_of(trace.provenance).logprob_abs
    committed = committed_tokens(req, s)
    dev = target.device
    state = committed_state(req, s, target)
    tokens = torch.tensor(s.tree_tokens, dtype=torch.long)
    parents = torch.tensor(s.tree_parents, dtype=torch.long)
    depths = torch.tensor(s.tree_depths, dtype=torch.long)
    eng_ids = torch.tensor(s.topk_ids[node], dtype=torch.long)
    eng_lp = torch.tensor(s.topk_logprobs[node], dtype=torch.float32)

    def score(logits_row: torch.Tensor) -> tuple[float, int]:
        lp = torch.log_softmax(logits_row.float().cpu(), dim=-1)  # float32: log-probs compare across dtypes
        return float((lp[eng_ids] - eng_lp).abs().max()), int(lp.argmax())

    def row(fwd_logits: torch.Tensor, at: int = node) -> tuple[float, int]:
        return score(fwd_logits[at])

    exact = target.forward(state, tokens, parents, depths)
    ref_lp = torch.log_softmax(exact.logits[node].float().cpu(), dim=-1)
    top = ref_lp.topk(len(eng_ids))
    out = Explanation(request_id, step, node, int(tokens[node]), int(parents[node]), int(depths[node]),
                      list(zip(eng_ids.tolist(), eng_lp.tolist())), list(zip(top.indices.tolist(), top.values.tolist())),
                      tol)
    fit, arg = row(exact.logits)
    out.hypotheses.append(Hypothesis("exact", "the exact reference (what the replay diff compares)", fit, arg))

    path, j = [], node
    while j >= 0:
        path.append(int(tokens[j]))
        j = int(parents[j])
    seq = torch.tensor(committed + path[::-1], device=dev)
    oracle_row = full_forward_logits(target.model, seq)[-1]
    out.oracle_vs_reference = float((torch.log_softmax(oracle_row.float().cpu(), dim=-1) - ref_lp).abs().max())
    fit, arg = score(oracle_row)
    out.hypotheses.append(Hypothesis("oracle", "transformers' plain forward over the committed tokens and this "
                                     "node's root path", fit, arg))

    forward = _Forward(target, state, tokens, parents, depths)
    out.hypotheses += _token_hypotheses(forward, node, eng_ids, row)
    if any(target.is_linear(i) for i in range(len(target.layers))):
        out.hypotheses += _recurrent_parent_hypotheses(forward, node, row)
    out.hypotheses += _visibility_hypotheses(forward, node, row)

    exact_fit = out.hypotheses[0].fit
    for h in out.hypotheses[1:]:
        h.explains = exact_fit > tol and h.fit <= tol and h.kind != "oracle"

    # rounding at the engine's dtype: is this an ill-conditioned node?
    # (not for an engine whose bounds are final, fp32: no rounding judgement applies, and the ensemble needs one)
    dtype = engine_numerics(trace.provenance)[0]
    rule = calibration_for(*engine_numerics(trace.provenance)).rule if dtype in UNIT_ROUNDOFF and s.topk_ids else None
    if rule is not None:
        cols = torch.tensor(s.topk_ids, dtype=torch.long)  # [N, k] each node's engine top-k ids
        inputs = StepInputs(committed, tokens, parents, depths, [0], cols, None, None)
        _rounding_hypothesis(out, target, inputs, exact.logits, node, eng_lp, dtype, rule, exact_fit > tol)
    return out


@dataclass(slots=True)
class _Forward:
    """The step's tree forward from the committed state, with one thing changed (explain_node's hypotheses)."""

    target: Target
    state: TargetState
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

    def logits(self, **changed: Any) -> torch.Tensor:
        t = {"tokens": self.tokens, "parents": self.parents, "depths": self.depths, **changed}
        extra = {k: v for k, v in changed.items() if k not in ("tokens", "parents", "depths")}
        logits: torch.Tensor = self.target.forward(self.state, t["tokens"], t["parents"], t["depths"], **extra).logits
        return logits


_Row = Callable[..., tuple[float, int]]  # (logits, at=node) -> (fit, reference argmax)


def _token_hypotheses(fwd: _Forward, node: int, eng_ids: torch.Tensor, row: _Row) -> list[Hypothesis]:
    """Another input token: extra leaves under the node's parent, one per candidate (one forward)."""
    tokens, parents, depths = fwd.tokens, fwd.parents, fwd.depths
    n = tokens.shape[0]
    cands = sorted((set(tokens.tolist()) | set(eng_ids.tolist())) - {int(tokens[node])})
    if not cands:
        return []
    par = int(parents[node])
    logits = fwd.logits(tokens=torch.cat([tokens, torch.tensor(cands)]),
                        parents=torch.cat([parents, torch.full((len(cands),), par)]),
                        depths=torch.cat([depths, torch.full((len(cands),), int(depths[node]))]))
    out = []
    for i, tok in enumerate(cands):
        fit, arg = row(logits, n + i)
        out.append(Hypothesis("token", f"token {tok} fed at this node instead of {int(tokens[node])}", fit, arg))
    return out


def _recurrent_parent_hypotheses(fwd: _Forward, node: int, row: _Row) -> list[Hypothesis]:
    """Another recurrent parent (hybrid targets): the Gated DeltaNet layers follow it, attention does not."""
    parents, out = fwd.parents, []
    for p in range(-1, node):
        if p == int(parents[node]):
            continue
        rp = parents.clone()
        rp[node] = p
        fit, arg = row(fwd.logits(recurrent_parents=rp))
        what = "the committed prefix" if p < 0 else f"node {p}"
        if p == node - 1:
            what += " (the previous node in flat order: the flattened-tree leak)"
        out.append(Hypothesis("recurrent_parent", f"Gated DeltaNet state and conv window from {what}", fit, arg))
    return out


def _visibility_hypotheses(fwd: _Forward, node: int, row: _Row) -> list[Hypothesis]:
    """Another attention visibility at this node (the rest of the tree keeps its own)."""
    dev = fwd.target.device
    base = ancestor_matrix(fwd.parents).to(dev)
    out = []
    for what, vis_row in visibility_variants(base, fwd.parents.to(dev), node).items():
        vis = base.clone()
        vis[node] = vis_row
        fit, arg = row(fwd.logits(visible=vis))
        out.append(Hypothesis("visibility", f"attention to {what}", fit, arg))
    return out


def _rounding_hypothesis(out: Explanation, target: Target, inputs: StepInputs, exact_logits: torch.Tensor, node: int,
                         eng_lp: torch.Tensor, dtype: str, rule: Rule, exact_fails: bool) -> None:
    """The rounding ensemble at the engine's dtype: the node's spread into ``out.conditioning``, and the
    hypothesis that rounding explains the deviation (when the exact reference does not fit)."""
    samples = RoundingEnsemble(target, None, dtype, rule, ()).sample(inputs).node  # [S, N, k]
    ref_cols = torch.log_softmax(exact_logits.float().cpu(), dim=-1).gather(1, inputs.cols)  # [N, k]
    spreads = topk_spread(samples, ref_cols)  # [N]
    spread = float(spreads[node])
    fits = (samples[:, node] - eng_lp[None]).abs().amax(dim=1)  # [S]
    exact_fit = out.hypotheses[0].fit
    out.conditioning = {"spread": spread, "median_spread": float(spreads.median()), "samples": rule.samples,
                        "factor": rule.factor, "unit_roundoff": UNIT_ROUNDOFF[dtype], "dtype": dtype}
    out.hypotheses.append(Hypothesis(
        "rounding", f"rounding at {dtype}: {rule.samples} noisy runs move this node by up to {spread:.4g} "
                    f"(median node {float(spreads.median()):.3g}); best run fits within {float(fits.min()):.4g}",
        float(fits.min()), -1, explains=exact_fails and rule.covers(exact_fit, spread)))
