"""Faults at temperature > 0: sampled variants of the reference decoder that break losslessness.

Contract: each class overrides exactly one sampling step of :class:`~ddtree_reference.decode.DDTreeDecoder`
(the distribution, the uniforms, the draw, the walk or the bonus) the way a real engine got it
wrong; at temperature 0 none of them changes anything (the greedy path never calls these steps), so
they are tested under :data:`SELFTEST_SAMPLING` (T = 0.7, top-p 0.9: temperature applied twice and
top-p misplaced both show). :data:`SAMPLING_FAULTS` maps a name to (class, the category the exact
replay must catch first when the engine's draws and uniforms are in the trace). With them hidden
(:func:`hide_randomness`), the distributional test must catch each (docs/sampling.md).
:data:`CORPUS_SAMPLING` names the faults the calibration corpus runs at other parameters: the
temperatures 10 % off (``temperature-1.1x``, ``temperature-0.9x``) at T = 1.0, where an engine in bf16
must fail on the temperature check (:mod:`refcheck.diff.temperature`) within 300 emitted tokens.

A uniform shared by *siblings only* is not here: the walk consults one node per depth, so it cannot
change the output (the reference's own "position" keying does exactly that); the fault that does is
one uniform reused along the walk (``uniform-shared``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ddtree_reference.decode import DDTreeDecoder
from ddtree_reference.sampling import Sampling, inverse_cdf, tempered_probs
from ddtree_reference.tree import Tree
from refcheck.trace.io import Trace

SELFTEST_SAMPLING = Sampling(temperature=0.7, top_k=0, top_p=0.9, seed=20)


class ArgmaxAtTemperature(DDTreeDecoder):
    """Every node (and the first token) takes the argmax whatever the temperature."""

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return probs.argmax(dim=-1).cpu()


class TemperatureTwice(DDTreeDecoder):
    """Logits divided by T twice (effective temperature T**2)."""

    def sample_probs(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.cfg.sampling
        return tempered_probs(logits / s.temperature, s.temperature, s.top_k, s.top_p)


class TemperatureScaled(DDTreeDecoder):
    """Samples at the request's temperature times :attr:`factor` (a temperature off by a fixed ratio: a
    config default, a clamp or a unit slip); the tree is still built at the request's temperature."""

    factor: float = 1.0

    def sample_probs(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.cfg.sampling
        return tempered_probs(logits, s.temperature * self.factor, s.top_k, s.top_p)


class TemperatureHigh(TemperatureScaled):
    """Samples at 1.1 x the request's temperature (10 % flatter)."""

    factor = 1.1


class TemperatureLow(TemperatureScaled):
    """Samples at 0.9 x the request's temperature (10 % sharper)."""

    factor = 0.9


class TopPAfterWalk(DDTreeDecoder):
    """Nodes draw without top-p; top-p is applied only when the bonus is drawn, after the walk."""

    def sample_probs(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.cfg.sampling
        return tempered_probs(logits, s.temperature, s.top_k, 1.0)

    def bonus_token(self, logits, probs, draws, uniforms, node) -> int:
        s = self.cfg.sampling
        p = tempered_probs(logits[node:node + 1], s.temperature, s.top_k, s.top_p).cpu()  # [1, V]
        return int(inverse_cdf(p, uniforms[node:node + 1])[0])


class SharedUniform(DDTreeDecoder):
    """One uniform per verify step (the root's), used by every node: the walk's draws are not independent."""

    def node_uniforms(self, request: int, step: int, positions: list[int]) -> torch.Tensor:
        u = super().node_uniforms(request, step, positions[:1])  # [1]
        return u.expand(len(positions)).clone()  # [N]


class DraftProbRule(DDTreeDecoder):
    """Accepts the first child (by rank) whose *draft* probability exceeds the node's uniform, instead of
    following the target's draw (the bonus is still the target's draw at the last accepted node)."""

    def sample_walk(self, tree: Tree, draws, uniforms, draft_lp) -> list[int]:
        acc, cur = [0], 0
        while True:
            nxt = None
            for child in sorted(tree.children(cur).values()):
                d, tok = int(tree.depths[child]), int(tree.tokens[child])
                if math.exp(float(draft_lp[d - 1, tok])) > float(uniforms[cur]):
                    nxt = child
                    break
            if nxt is None:
                return acc
            acc.append(nxt)
            cur = nxt


class BonusGreedy(DDTreeDecoder):
    """The bonus is the argmax at the last accepted node, not its draw."""

    def bonus_token(self, logits, probs, draws, uniforms, node) -> int:
        return int(logits[node].argmax())


#: sampling fault name -> (decoder class, category the exact replay must catch first)
SAMPLING_FAULTS: dict[str, tuple[type[DDTreeDecoder], str]] = {
    "argmax-at-temperature": (ArgmaxAtTemperature, "sampling"),
    "temperature-twice": (TemperatureTwice, "sampling"),
    "temperature-1.1x": (TemperatureHigh, "sampling"),
    "temperature-0.9x": (TemperatureLow, "sampling"),
    "top-p-after-walk": (TopPAfterWalk, "sampling"),
    "uniform-shared": (SharedUniform, "sampling"),
    "draft-prob-rule": (DraftProbRule, "accepted_path"),
    "bonus-greedy": (BonusGreedy, "bonus"),
}


#: the sampling a fault is run at in the calibration corpus (``refcheck calibrate``), where it is not
#: :data:`SELFTEST_SAMPLING`: a temperature off by 10 % at the DDTree paper's T = 1.0
CORPUS_SAMPLING: dict[str, Sampling] = {
    "temperature-1.1x": Sampling(temperature=1.0, seed=SELFTEST_SAMPLING.seed),
    "temperature-0.9x": Sampling(temperature=1.0, seed=SELFTEST_SAMPLING.seed),
}


def hide_randomness(trace: Trace) -> Trace:
    """The same trace as an engine that exposes no randomness would record it: no draws, no uniforms,
    no seed or keys (so only the distributional test can judge its sampling)."""
    requests = [replace(r, seed=-1, rng="", rng_request=-1, first_uniform=float("nan")) for r in trace.requests]
    steps = [replace(s, node_draws=[], node_uniforms=[]) for s in trace.steps]
    return Trace(dict(trace.provenance), requests, steps, trace.schema_version, trace.checksummed)
