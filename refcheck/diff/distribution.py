"""The distributional lossless test at temperature > 0, for engines whose randomness is hidden.

Contract: :class:`Evidence` collects, from a replay, (a) for every emitted token the reference's
sampling distribution at the token's prefix (``[V]`` float64) and the token, turned at once into a
**randomized probability-integral transform** ``v = F(<tok) + w * p(tok)``, tokens ordered by
descending probability (ties: lower id first) and ``w`` a keyed uniform (:data:`PIT_SEED`, so the
verdict is reproducible); and (b) for every node the walk consulted, whether it continued to a
child, with the probability ``a = sum over children c of p(c)`` that a lossless sampler does.

Under losslessness every emitted token is a draw from its prefix's distribution, so the ``v`` are
i.i.d. U(0, 1) whatever the prompts (the Rosenblatt transform), and each continuation is a
Bernoulli(a) given the past. :func:`judge` tests five consequences, each two-sided:

1. ``mean``: ``sum Phi^-1(v) / sqrt(n)`` ~ N(0, 1) (a sharper or flatter distribution, argmax,
   greedy bonus move it);
2. ``ks``: Kolmogorov-Smirnov distance of the ``v`` from U(0, 1) (asymptotic, Stephens' correction);
3. ``serial``: ``12 sum (v_t - 1/2)(v_t+1 - 1/2) / sqrt(m)`` over the m consecutive pairs of a
   request's tokens ~ N(0, 1) (bounded, uncorrelated summands of variance 1/144; one random number
   reused along a walk correlates consecutive tokens);
4. ``serial_id``: the same on the PIT in token-id order (the order inverse-CDF samplers draw in:
   a uniform reused along a walk puts consecutive tokens in the same region of their id-order CDFs);
5. ``acceptance``: ``sum (o - a) / sqrt(sum a (1 - a))`` ~ N(0, 1) (martingale CLT); per depth too
   (reported, not tested separately).

The verdict's p-value is Bonferroni over the five (``min(1, 5 min p_i)``): FAIL when it is below
``alpha``; else PASS if the sample reaches the stated power, else INCONCLUSIVE. The stated power is
``power`` against a shift of ``effect`` in the mean of ``Phi^-1(v)`` (test 1 at level alpha / 5):
``n_required = ((z(1 - alpha / 10) + z(power)) / effect) ** 2`` tokens. A token of probability 0 is
an exact failure, counted in ``impossible``. Numbers: docs/sampling.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

import torch

from ddtree_reference.sampling import DOMAIN_PIT, keyed_uniforms

PIT_SEED = 0x70_17_5EED  # fixed: the test's own randomisation, independent of any engine's seed
ALPHA = 1e-3
POWER = 0.9
EFFECT = 0.2  # in standard deviations of Phi^-1(v)
COMPONENTS = ("mean", "ks", "serial", "serial_id", "acceptance")
_N = NormalDist()
_CLIP = 1e-12  # keeps Phi^-1 finite at v = 0 (probability 0 under the null)


def n_required(alpha: float = ALPHA, power: float = POWER, effect: float = EFFECT) -> int:
    """Tokens the mean test needs for ``power`` against ``effect`` at level ``alpha`` / 4, two-sided."""
    z = _N.inv_cdf(1 - alpha / (2 * len(COMPONENTS))) + _N.inv_cdf(power)
    return math.ceil((z / effect) ** 2)


def pit_values(probs: torch.Tensor, tokens: torch.Tensor, w: torch.Tensor, order: str = "desc") -> torch.Tensor:
    """Randomized PIT of ``tokens`` ``[n]`` under ``probs`` ``[n, V]`` with randomisation ``w`` ``[n]``:
    ``[n]`` float64. ``order``: "desc" = descending probability (ties: lower id first); "id" = token-id
    order, the order inverse-CDF samplers draw in (ddtree_reference.sampling.inverse_cdf)."""
    p = probs.to(torch.float64)  # the PIT is exact only with float64 sums (see ddtree_reference.sampling)
    pt = p.gather(1, tokens[:, None])  # [n, 1]
    ids = torch.arange(p.shape[1])[None, :]  # [1, V]
    if order == "id":
        before = ids < tokens[:, None]  # [n, V]
    else:
        before = (p > pt) | ((p == pt) & (ids < tokens[:, None]))  # [n, V]
    return (p * before).sum(dim=1) + w.to(torch.float64) * pt[:, 0]


def pit_value(probs: torch.Tensor, token: int, w: float, order: str = "desc") -> float:
    """:func:`pit_values` of one token under ``probs`` ``[V]``."""
    return float(pit_values(probs[None], torch.tensor([token]), torch.tensor([w]), order)[0])


@dataclass(slots=True)
class Evidence:
    pits: dict[str, list[float]] = field(default_factory=dict)  # request -> v per emitted token, in order
    pits_id: dict[str, list[float]] = field(default_factory=dict)  # the same tokens' PIT in token-id order
    walks: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)  # request -> (depth, a, outcome)
    impossible_by_request: dict[str, int] = field(default_factory=dict)  # emitted tokens of probability 0
    hidden_requests: int = 0  # sampled requests whose walk could not be replayed exactly

    @property
    def impossible(self) -> int:
        return sum(self.impossible_by_request.values())

    def add_token(self, rid: str, probs: torch.Tensor, token: int) -> None:
        """One emitted token of request ``rid`` and its distribution ``[V]`` (tokens in output order)."""
        seq = self.pits.setdefault(rid, [])
        if probs[token] <= 0:
            self.impossible_by_request[rid] = self.impossible_by_request.get(rid, 0) + 1
            return
        ordinal = list(self.pits).index(rid)  # the request's word of the randomisation: distinct per request
        w = float(keyed_uniforms(PIT_SEED, [[ordinal, len(seq), 0, DOMAIN_PIT]])[0])
        seq.append(pit_value(probs, token, w))
        self.pits_id.setdefault(rid, []).append(pit_value(probs, token, w, "id"))

    def add_walk(self, rid: str, depth: int, continued: bool, a: float) -> None:
        """One node the walk of request ``rid`` consulted: did it continue to a child (probability ``a``)?"""
        self.walks.setdefault(rid, []).append((depth, float(a), int(continued)))

    @property
    def accept(self) -> list[tuple[int, float, int]]:
        return [x for v in self.walks.values() for x in v]

    def first_requests(self, k: int) -> Evidence:
        """The evidence of the first ``k`` requests (in the order they were added): a smaller sample."""
        keep = list(dict.fromkeys([*self.pits, *self.walks]))[:k]
        return Evidence({r: self.pits[r] for r in keep if r in self.pits},
                        {r: self.pits_id[r] for r in keep if r in self.pits_id},
                        {r: self.walks[r] for r in keep if r in self.walks},
                        {r: self.impossible_by_request[r] for r in keep if r in self.impossible_by_request})

    def merge(self, other: Evidence) -> None:
        for k, v in other.pits.items():
            self.pits.setdefault(k, []).extend(v)
        for k, v in other.pits_id.items():
            self.pits_id.setdefault(k, []).extend(v)
        for k, w in other.walks.items():
            self.walks.setdefault(k, []).extend(w)
        for k, c in other.impossible_by_request.items():
            self.impossible_by_request[k] = self.impossible_by_request.get(k, 0) + c
        self.hidden_requests += other.hidden_requests

    @property
    def n_tokens(self) -> int:
        return sum(len(v) for v in self.pits.values())


@dataclass(slots=True)
class DistributionVerdict:
    verdict: str  # "pass" | "fail" | "inconclusive"
    p_value: float
    p_values: dict[str, float]
    n_tokens: int
    n_walk_nodes: int
    n_required: int
    alpha: float
    power: float
    effect: float
    impossible: int
    statistics: dict[str, float]
    per_depth: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _two_sided(z: float) -> float:
    return 2 * (1 - _N.cdf(abs(z))) if math.isfinite(z) else 0.0


def _ks_pvalue(v: list[float]) -> tuple[float, float]:
    n = len(v)
    s = sorted(v)
    d = max(max((i + 1) / n - x for i, x in enumerate(s)), max(x - i / n for i, x in enumerate(s)))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def _z(v: float) -> float:
    return _N.inv_cdf(min(max(v, _CLIP), 1 - _CLIP))


def judge(ev: Evidence, alpha: float = ALPHA, power: float = POWER, effect: float = EFFECT) -> DistributionVerdict:
    """The verdict over all collected evidence (module docstring)."""
    seqs = [[_z(x) for x in v] for v in ev.pits.values()]
    flat = [x for s in seqs for x in s]
    n = len(flat)
    stats: dict[str, float] = {}
    pv: dict[str, float] = {}
    if n:
        stats["z_mean"] = sum(flat) / math.sqrt(n)
        pv["mean"] = _two_sided(stats["z_mean"])
        stats["ks_d"], pv["ks"] = _ks_pvalue([x for v in ev.pits.values() for x in v])
        for name, pits in (("serial", ev.pits), ("serial_id", ev.pits_id)):
            pairs = [(a - 0.5) * (b - 0.5) for v in pits.values() for a, b in zip(v, v[1:])]
            if pairs:
                stats[f"z_{name}"] = 12 * sum(pairs) / math.sqrt(len(pairs))
                pv[name] = _two_sided(stats[f"z_{name}"])
    accept = ev.accept
    var = sum(a * (1 - a) for _, a, _ in accept)
    if var > 0:
        stats["z_acceptance"] = sum(o - a for _, a, o in accept) / math.sqrt(var)
        pv["acceptance"] = _two_sided(stats["z_acceptance"])
    depths: dict[int, list[tuple[float, int]]] = {}
    for d, a, o in accept:
        depths.setdefault(d, []).append((a, o))
    per_depth = []
    for d in sorted(depths):
        rows = depths[d]
        va = sum(a * (1 - a) for a, _ in rows)
        per_depth.append({"depth": d, "nodes": len(rows), "continued": sum(o for _, o in rows),
                          "expected": round(sum(a for a, _ in rows), 3),
                          "z": round(sum(o - a for a, o in rows) / math.sqrt(va), 3) if va > 0 else None})
    p = min(1.0, len(COMPONENTS) * min(pv.values())) if pv else 1.0
    need = n_required(alpha, power, effect)
    if ev.impossible or p < alpha:
        verdict = "fail"
        p = 0.0 if ev.impossible else p
    else:
        verdict = "pass" if n >= need else "inconclusive"
    return DistributionVerdict(verdict, p, pv, n, len(accept), need, alpha, power, effect, ev.impossible, stats,
                               per_depth)
