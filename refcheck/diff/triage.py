"""Triage rules for replay findings, and the rounding ensemble behind the ill-conditioned-node rule.

Contract: :class:`Triage` says which opt-in rules a diff applies (both off by default; a finding
they move is reported TRIAGED with its evidence, never dropped):

* ``isolated``: a node whose log-probs deviate while its argmax and every descendant agree
  (rounding at that node; applied in :mod:`refcheck.diff.replay`).
* ``ill_conditioned``: a node whose deviation the engine's own dtype can produce. The
  :class:`RoundingEnsemble` recomputes the step (prefill of the committed tokens, then the tree) in
  float32 ``samples`` times with every ``nn.Linear`` output of the target multiplied by
  ``1 + u*U(-1, 1)``, ``u`` the engine dtype's unit roundoff (bf16 2^-8): the size of one rounding
  of each stored activation, the error a correct engine in that dtype commits. A node's *spread* is
  the largest change of its log-probs (at the engine's top-k ids) over the samples; an over-tolerance
  node is triaged when the engine's deviation is at most ``factor`` x its spread, an argmax flip
  when the reference's margin is at most ``factor`` x the largest change of that margin. Well-
  conditioned nodes move by ~0.1 nat under bf16 noise; a wrong state, mask or position moves
  log-probs by whole nats at nodes that noise leaves alone, so it is not triaged (the leak goldens
  still fail under the rule). Measured on the H200 trace of SGLang's DDTree at budget 64 (code-1
  step 13 node 32): the layer-0 Gated DeltaNet core output there is 68x smaller than its peers, the
  gated RMSNorm scales its rounding up, and the ensemble moves the node's log-probs by 5.4 nats
  against a median of 0.07; the engine's deviation is 6.4.

The ensemble is seeded (``seed``): the same trace gives the same verdicts.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from reference.target import Target

#: unit roundoff (half the machine epsilon) of the engine dtypes refcheck diffs
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


@dataclass(frozen=True, slots=True)
class Triage:
    isolated: bool = False
    ill_conditioned: bool = False
    samples: int = 8
    factor: float = 2.0
    seed: int = 0

    @property
    def any(self) -> bool:
        return self.isolated or self.ill_conditioned

    def covers(self, deviation: float, spread: float) -> bool:
        """The ill-conditioned rule: a deviation within ``factor`` x the node's rounding spread."""
        return deviation <= self.factor * spread

    def union(self, other: Triage) -> Triage:
        """Every rule either side applies (the sampling settings are this side's)."""
        return replace(self, isolated=self.isolated or other.isolated,
                       ill_conditioned=self.ill_conditioned or other.ill_conditioned)


@contextmanager
def rounding_noise(target: Target, unit_roundoff: float, generator: torch.Generator):
    """Every ``nn.Linear`` output of the target is multiplied by ``1 + u*U(-1, 1)`` while active."""

    def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(out.shape, generator=generator, device=out.device, dtype=torch.float32)
        return out * (1.0 + unit_roundoff * (2.0 * noise - 1.0)).to(out.dtype)

    handles = [m.register_forward_hook(hook) for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class RoundingEnsemble:
    """Log-probs of one step's tree under independent rounding-noise samples ([samples, N, c] at ``cols``)."""

    def __init__(self, target: Target, dtype: str, triage: Triage) -> None:
        if dtype not in UNIT_ROUNDOFF:
            raise ValueError(f"no unit roundoff known for engine dtype {dtype!r}")
        self.target, self.u, self.triage = target, UNIT_ROUNDOFF[dtype], triage

    @torch.no_grad()
    def sample(self, committed: list[int], tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
               cols: torch.Tensor) -> torch.Tensor:
        dev = self.target.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(self.triage.seed)
        cols = cols.to(dev)
        out = []
        with rounding_noise(self.target, self.u, gen):
            for _ in range(self.triage.samples):
                state, _ = self.target.prefill(torch.tensor(committed, device=dev))
                logits = self.target.forward(state, tokens.to(dev), parents.to(dev), depths.to(dev)).logits
                out.append(torch.log_softmax(logits.float(), dim=-1).gather(1, cols).cpu())  # [N, c]
        return torch.stack(out)  # [samples, N, c]


def topk_spread(samples: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``samples`` [S, N, c] and ``ref`` [N, c] log-probs -> [N]: the largest change of a node's values."""
    return (samples - ref[None]).abs().amax(dim=(0, 2))


@dataclass(slots=True)
class StepSpread:
    """What the ensemble says about one step: per-node top-k spread and per-node margin spread."""

    topk: torch.Tensor  # [N] max over samples and the engine's top-k ids of |logp_s - logp_ref|
    margin: torch.Tensor  # [N] max over samples of |margin_s - margin_ref| (reference argmax vs engine argmax)
    median_topk: float

    @classmethod
    def of(cls, samples: torch.Tensor, ref: torch.Tensor, k: int) -> StepSpread:
        """``samples`` [S, N, k+2] and ``ref`` [N, k+2]: columns = the engine's top-k ids, then the
        reference's argmax, then the engine's argmax."""
        topk = topk_spread(samples[:, :, :k], ref[:, :k])  # [N]
        m_ref = ref[:, k] - ref[:, k + 1]  # [N]
        m_s = samples[:, :, k] - samples[:, :, k + 1]  # [S, N]
        margin = (m_s - m_ref[None]).abs().amax(dim=0)  # [N]
        return cls(topk, margin, float(topk.median()))
