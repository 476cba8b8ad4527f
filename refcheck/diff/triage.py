"""The rounding ensemble: how far a *correct* engine in a given dtype can move each compared quantity.

Contract: :class:`RoundingEnsemble` recomputes one replayed step ``samples`` times in the
reference's own precision with every ``nn.Linear`` input and output of the target (and of a DFlash
drafter), and its residual stream after every add, multiplied by ``1 + u*U(-1, 1)``, ``u`` the engine dtype's unit
roundoff (bf16 2^-8, fp16 2^-11): the size of one rounding of each stored activation, the error a
correct engine in that dtype commits: every tensor a GEMM reads (norm outputs, attention and Gated
DeltaNet core outputs, the gated MLP product) and writes is stored rounded, and so is the residual
stream. (Linear outputs alone under-estimate it: on an H200 corpus a bf16 engine's draft log-probs
deviated by up to 3.9x the linear-output-only spread.)
Each sample re-prefills the committed tokens (so rounding accumulates over the prefix as it does in
the engine's carried state; the noisy state after whole 64-token chunks is kept from step to step,
see :class:`RoundingEnsemble`), verifies the step's tree below the last partial chunk in one
forward, re-drafts from that context and commits the engine's accepted path. :class:`StepSpread` holds, per quantity, the largest change over the
samples against the noise-free reference:

* ``topk`` [N]: a node's log-probs at the engine's top-k ids; ``margin`` [N]: the reference's
  argmax-vs-engine-argmax margin;
* ``draft`` [L]: the drafter's log-probs at the engine's draft top-k ids, per depth;
* ``state``: rel L2 of each committed state entry (``kv_k.3``, ``conv.0``, ``rec.0``, ...).

:class:`Rule` is the decision on top: a deviation over the cheap fixed bound is *consistent with
rounding* when it is at most ``factor`` x that spread (the factor and sample count are calibrated by
``refcheck calibrate``; see docs/calibration.md). Whether a consistent deviation is then reported
as triaged is the replay's step-level decision (:mod:`refcheck.diff.replay`): never at a step or
after a step where anything fails outright.

The ensemble is seeded (``seed``): the same trace gives the same verdicts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ddtree_reference.state import TargetState
from ddtree_reference.target import PREFILL_CHUNK, Target

#: unit roundoff (half the machine epsilon) of the engine dtypes refcheck diffs
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


@dataclass(frozen=True, slots=True)
class Rule:
    """The ensemble-backed decision: ``samples`` noisy re-runs, consistent when within ``factor`` x spread."""

    samples: int = 8
    factor: float = 2.0
    seed: int = 0
    #: where a deviation is beyond ``factor`` x the spread of ``samples`` runs, ``escalate`` more runs (the next
    #: seed's stream) join them and it is judged again against the spread over all: the spread of an
    #: ill-conditioned node is heavy-tailed, and 8 runs of one noise stream can miss its tail where 8 of another
    #: do not (one SGLang node on the H200: 3.43 off, spread 2.25 under the CPU stream, < 1.15 under CUDA's)
    escalate: int = 0
    #: ... only for deviations within ``escalate_within`` x ``factor`` x the first spread: further out, the extra
    #: runs would have to widen the spread's maximum that many times over (a fault's usual distance), and the
    #: gate would pay 4x an ensemble at every faulty golden's first failing step for nothing
    escalate_within: float = 4.0
    #: the first ``anchor_steps`` verify steps of every request are judged in full: every node's log-probs and
    #: every committed state entry against ``factor`` x its spread, under the cheap bound too (a fault that
    #: moves a well-conditioned quantity by less than the bound is caught where it first acts)
    anchor_steps: int = 0

    def worth_escalating(self, deviation: float, spread: float) -> bool:
        """Not covered by the first runs' spread, but close enough that more runs could cover it."""
        return self.escalate > 0 and not self.covers(deviation, spread) \
            and self.covers(deviation, spread * self.escalate_within)

    def covers(self, deviation: float, spread: float) -> bool:
        """A deviation within ``factor`` x the quantity's rounding spread (never a NaN or infinite one)."""
        return deviation == deviation and deviation != float("inf") and deviation <= self.factor * spread

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "factor": self.factor, "seed": self.seed, "anchor_steps": self.anchor_steps,
                "escalate": self.escalate, "escalate_within": self.escalate_within}


class NoiseSource:
    """The generator the rounding noise is drawn from, swapped between the parts of a run (see
    :func:`noise_stream`) while the hooks stay in place."""

    __slots__ = ("gen",)

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen


def noise_stream(seed: int, sample: int, part: int) -> torch.Generator:
    """The CPU generator of one part of one noisy run: ``part`` c >= 0 is prefix chunk c (tokens
    [64c, 64c + 64), the reference prefill's own chunking), ``part`` = -1 - L the rest of a run whose
    committed prefix is L tokens long (its last partial chunk, the draft and the step's tree). Keyed,
    not streamed: a run's noise on a chunk does not depend on how many runs, chunks or tokens came
    before it, so a noisy prefix state is the same wherever it is computed and can be kept
    (:class:`RoundingEnsemble`). CPU: the same noise on every device."""
    digest = hashlib.blake2b(f"refcheck-rounding:{seed}:{sample}:{part}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@contextmanager
def rounding_noise(modules: list[torch.nn.Module], unit_roundoff: float, source: torch.Generator | NoiseSource,
                   residual: Sequence[Any] = ()) -> Iterator[NoiseSource]:
    """Every ``nn.Linear`` input and output inside ``modules``, and the residual stream of every object in
    ``residual`` (a :class:`~ddtree_reference.target.Target` or DFlash drafter: its ``residual_rounding``
    hook, after each add), is multiplied by ``1 + u*U(-1, 1)`` while active, the uniforms drawn from
    ``source`` (a CPU generator, or a :class:`NoiseSource` whose generator the caller swaps)."""
    src = source if isinstance(source, NoiseSource) else NoiseSource(source)
    scale, offset = 2.0 * unit_roundoff, 1.0 - unit_roundoff  # 1 + u(2U - 1) = (1 - u) + 2uU, both exact in fp32

    def factor(like: torch.Tensor) -> torch.Tensor:
        # drawn on the CPU (the source's generator is a CPU generator) and moved: the same noise on every
        # device, so a trace replayed on a GPU is judged exactly as in the CPU gate; built in float32 (u = 2^-8
        # is below bf16's own resolution near 1) and cast to the activation's dtype only for the multiply
        noise = torch.rand(like.shape, generator=src.gen, dtype=torch.float32)
        return noise.mul_(scale).add_(offset).to(like.device, like.dtype)

    def perturb(out: torch.Tensor) -> torch.Tensor:
        return out * factor(out)

    def hook(_module: torch.nn.Module, _inputs: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out.mul_(factor(out))  # a linear's output is its own fresh tensor: rounded in place

    def pre_hook(_module: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return (perturb(inputs[0]), *inputs[1:])  # (an input may feed other linears: never in place)

    for owner in residual:
        owner.residual_rounding = perturb

    seen: set[int] = set()
    handles = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, torch.nn.Linear) and id(m) not in seen:
                seen.add(id(m))
                handles.append(m.register_forward_hook(hook))
                handles.append(m.register_forward_pre_hook(pre_hook))
    try:
        yield src
    finally:
        for h in handles:
            h.remove()
        for owner in residual:
            owner.residual_rounding = None


@dataclass(slots=True)
class StepInputs:
    """What one replayed step's ensemble needs: the committed prefix, the engine's tree and path, and
    the columns and entries to measure."""

    committed: list[int]
    tokens: torch.Tensor  # [N]
    parents: torch.Tensor  # [N]
    depths: torch.Tensor  # [N]
    accepted: list[int]
    cols: torch.Tensor  # [N, c] vocabulary ids whose log-probs are measured per node
    draft_ids: torch.Tensor | None  # [L, kd] the engine's draft top-k ids (None: no draft measured)
    state_error: Callable[[TargetState, int], dict[str, float]] | None  # committed state -> rel L2 per entry


@dataclass(slots=True)
class StepSamples:
    node: torch.Tensor  # [S, N, c]
    draft: torch.Tensor | None  # [S, L, kd]
    state: list[dict[str, float]]  # per sample: entry -> rel L2 against the noise-free reference

    def __add__(self, other: StepSamples) -> StepSamples:
        """Both sets of runs as one (the escalated ensemble)."""
        draft = torch.cat([self.draft, other.draft]) if self.draft is not None and other.draft is not None else None
        return StepSamples(torch.cat([self.node, other.node]), draft, self.state + other.state)


@dataclass(slots=True)
class _NoisyPrefix:
    """One noisy run's state after the first ``len(tokens)`` committed tokens (whole prefill chunks), and
    the drafter context of those positions (empty without capture)."""

    tokens: tuple[int, ...]
    state: TargetState
    context: list[torch.Tensor]  # per chunk [64, c*H]


def _below_chain(chain: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The m tokens of ``chain`` as a chain with the tree (``tokens``/``parents``/``depths`` [N]) hung below its
    last token: [m + N] each (the chain's nodes first; with m = 0, the tree as it is)."""
    m = int(chain.shape[0])
    if m == 0:
        return tokens, parents, depths
    tree_parents = torch.where(parents < 0, torch.full_like(parents, m - 1), parents + m)
    return (torch.cat([chain.cpu(), tokens.cpu()]), torch.cat([torch.arange(-1, m - 1), tree_parents.cpu()]),
            torch.cat([torch.arange(m), depths.cpu() + m]))


def _nbytes(prefix: _NoisyPrefix) -> int:
    tensors = [*prefix.state.tensors().values(), *prefix.context]
    return sum(t.numel() * t.element_size() for t in tensors)


class RoundingEnsemble:
    """Noisy re-runs of one step of the reference at an engine dtype's unit roundoff.

    Each run re-prefills the committed prefix in the reference prefill's own 64-token chunks, chunk c
    under the noise of :func:`noise_stream` (seed, run, c), and the rest (the last partial chunk as a
    chain with the step's tree below it, one forward; the draft) under the noise of (seed, run, -1 - L). A run's noisy state after whole
    chunks is therefore a function of its tokens alone: it is kept per (seed, run, capture) for the
    ``keep`` most recent prefixes and extended chunk by chunk at the next step of the request, which
    computes exactly what a fresh prefill would (the same forwards, in the same order, under the same
    noise) at a cost that does not grow with the prefix at every step.
    """

    keep = 2  # kept prefixes per (seed, run, capture): the request being replayed (one at a time), and one more
    max_bytes = 4 << 30  # kept states in all; past it a prefix is recomputed instead (the same result, slower)

    def __init__(self, target: Target, drafter: Any, dtype: str, rule: Rule, capture: tuple[int, ...]) -> None:
        if dtype not in UNIT_ROUNDOFF:
            raise ValueError(f"no unit roundoff known for engine dtype {dtype!r}")
        self.target, self.drafter, self.u, self.rule, self.capture = target, drafter, UNIT_ROUNDOFF[dtype], rule, capture
        self._prefixes: dict[tuple[int, int, tuple[int, ...]], list[_NoisyPrefix]] = {}
        self._bytes = 0

    def _draft(self, context: torch.Tensor, committed: torch.Tensor, bonus: int, ids: torch.Tensor) -> torch.Tensor:
        """The drafter's log-probs at ``ids`` [L, kd] from a fresh context; the replay's own context is restored."""
        d = self.drafter
        saved = (d.ctx_keys, d.ctx_values, d.ctx_len)
        try:
            d.reset()
            d.extend(context, torch.arange(len(committed), device=context.device), committed)
            lp: torch.Tensor = d.propose(bonus, len(committed), ids.shape[0])  # [L, V]
            return lp.gather(1, ids.to(lp.device)).float().cpu()
        finally:
            d.ctx_keys, d.ctx_values, d.ctx_len = saved

    def _chunk(self, state: TargetState, piece: torch.Tensor, capture: tuple[int, ...]) -> tuple[TargetState, torch.Tensor]:
        """One prefill chunk ([m] tokens) as a chain below ``state``, all of it committed (as ``Target.prefill``)."""
        m = int(piece.shape[0])
        fwd = self.target.forward(state, piece, torch.arange(-1, m - 1), torch.arange(m), capture=capture)
        return state.commit(fwd, list(range(m))), fwd.context

    def _prefix(self, committed: list[int], ids: torch.Tensor, seed: int, run: int, capture: tuple[int, ...],
                src: NoiseSource) -> _NoisyPrefix:
        """Run ``run``'s noisy state after the whole chunks of ``committed`` (kept, or extended from the
        longest kept prefix of it)."""
        chunk, whole = PREFILL_CHUNK, len(committed) // PREFILL_CHUNK * PREFILL_CHUNK
        kept = self._prefixes.setdefault((seed, run, capture), [])
        base = max((p for p in kept if len(p.tokens) <= whole and tuple(committed[: len(p.tokens)]) == p.tokens),
                   key=lambda p: len(p.tokens), default=None)
        state = base.state if base is not None else self.target.empty_state()
        context = list(base.context) if base is not None else []
        for lo in range(len(base.tokens) if base is not None else 0, whole, chunk):
            src.gen = noise_stream(seed, run, lo // chunk)
            state, ctx = self._chunk(state, ids[lo : lo + chunk], capture)
            context.append(ctx)
        out = _NoisyPrefix(tuple(committed[:whole]), state, context)
        if base is not None and base.tokens == out.tokens:
            return out
        if base is not None:
            self._forget(kept, base)  # extended: the longer prefix replaces it
        while len(kept) >= self.keep:
            self._forget(kept, kept[0])
        size = _nbytes(out)
        if self._bytes + size <= self.max_bytes:
            kept.append(out)
            self._bytes += size
        return out

    def _forget(self, kept: list[_NoisyPrefix], prefix: _NoisyPrefix) -> None:
        kept.remove(prefix)
        self._bytes -= _nbytes(prefix)

    @torch.no_grad()
    def sample(self, x: StepInputs, samples: int | None = None, seed: int | None = None) -> StepSamples:
        """``samples`` noisy runs (default the rule's) from noise stream ``seed`` (default the rule's)."""
        dev = self.target.device
        seed = self.rule.seed if seed is None else seed
        committed = torch.tensor(x.committed, device=dev)
        drafting = x.draft_ids is not None and hasattr(self.drafter, "ctx_keys")
        capture = self.capture if drafting else ()
        modules = [self.target.model] + ([self.drafter] if drafting else [])
        nodes, drafts, states = [], [], []
        src = NoiseSource(noise_stream(seed, 0, -1))
        with rounding_noise(modules, self.u, src, residual=[self.target] + ([self.drafter] if drafting else [])):
            for run in range(self.rule.samples if samples is None else samples):
                pre = self._prefix(x.committed, committed, seed, run, capture, src)
                src.gen = noise_stream(seed, run, -1 - len(x.committed))
                m = len(x.committed) - len(pre.tokens)  # the last, partial chunk: one forward with the step's tree
                tokens, parents, depths = _below_chain(committed[len(pre.tokens):], x.tokens, x.parents, x.depths)
                fwd = self.target.forward(pre.state, tokens.to(dev), parents.to(dev), depths.to(dev), capture=capture)
                if drafting and x.draft_ids is not None:  # (drafting implies draft ids)
                    context = torch.cat([*pre.context, fwd.context[:m]])
                    drafts.append(self._draft(context, committed, int(x.tokens[0]), x.draft_ids))
                logits = fwd.logits[m:].float()  # [N, V] the step's tree
                nodes.append(torch.log_softmax(logits, dim=-1).gather(1, x.cols.to(dev)).cpu())  # [N, c]
                if x.state_error is not None:
                    path = list(range(m)) + [m + a for a in x.accepted]
                    states.append(x.state_error(pre.state.commit(fwd, path), len(x.committed)))
        return StepSamples(torch.stack(nodes), torch.stack(drafts) if drafts else None, states)


def topk_spread(samples: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``samples`` [S, N, c] and ``ref`` [N, c] log-probs -> [N]: the largest change of a node's values."""
    return (samples - ref[None]).abs().amax(dim=(0, 2))


@dataclass(slots=True)
class StepSpread:
    """What the ensemble says about one step, per quantity (see the module docstring)."""

    topk: torch.Tensor  # [N] max over samples and the engine's top-k ids of |logp_s - logp_ref|
    margin: torch.Tensor  # [N] max over samples of |margin_s - margin_ref| (reference argmax vs engine argmax)
    median_topk: float
    draft: torch.Tensor | None = None  # [L] max over samples and draft ids of |draft_s - draft_ref|
    state: dict[str, float] | None = None  # entry -> max over samples of its rel L2

    @classmethod
    def of(cls, samples: torch.Tensor, ref: torch.Tensor, k: int) -> StepSpread:
        """``samples`` [S, N, k+2] and ``ref`` [N, k+2]: columns = the engine's top-k ids, then the
        reference's argmax, then the engine's argmax."""
        topk = topk_spread(samples[:, :, :k], ref[:, :k])  # [N]
        m_ref = ref[:, k] - ref[:, k + 1]  # [N]
        m_s = samples[:, :, k] - samples[:, :, k + 1]  # [S, N]
        margin = (m_s - m_ref[None]).abs().amax(dim=0)  # [N]
        return cls(topk, margin, float(topk.median()))

    @classmethod
    def of_step(cls, got: StepSamples, node_ref: torch.Tensor, k: int, draft_ref: torch.Tensor | None) -> StepSpread:
        spread = cls.of(got.node, node_ref, k)
        if got.draft is not None and draft_ref is not None:
            spread.draft = (got.draft - draft_ref[None]).abs().amax(dim=(0, 2))  # [L]
        if got.state:
            spread.state = {name: max(s[name] for s in got.state) for name in got.state[0]}
        return spread
