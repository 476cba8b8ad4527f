"""The trace's data model: a request's row, a verify step's row, its state entries, the whole trace.

Contract: plain dataclasses holding what an engine did (the Arrow layout, its encoding and checks are
:mod:`refcheck.trace.io`); ``N`` is a step's tree nodes including the root. ``Trace.prov`` reads the
provenance dict as a typed :class:`~refcheck.provenance.Provenance`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from refcheck.provenance import Provenance
from refcheck.trace.schema import SCHEMA_VERSION


@dataclass(slots=True, eq=False)
class StateEntry:
    """One layer's committed-state summary after a step's commit (eq=False: holds tensors)."""

    name: str
    layer: int
    kind: str  # one of STATE_KINDS: "kv_k", "kv_v", "conv", "rec"
    sketch: torch.Tensor
    full: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class StepRow:
    """One verify step of one request (eq=False: holds tensors). N = tree nodes incl. root."""

    request_id: str
    step: int
    committed_len: int  # committed tokens before the step = position of the root
    tree_tokens: list[int]  # [N], index 0 = root
    tree_parents: list[int]  # [N], parents[0] = -1
    tree_depths: list[int]  # [N]
    tree_ranks: list[int]  # [N]
    draft_topk_ids: list[list[int]]  # [L][k], drafter top-k per depth 1..L
    draft_topk_logprobs: list[list[float]]  # [L][k]
    topk_ids: list[list[int]]  # [N][k], target top-k at every node
    topk_logprobs: list[list[float]]  # [N][k]
    target_argmax: list[int]  # [N]
    accepted: list[int]  # node indices, root first
    accept_length: int  # tau: accepted drafted tokens + 1 (bonus included)
    bonus: int
    emitted: list[int]  # [E]
    emitted_logprobs: list[float]  # [E], NaN where the engine reports none
    state: list[StateEntry]
    timings: dict[str, float]  # keys TIMING_FIELDS, seconds
    layer_sketch: torch.Tensor | None = None  # [layers, N, r]
    node_draws: list[int] = field(default_factory=list)  # [N] or [] (1.2): the engine's draw per node, -1 unexposed
    node_uniforms: list[float] = field(default_factory=list)  # [N] or [] (1.2): its uniform per node, NaN unexposed


@dataclass(slots=True)
class RequestRow:
    request_id: str
    kind: str
    prompt_ids: list[int]  # [P]
    output_ids: list[int]  # [T]
    output_logprobs: list[float]  # [T] normally; NaN where unknown
    # 1.2: sampling (schema.SAMPLING_REQUEST_FIELDS); the defaults are greedy
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = -1
    rng: str = ""  # one of schema.RNG_KINDS
    rng_request: int = -1
    first_uniform: float = float("nan")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass(slots=True, eq=False)
class Trace:
    """A whole trace. ``schema_version`` is the version the file was written with (read) or
    :data:`SCHEMA_VERSION` (new); :func:`write_trace` always writes :data:`SCHEMA_VERSION`."""

    provenance: dict[str, Any]
    requests: list[RequestRow]
    steps: list[StepRow]
    schema_version: str = SCHEMA_VERSION
    checksummed: bool = True  # False: read from a 1.0 file, which carries no checksums ("unchecked")

    @property
    def prov(self) -> Provenance:
        """The provenance, typed and checked (:class:`refcheck.provenance.Provenance`)."""
        return Provenance.of(self.provenance)

    def steps_of(self, request_id: str) -> list[StepRow]:
        """The steps of one request, sorted by step."""
        return sorted((s for s in self.steps if s.request_id == request_id), key=lambda s: s.step)

    def request(self, request_id: str) -> RequestRow:
        """The request row with ``request_id``; KeyError when there is none."""
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)
