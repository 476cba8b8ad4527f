"""Exact replay of a sampled verify step: given the engine's own randomness, is its walk lossless?

Contract: :class:`SampledRequest` reads a request row's sampling columns (schema 1.2);
:func:`replay_sampled_step` takes the reference's sampling distribution at every node of the
engine's tree at the engine's prefix (``probs`` ``[N, V]`` float64, from
:func:`ddtree_reference.sampling.tempered_probs` of the replay's logits) and the engine's recorded draws
and/or uniforms, and returns findings:

* ``sampling``: a recorded uniform that is not the keyed generator's (when the trace says the
  engine used refcheck's keyed Philox, so the number is recomputable); a uniform repeated along the
  accepted path (a value at 3+ path nodes, or at 2 when it has more than float32's 24 bits: chance
  probability <= 120 * 2**-53 or C(16, 3) * 2**-48 per step); a draw that is not the inverse CDF of
  its uniform under the reference's distribution (a benign tie when the uniform lies within
  ``cdf_tol`` of the engine token's CDF interval, the drift the logits' tolerance allows); a draw, accepted token or
  bonus with probability 0 (outside top-k / top-p) — this one needs no exposed randomness;
* ``accepted_path``: the walk that follows each node's draw differs from the engine's accepted
  nodes (first differing node);
* ``bonus``: the bonus is not the draw at the last accepted node.

In an engine's own low-precision dtype a correct engine's logits differ from the fp32 reference's by
its rounding, which moves CDF edges and the top-k / top-p cut. With a ``rounding`` judge (the
replay's calibrated rule) a draw that is not the inverse CDF of its uniform beyond ``cdf_tol`` (then
the fp32 floor), or a token just outside the support, is converted to log-prob units (how far the
logits would have to move: ``T * log1p(CDF distance)``; half the log-prob gap to the k-th token; ``T *
log1p(mass before the token - top_p)``) and held to the node's rounding spread: within it, the node is
listed in :attr:`StepReplay.rounding` (the replay reports it as consistent with rounding, triaged only
if the request is otherwise right) instead of failing.

An engine with the children-first rule (rng ``engine-children-first``: SGLang's target-only tree sampler,
:mod:`ddtree_reference.children_first`) exposes a uniform per node and the step's residual uniform instead of
draws: at each node of its accepted path the token that came out (the next accepted node's, or the bonus
at the last) must be what the rule gives with those uniforms under the reference's distribution, within
``cdf_tol`` (a benign tie) or the rounding judge, else ``accepted_path`` (a child) or ``bonus`` fails there.

Nodes whose draw the engine exposes neither directly nor through a uniform are not judged here:
:attr:`StepReplay.exact` is False and the distributional test (:mod:`refcheck.diff.distribution`)
covers them. This module never imports runners.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ddtree_reference import children_first
from ddtree_reference.sampling import Sampling, boundary_margin, inverse_cdf, node_uniforms, tempered_probs
from ddtree_reference.tree import Tree
from refcheck.diff.findings import Finding, Verdict
from refcheck.trace.io import RequestRow, StepRow

RECOMPUTABLE = {"refcheck-philox-position": "position", "refcheck-philox-node": "node"}
CHILDREN_FIRST = "engine-children-first"  # the rng kind of an engine with ddtree_reference.children_first's rule


@dataclass(frozen=True, slots=True)
class SampledRequest:
    """A sampled request's parameters and, when recomputable, its keyed generator."""

    sampling: Sampling
    rng: str
    rng_request: int

    @classmethod
    def from_row(cls, row: RequestRow) -> SampledRequest | None:
        if not row.sampled:
            return None
        keying = RECOMPUTABLE.get(row.rng, "position")
        seed = row.seed if row.seed >= 0 else 0
        return cls(Sampling(row.temperature, row.top_k, row.top_p, seed, keying), row.rng, row.rng_request)

    @property
    def recomputable(self) -> bool:
        return self.rng in RECOMPUTABLE and self.rng_request >= 0

    def keyed(self, step: int, positions: list[int]) -> torch.Tensor:
        """The uniforms refcheck's generator gives these nodes ``[N]`` float64 (recomputable only)."""
        return node_uniforms(self.sampling, self.rng_request, step, positions)


#: (node, deviation in log-prob units) -> the node's rounding spread when rounding explains the deviation, else None
RoundingJudge = Callable[[int, float], "float | None"]


@dataclass(slots=True)
class StepReplay:
    findings: list[Finding] = field(default_factory=list)
    exact: bool = True  # every node the walk consulted had an exposed (or recomputed) draw
    #: node -> (what moved, deviation in log-prob units, spread): deviations rounding explains (module docstring)
    rounding: dict[int, tuple[str, float, float]] = field(default_factory=dict)


def support_gap(logp: torch.Tensor, token: int, s: Sampling) -> float:
    """How far (log-prob units) the logits at a node ``logp`` ``[V]`` would have to move for ``token`` to enter
    the top-k / top-p support (0 when it is inside)."""
    gap = 0.0
    lp = logp.to(torch.float64)  # float64: the same arithmetic as tempered_probs
    if 0 < s.top_k < lp.shape[-1]:
        kth = float(torch.topk(lp, s.top_k).values[-1])
        gap = max(gap, (kth - float(lp[token])) / 2)  # both the token and the k-th may move
    if s.top_p < 1.0:
        p = tempered_probs(lp[None], s.temperature, s.top_k, 1.0)[0]  # [V]: after top-k, before top-p
        before = float(p[p > p[token]].sum())  # mass ahead of the token in descending order (ties: ignored)
        if before >= s.top_p:
            gap = max(gap, s.temperature * math.log1p(before - s.top_p))
    return gap


def _float32_exact(u: float) -> bool:
    return float(np.float32(u)) == u


def _repeated_on_path(uniforms: list[float], path: list[int]) -> int | None:
    """The first path node whose uniform repeats beyond chance (module docstring), else None."""
    seen: dict[float, list[int]] = {}
    for i in path:
        u = uniforms[i]
        if u == u:
            seen.setdefault(u, []).append(i)
    for u, nodes in seen.items():
        if len(nodes) >= 3 or (len(nodes) == 2 and not _float32_exact(u)):
            return nodes[1]
    return None


def replay_sampled_step(rid: str, s: StepRow, tree: Tree, probs: torch.Tensor, req: SampledRequest,
                        cdf_tol: float, rounding: RoundingJudge | None = None,
                        logp: torch.Tensor | None = None) -> StepReplay:
    """Judge one sampled step exactly (module docstring). ``probs`` ``[N, V]`` float64 and ``logp`` ``[N, V]``
    (the reference's log-probs, needed with ``rounding``) on the host."""
    out = StepReplay()
    T = req.sampling.temperature

    def explained_dev(node: int, dev: float, what: str) -> bool:
        """Whether rounding explains a deviation of ``dev`` log-prob units at ``node`` (recorded if so)."""
        if rounding is None or not math.isfinite(dev):
            return False
        spread = rounding(node, dev)
        if spread is None:
            return False
        out.rounding[node] = (what, dev, spread)
        return True

    def explained(node: int, token: int, outside: float, what: str) -> bool:
        """Whether rounding explains a draw of ``token`` at ``node`` lying ``outside`` (CDF units) of its interval."""
        if logp is None:
            return False
        dev = max(T * math.log1p(max(outside, 0.0)), support_gap(logp[node], token, req.sampling))
        return explained_dev(node, dev, what)

    n = tree.num_nodes
    step = s.step

    def fail(cat: str, msg: str, node: int | None = None, **details: Any) -> None:
        out.findings.append(Finding(Verdict.FAIL, cat, rid, step, node=node, message=msg, details=details))

    path_nodes = [a for a in s.accepted if 0 <= a < n]
    draws: list[int | None] = [None] * n
    known_d = [i for i, d in enumerate(s.node_draws) if d >= 0]
    known_u = [i for i, u in enumerate(s.node_uniforms) if u == u]
    for i in known_d:
        draws[i] = int(s.node_draws[i])
    if req.rng == CHILDREN_FIRST:
        if known_u:
            _check_repeats(s, path_nodes, fail)
        _check_support(s, tree, probs, req, [], [], path_nodes, draws, fail, explained)
        _check_children_first(rid, s, tree, probs, req, cdf_tol, path_nodes, out, fail, explained_dev, logp)
        return out
    if known_u:
        _check_uniforms(rid, s, tree, probs, req, cdf_tol, known_u, path_nodes, draws, out, fail, explained)
    _check_support(s, tree, probs, req, known_d, known_u, path_nodes, draws, fail, explained)
    _check_walk(s, tree, draws, path_nodes, out, fail)
    return out


def _check_repeats(s: StepRow, path_nodes: list[int], fail: Callable[..., None]) -> None:
    """A uniform reused along the accepted path beyond chance (:func:`_repeated_on_path`) is a finding."""
    rep = _repeated_on_path(s.node_uniforms, path_nodes)
    if rep is not None:
        fail("sampling", f"the uniform {s.node_uniforms[rep]!r} is reused along the accepted path (node {rep}): "
             "the draws of one walk are not independent", node=rep, uniform=s.node_uniforms[rep])


def _check_uniforms(rid: str, s: StepRow, tree: Tree, probs: torch.Tensor, req: SampledRequest, cdf_tol: float,
                    known_u: list[int], path_nodes: list[int], draws: list[int | None], out: StepReplay,
                    fail: Callable[..., None], explained: Callable[[int, int, float, str], bool]) -> None:
    """The exposed uniforms: the keyed generator's (when recomputable), not reused along the path, and each
    drawing the engine's token (a draw the engine did not expose is filled in from its uniform)."""
    step = s.step
    u = torch.tensor(s.node_uniforms, dtype=torch.float64)
    if req.recomputable:
        positions = (s.committed_len + 1 + tree.depths).tolist()
        keyed = req.keyed(step, positions)
        bad = [i for i in known_u if float(keyed[i]) != float(u[i])]
        if bad:
            i = bad[0]
            fail("sampling", f"uniform {float(u[i])!r} at node {i} is not the keyed generator's {float(keyed[i])!r} "
                 f"({req.rng}, seed {req.sampling.seed}, request {req.rng_request}; {len(bad)} of {len(known_u)} "
                 f"nodes differ)", node=i, engine=float(u[i]), keyed=float(keyed[i]), nodes=bad[:16])
    _check_repeats(s, path_nodes, fail)
    idx = torch.tensor(known_u, dtype=torch.long)
    expect = inverse_cdf(probs[idx], u[idx])  # [k]
    first_bad = None
    for j, i in enumerate(known_u):
        e = int(expect[j])
        d = draws[i]
        if d is None:
            draws[i] = e
            continue
        if d == e:
            continue
        # distance of u * total from the engine token's CDF interval (boundary_margin is negative outside it)
        outside = -float(boundary_margin(probs[i:i + 1], u[i:i + 1], torch.tensor([draws[i]]))[0])
        if probs[i, draws[i]] > 0 and outside <= cdf_tol:  # a neighbouring interval the tolerance can reach
            out.findings.append(Finding(Verdict.BENIGN_TIE, "sampling", rid, step, node=i,
                                        message=f"draw {draws[i]} vs {e} at a CDF edge (uniform {float(u[i]):.9g}, "
                                                f"{outside:.3g} outside its interval <= {cdf_tol:g})"))
            continue
        if explained(i, d, outside, f"draw {d} vs {e} (uniform {float(u[i]):.9g})"):
            continue
        if first_bad is None:
            first_bad = (i, e)
    if first_bad is not None:
        i, e = first_bad
        fail("sampling", f"engine drew {draws[i]} at node {i} with uniform {float(u[i]):.9g}; a lossless sampler draws "
             f"{e} there (p = {float(probs[i, draws[i]]):.4g} vs {float(probs[i, e]):.4g})", node=i,
             engine=draws[i], expected=e, uniform=float(u[i]))


def _check_support(s: StepRow, tree: Tree, probs: torch.Tensor, req: SampledRequest, known_d: list[int],
                   known_u: list[int], path_nodes: list[int], draws: list[int | None], fail: Callable[..., None],
                   explained: Callable[[int, int, float, str], bool]) -> None:
    """Draws, accepted tokens and the bonus inside the sampling distribution's support (or, in the engine's
    dtype, as near its edge as rounding explains)."""

    def outside(node: int, token: int, what: str) -> bool:
        return bool(probs[node, token] <= 0) and not explained(node, token, 0.0, what)

    for i in known_d:
        if i not in known_u and outside(i, int(s.node_draws[i]), f"draw {draws[i]} outside the support"):
            fail("sampling", f"engine drew {draws[i]} at node {i}, a token outside the sampling distribution's support "
                 f"(top-k {req.sampling.top_k}, top-p {req.sampling.top_p:g})", node=i, engine=draws[i])
            break
    # tokens the engine emitted must be possible under their parent's distribution
    for parent, child in zip(path_nodes, path_nodes[1:]):
        tok = int(tree.tokens[child])
        if outside(parent, tok, f"accepted token {tok} outside the support"):
            fail("sampling", f"accepted token {tok} (node {child}) has probability 0 at its parent {parent} under "
                 f"top-k {req.sampling.top_k} / top-p {req.sampling.top_p:g}", node=child, token=tok)
            break
    if path_nodes and 0 <= s.bonus < probs.shape[1] and outside(path_nodes[-1], s.bonus, f"bonus {s.bonus} outside the support"):
        fail("sampling", f"bonus {s.bonus} has probability 0 at node {path_nodes[-1]}", node=path_nodes[-1], token=s.bonus)


def _check_walk(s: StepRow, tree: Tree, draws: list[int | None], path_nodes: list[int], out: StepReplay,
                fail: Callable[..., None]) -> None:
    """The walk the draws give against the engine's accepted path, and the bonus against the last draw."""
    n = tree.num_nodes
    # the walk the draws give, against the engine's
    children = [tree.children(i) for i in range(n)]
    walk, cur = [0], 0
    while True:
        d = draws[cur]
        if d is None:
            out.exact = False
            break
        nxt = children[cur].get(d)
        if nxt is None:
            break
        walk.append(nxt)
        cur = nxt
    if out.exact and walk != list(s.accepted):
        j = next((k for k, (a, b) in enumerate(zip(walk, s.accepted)) if a != b), min(len(walk), len(s.accepted)))
        node = walk[j - 1] if j > 0 else 0
        fail("accepted_path", f"engine accepted {list(s.accepted)}, following each node's draw gives {walk} "
             f"(first difference after node {node})", node=node, engine=list(s.accepted), reference=walk)
    elif not out.exact and list(s.accepted[: len(walk)]) != walk:
        fail("accepted_path", f"engine accepted {list(s.accepted)}, the exposed draws give {walk} up to node {walk[-1]}",
             node=walk[-1], engine=list(s.accepted), reference=walk)
    if path_nodes:
        last = path_nodes[-1]
        if draws[last] is None:
            out.exact = False
        elif s.bonus != draws[last]:
            fail("bonus", f"bonus {s.bonus} but the draw at the last accepted node {last} is {draws[last]}", node=last,
                 engine=s.bonus, expected=draws[last])


def _check_children_first(rid: str, s: StepRow, tree: Tree, probs: torch.Tensor, req: SampledRequest, cdf_tol: float,
                          path_nodes: list[int], out: StepReplay, fail: Callable[..., None],
                          explained_dev: Callable[[int, float, str], bool], logp: torch.Tensor | None) -> None:
    """The engine's path and bonus under the children-first rule (module docstring): at each path node, the
    token that came out against what the node's uniform (and the step's residual uniform) draw."""
    r = s.residual_uniform
    for j, node in enumerate(path_nodes):
        last = j + 1 == len(path_nodes)
        u = s.node_uniforms[node] if node < len(s.node_uniforms) else float("nan")
        if u != u or (last and r != r):
            out.exact = False  # the engine did not expose what this node's draw used
            return
        kids = sorted(tree.children(node).values())  # sibling order: increasing node index
        kid_tokens = [int(tree.tokens[c]) for c in kids]
        got = s.bonus if last else int(tree.tokens[path_nodes[j + 1]])
        ru = r if r == r else 0.0
        expect = children_first.draw(probs[node], kid_tokens, u, ru)
        if got == expect:
            continue
        dist = children_first.outside(probs[node], kid_tokens, u, ru, got)
        what = f"{'bonus' if last else 'accepted token'} {got} vs {expect} (uniform {u:.9g}, residual {r:.9g})"
        if dist <= cdf_tol:
            out.findings.append(Finding(Verdict.BENIGN_TIE, "sampling", rid, s.step, node=node,
                                        message=f"{what} at a CDF edge ({dist:.3g} outside <= {cdf_tol:g})"))
            continue
        if logp is not None and explained_dev(node, _children_first_deviation(logp[node], probs[node], kid_tokens, got,
                                                                              u, ru, dist, req.sampling), what):
            continue
        cat = "bonus" if last else "accepted_path"
        fail(cat, f"at node {node} the engine's {what}: the children-first rule draws {expect} there "
             f"(p = {float(probs[node, got]):.4g} vs {float(probs[node, expect]):.4g}; its uniforms lie {dist:.3g} "
             "outside the engine token's interval)", node=node, engine=got, expected=expect, uniform=u, residual=r)
        return


def _children_first_deviation(logp: torch.Tensor, q: torch.Tensor, kid_tokens: list[int], token: int, u: float,
                              ru: float, dist: float, sp: Sampling) -> float:
    """How far (log-prob units) a node's logits ``logp`` ``[V]`` (sampling distribution ``q`` ``[V]``) would have to
    move for the children-first rule to
    give ``token``: the CDF shift ``T log1p(dist)``, or, where the engine's token or a child lies outside the top-k /
    top-p support (a cut rounding moves), the larger of their support gaps and the CDF shift with them admitted."""
    T = sp.temperature
    shift = T * math.log1p(dist) if math.isfinite(dist) else math.inf
    out_tokens = [t for t in {token, *kid_tokens} if q[t] <= 0]
    if not out_tokens:
        return shift
    gap = max(support_gap(logp, t, sp) for t in out_tokens)
    keep = q > 0
    keep[torch.tensor(out_tokens)] = True
    wide = torch.where(keep, tempered_probs(logp[None], T)[0], torch.zeros_like(q))  # [V]: the support, widened
    wide = wide / wide.sum()
    moved = children_first.outside(wide, kid_tokens, u, ru, token)
    return min(shift, max(gap, T * math.log1p(moved)))


def replay_first_token(rid: str, token: int, probs: torch.Tensor, uniform: float, req: SampledRequest, prompt_len: int,
                       cdf_tol: float) -> tuple[list[Finding], bool]:
    """The draw after the prefill (``probs`` ``[1, V]``): findings, and whether it was judged exactly. Without a
    recorded uniform (NaN: a sampled capture that did not take the prefill, or an engine that does not expose it)
    the draw is judged from the keyed generator's uniform where that is recomputable, and not exactly otherwise."""
    found: list[Finding] = []
    if probs[0, token] <= 0:
        found.append(Finding(Verdict.FAIL, "sampling", rid, -1, message=f"first token {token} has probability 0"))
    if uniform != uniform and not req.recomputable:
        return found, False
    if req.recomputable:
        keyed = float(req.keyed(-1, [prompt_len])[0])
        uniform = keyed if uniform != uniform else uniform
        if keyed != uniform:
            found.append(Finding(Verdict.FAIL, "sampling", rid, -1, message=f"first uniform {uniform!r} is not the keyed "
                                 f"generator's {keyed!r}"))
    u = torch.tensor([uniform], dtype=torch.float64)
    e = int(inverse_cdf(probs, u)[0])
    if e != token:
        outside = -float(boundary_margin(probs, u, torch.tensor([token]))[0])  # see replay_sampled_step
        if probs[0, token] > 0 and outside <= cdf_tol:
            found.append(Finding(Verdict.BENIGN_TIE, "sampling", rid, -1, message=f"first token {token} vs {e} at a CDF edge"))
        else:
            found.append(Finding(Verdict.FAIL, "sampling", rid, -1, message=f"first token {token} with uniform "
                                 f"{uniform:.9g}; a lossless sampler draws {e}", details={"engine": token, "expected": e}))
    return found, True


def cdf_tolerance(logprob_abs: float, temperature: float) -> float:
    """How far a CDF edge may move when every log-prob is within ``logprob_abs``: tempering divides log-prob
    errors by T, and sum |dp| <= max |d log p| (to first order)."""
    return math.expm1(logprob_abs / temperature)
