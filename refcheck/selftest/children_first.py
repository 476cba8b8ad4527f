"""A children-first engine in the reference decoder, and the faults such an engine can have.

Contract: :class:`ChildrenFirstEngine` decodes like SGLang's target-only tree sampler
(:mod:`ddtree_reference.children_first`): every node has its own uniform (the "coins"), the walk tries a
node's children in sibling order against the running sum of their target probabilities, and the bonus
is drawn with the step's residual uniform from the target with the rejected children removed. Its
random numbers are refcheck's Philox under counter words of their own (:data:`DOMAIN_COIN`,
:data:`DOMAIN_RESIDUAL`), so that :func:`as_children_first` can write the trace an engine exposing its
coins records (rng ``engine-children-first``: per node the coin, per step the residual uniform, no
draws, no keys). The first token after the prefill is an ordinary inverse-CDF draw, as in SGLang's own
sampler; its uniform is kept in the trace (SGLang's capture cannot expose it, so there the first token
is judged by the distributional test only).

:data:`CHILDREN_FIRST_FAULTS` maps a name to (class, the categories the exact replay may catch it by
first): each subclass changes exactly one step of the rule the way an implementation could get it wrong.
The trace keeps the coins the engine drew, not the ones a faulty rule used, as a capture of the kernel's
inputs would; so every fault shows as a walk or a bonus the recorded coins do not give. At temperature 0
none of them is reached (the greedy walk never samples).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ddtree_reference import children_first
from ddtree_reference.decode import DDTreeDecoder
from ddtree_reference.sampling import Sampling, inverse_cdf, keyed_uniforms, tempered_probs
from ddtree_reference.tree import Tree
from refcheck.diff.sampling import CHILDREN_FIRST
from refcheck.selftest.sampling_faults import SELFTEST_SAMPLING
from refcheck.trace.io import Trace

#: the counters' last word for this engine's numbers (ddtree_reference.sampling uses 1-3)
DOMAIN_COIN, DOMAIN_RESIDUAL = 4, 5
#: flat sampling, under which second and later children carry mass: the running-sum fault acts within 2 built-in
#: prompts x 24 tokens on the hybrid pair (measured: at T = 0.7 / top-p 0.9 it did not, at T = 1.5 it does); the
#: other faults are tested at SELFTEST_SAMPLING, where more drafts are accepted (the reused coin needs two in a row)
FLAT_SAMPLING = Sampling(temperature=1.5, top_k=0, top_p=1.0, seed=20)


def coins(s: Sampling, request: int, step: int, n: int) -> torch.Tensor:
    """The engine's uniform at each of a step's ``n`` nodes: ``[n]`` float64."""
    return keyed_uniforms(s.seed, [[request & 0xFFFFFFFF, step + 1, i, DOMAIN_COIN] for i in range(n)])


def residual(s: Sampling, request: int, step: int) -> float:
    """The engine's residual uniform of a step (the bonus's, when every child is rejected)."""
    return float(keyed_uniforms(s.seed, [[request & 0xFFFFFFFF, step + 1, 0, DOMAIN_RESIDUAL]])[0])


class ChildrenFirstEngine(DDTreeDecoder):
    """The reference decoder sampling with the children-first rule (module docstring)."""

    def node_uniforms(self, request: int, step: int, positions: list[int]) -> torch.Tensor:
        if step < 0:  # the prefill's draw: SGLang's own sampler, an inverse CDF
            return super().node_uniforms(request, step, positions)
        self._key = (request, step)
        return coins(self.cfg.sampling, request, step, len(positions))

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        self._probs = probs.cpu()  # the walk below needs the distributions; the draws are not what it uses
        return super().draw(probs, uniforms)

    def sample_walk(self, tree: Tree, draws: torch.Tensor, uniforms: torch.Tensor, draft_lp: torch.Tensor) -> list[int]:
        r = residual(self.cfg.sampling, *self._key)
        tokens = tree.tokens.tolist()
        path, cur = [0], 0
        while True:
            kids = sorted(tree.children(cur).values())  # sibling order: increasing node index
            j = self.accept(self._probs[cur], [tokens[c] for c in kids], float(uniforms[path[self.coin_node(len(path))]]))
            if j is None:
                self._bonus = self.residual_draw(self._probs[cur], [tokens[c] for c in kids], r)
                return path
            cur = kids[j]
            path.append(cur)

    def bonus_token(self, logits: torch.Tensor, probs: torch.Tensor, draws: torch.Tensor, uniforms: torch.Tensor,
                    node: int) -> int:
        return self._bonus

    # -- the rule's steps (the faults override one each) ---------------------------------------------
    def coin_node(self, depth: int) -> int:
        """Which path node's coin decides at the path's ``depth``-th node (its own: the last)."""
        return depth - 1

    def accept(self, q: torch.Tensor, kid_tokens: list[int], u: float) -> int | None:
        """The sibling index of the accepted child, or None when every child is rejected."""
        acc = 0.0
        for j, t in enumerate(kid_tokens):
            acc += float(q[t])
            if u <= acc:
                return j
        return None

    def residual_draw(self, q: torch.Tensor, kid_tokens: list[int], r: float) -> int:
        """The bonus after every child is rejected."""
        return children_first.bonus(q, kid_tokens, r)


class CoinPerChild(ChildrenFirstEngine):
    """Each child is accepted when the coin is below its own probability (no running sum over siblings):
    later siblings are under-accepted, the "draft prob > u" family of rules."""

    def accept(self, q: torch.Tensor, kid_tokens: list[int], u: float) -> int | None:
        return next((j for j, t in enumerate(kid_tokens) if u <= float(q[t])), None)


class ResidualKeepsChildren(ChildrenFirstEngine):
    """The bonus is drawn from the whole target, rejected children included."""

    def residual_draw(self, q: torch.Tensor, kid_tokens: list[int], r: float) -> int:
        return int(inverse_cdf(q[None], torch.tensor([r], dtype=torch.float64))[0])


class CoinReused(ChildrenFirstEngine):
    """The root's coin decides at every depth: one walk's decisions are not independent."""

    def coin_node(self, depth: int) -> int:
        return 0


class ResidualGreedy(ChildrenFirstEngine):
    """The bonus is the argmax of the residual distribution instead of a draw from it."""

    def residual_draw(self, q: torch.Tensor, kid_tokens: list[int], r: float) -> int:
        return int(children_first.residual(q, kid_tokens).argmax())


class TemperatureTwiceCF(ChildrenFirstEngine):
    """Logits divided by T twice (effective temperature T**2) before the walk."""

    def sample_probs(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.cfg.sampling
        return tempered_probs(logits / s.temperature, s.temperature, s.top_k, s.top_p)


WALK = ("accepted_path", "bonus")  # a wrong child, or stopping where a child was due (its bonus then differs)
#: name -> (class, the categories that may catch it first, the sampling its test runs at)
CHILDREN_FIRST_FAULTS: dict[str, tuple[type[ChildrenFirstEngine], tuple[str, ...], Sampling]] = {
    "cf-coin-per-child": (CoinPerChild, WALK, FLAT_SAMPLING),
    # sampling: a rejected child's token as the bonus
    "cf-residual-keeps-children": (ResidualKeepsChildren, ("bonus", "sampling"), SELFTEST_SAMPLING),
    "cf-coin-reused": (CoinReused, WALK, SELFTEST_SAMPLING),
    "cf-residual-greedy": (ResidualGreedy, ("bonus",), SELFTEST_SAMPLING),
    "cf-temperature-twice": (TemperatureTwiceCF, WALK + ("sampling",), SELFTEST_SAMPLING),  # sampling: outside top-p
}


def as_children_first(trace: Trace, sampling: Sampling) -> Trace:
    """The trace of a :class:`ChildrenFirstEngine` run as an engine exposing its coins records it: every
    sampled request's rng ``engine-children-first`` with no keys (its first uniform kept), and every step's
    uniforms the coins and its residual uniform, with no draws."""
    keys = {r.request_id: r.rng_request for r in trace.requests if r.sampled}
    requests = [replace(r, rng=CHILDREN_FIRST, seed=-1, rng_request=-1) if r.sampled else r
                for r in trace.requests]
    steps = [replace(s, node_draws=[], residual_uniform=residual(sampling, keys[s.request_id], s.step))
             if s.request_id in keys else s for s in trace.steps]
    return Trace(dict(trace.provenance), requests, steps, trace.schema_version, trace.checksummed)
