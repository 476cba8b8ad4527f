"""The temperature check at T > 0: do the draws that differ from the reference's lean to one temperature?

Contract: for every node draw whose uniform ``u`` is known (the exact replay's draws:
:mod:`refcheck.diff.sampling`, inverse CDF in token-id order), :func:`draw_lean` says which way the
sampling temperature would have to move for the reference's distribution to draw the engine's token with
``u``: ``None`` when the reference draws that token itself (no evidence), ``+1`` when a higher temperature
does, ``-1`` a lower one, ``0`` when no small change of temperature does (the token lies outside the
top-k / top-p support, or its CDF edge does not move with the temperature). The direction is the sign of
the derivative of the CDF edge the token's interval must move across: with ``b = 1 / T`` and ``l`` the
reference's log-probs, ``dp_j / db = p_j (l_j - E_p[l])`` over the support, so the edge ``F(<d)`` (a draw
of a later token ``d``; it must fall below ``u``) or ``F(<=d)`` (an earlier one; it must rise above ``u``)
moves at the rate of the partial sum of ``dp / db``.

In the engine's own dtype each such draw may be a deviation the node's rounding explains
(docs/calibration.md), and the exact replay holds it to that, draw by draw. Rounding is unbiased to first
order, a temperature error is not: a correct engine's changed draws lean either way with about the same
probability, a sampler at the wrong temperature moves them all to its side. :class:`Leans` collects the draws' leans
per verify step (the first draw after the prefill is a step of its own); a step votes with the sign of
the sum of its draws' leans (its nodes share the step's prefix, and siblings share a uniform, so a step
is the unit whose votes are independent). :func:`judge_leans` is a two-sided sign test over the steps'
votes with a **slack**: under a correct engine the probability ``q`` that a voting step leans higher is
taken to lie anywhere in ``[1/2 - SLACK, 1/2 + SLACK]`` (rounding's second-order effect, logits whose
spread noise widens, sharpens a little: a bias within the slack is not a finding), and the p-value is
``min(1, 2 min(P[Bin(n, 1/2 + SLACK) >= higher], P[Bin(n, 1/2 + SLACK) >= lower]))``, at most ``alpha``
under every such ``q``; FAIL below :data:`ALPHA`. Numbers: docs/sampling.md.

This module never imports runners.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ddtree_reference.sampling import inverse_cdf
from refcheck.trace.io import Trace

ALPHA = 1e-3
#: how far from 1/2 a correct engine's chance of a higher-leaning step may lie (a lean of up to 60 / 40)
SLACK = 0.1


def draw_lean(logp: torch.Tensor, probs: torch.Tensor, u: float, token: int) -> int | None:
    """Which way the temperature would have to move for the reference's distribution at a node (log-probs
    ``logp`` ``[V]``, sampling distribution ``probs`` ``[V]`` float64) to draw ``token`` with the uniform
    ``u`` (module docstring): None, +1, -1 or 0."""
    p = probs.to(torch.float64)
    drawn = int(inverse_cdf(p[None], torch.tensor([u], dtype=torch.float64))[0])
    return None if drawn == token else _lean(logp, p, drawn, token)


def _lean(logp: torch.Tensor, p: torch.Tensor, drawn: int, token: int) -> int:
    """:func:`draw_lean` of a node whose reference draw ``drawn`` is not ``token``."""
    if p[token] <= 0:
        return 0  # outside the support: a cut, not an edge (the exact replay judges it)
    inside = p > 0
    lp = torch.where(inside, logp.to(torch.float64), torch.zeros_like(p))  # [V]: the log-probs on the support
    rate = p * (lp - float((p * lp).sum()))  # [V]: dp / d(1/T)
    # a later token: F(<token) must fall below u; an earlier one: F(<=token) must rise above it
    edge_rate = float(rate[:token].sum()) if token > drawn else -float(rate[: token + 1].sum())
    if edge_rate == 0.0 or not math.isfinite(edge_rate):
        return 0
    return 1 if edge_rate > 0 else -1  # the edge falls as 1/T falls: a higher temperature


def node_leans(logp: torch.Tensor, probs: torch.Tensor, uniforms: list[float], tokens: list[int]) -> list[int | None]:
    """:func:`draw_lean` of each of ``k`` nodes: log-probs ``logp`` ``[k, V]``, sampling distributions ``probs``
    ``[k, V]`` float64, their uniforms and the engine's tokens."""
    if not tokens:
        return []
    p = probs.to(torch.float64)
    drawn = inverse_cdf(p, torch.tensor(uniforms, dtype=torch.float64)).tolist()  # [k]
    return [None if e == t else _lean(logp[j], p[j], e, t) for j, (e, t) in enumerate(zip(drawn, tokens))]


@dataclass(slots=True)
class Leans:
    """The draws' leans of a trace, per verify step (module docstring)."""

    #: (request, step) -> the leans of the step's draws that differ from the reference's (step -1: the first token)
    steps: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    keyed_draws: int = 0  # draws with a known uniform that were judged

    def add(self, rid: str, step: int, leans: list[int | None]) -> None:
        """The leans of one step's keyed draws (None: the reference draws the engine's token)."""
        self.keyed_draws += len(leans)
        moved = [x for x in leans if x is not None]
        if moved:
            self.steps.setdefault((rid, step), []).extend(moved)

    def votes(self) -> list[int]:
        """Each step's vote, in the order the steps were added: the sign of its draws' leans (0: none)."""
        return [(s > 0) - (s < 0) for s in (sum(v) for v in self.steps.values())]


@dataclass(slots=True)
class LeanVerdict:
    verdict: str  # "pass" | "fail"
    p_value: float
    higher: int  # steps whose changed draws lean to a higher temperature
    lower: int  # ... to a lower one
    even: int  # steps with changed draws whose leans cancel (or explain no temperature)
    draws_higher: int  # changed draws a higher temperature explains
    draws_lower: int
    draws_neither: int  # changed draws no small change of temperature explains
    keyed_draws: int
    alpha: float
    slack: float
    #: emitted tokens (requests in order, steps in order) after which the running test first fails; None if never
    fails_after_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def side(self) -> str:
        return "higher" if self.higher > self.lower else "lower"


def binomial_tail(n: int, k: int, q: float) -> float:
    """``P[Bin(n, q) >= k]`` (exact, summed in log space)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    lq, lr = math.log(q), math.log1p(-q)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lq + (n - i) * lr
             for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def lean_p_value(higher: int, lower: int, slack: float = SLACK) -> float:
    """The two-sided p-value of ``higher`` vs ``lower`` voting steps under a correct engine whose chance of a
    higher vote lies within ``1/2 +- slack`` (module docstring)."""
    n = higher + lower
    q = 0.5 + slack
    return min(1.0, 2 * min(binomial_tail(n, higher, q), binomial_tail(n, lower, q)))


def first_failing_step(leans: Leans, alpha: float = ALPHA, slack: float = SLACK) -> tuple[str, int] | None:
    """The (request, step) whose vote first brings the running sign test below ``alpha`` (steps in the order
    added: requests in order, steps in order), or None."""
    higher = lower = 0
    for key, vote in zip(leans.steps, leans.votes()):
        higher, lower = higher + (vote > 0), lower + (vote < 0)
        if vote and lean_p_value(higher, lower, slack) < alpha:
            return key
    return None


def judge_leans(leans: Leans, alpha: float = ALPHA, slack: float = SLACK,
                emitted_after: dict[tuple[str, int], int] | None = None) -> LeanVerdict:
    """The sign test over the steps' votes (module docstring); ``emitted_after`` (:func:`emitted_after`) gives
    the verdict the emitted tokens after which the running test first fails."""
    votes = leans.votes()
    higher, lower = votes.count(1), votes.count(-1)
    draws = [x for v in leans.steps.values() for x in v]
    p = lean_p_value(higher, lower, slack)
    first = first_failing_step(leans, alpha, slack) if emitted_after is not None and p < alpha else None
    return LeanVerdict("fail" if p < alpha else "pass", p, higher, lower, votes.count(0), draws.count(1),
                       draws.count(-1), draws.count(0), leans.keyed_draws, alpha, slack,
                       None if first is None or emitted_after is None else emitted_after.get(first))


def emitted_after(trace: Trace) -> dict[tuple[str, int], int]:
    """(request, step) -> the tokens the trace's engine has emitted once that step is done, requests in order
    (step -1: the first token after the prefill)."""
    out: dict[tuple[str, int], int] = {}
    done = 0
    for req in trace.requests:
        count = done + (1 if req.output_ids else 0)
        out[(req.request_id, -1)] = count
        last = -1
        for s in trace.steps_of(req.request_id):
            if s.step != last + 1:  # after steps a sampled capture did not record: the step's own place
                count = done + s.committed_len - len(req.prompt_ids) + 1
            count += len(s.emitted)
            out[(req.request_id, s.step)] = count
            last = s.step
        done += len(req.output_ids)
    return out
