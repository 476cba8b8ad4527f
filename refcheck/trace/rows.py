"""The trace's data model and its one field list: a request's row, a verify step's row, its state
entries, the whole trace.

Contract: plain dataclasses holding what an engine did; ``N`` is a step's tree nodes including the root.
Every field of :class:`StepRow`, :class:`RequestRow` and :class:`StateEntry` is a column of the trace,
in the order declared here, and its ``Annotated`` :class:`Column` says how it is stored: the Arrow schema
(:mod:`refcheck.trace.schema`), the encoder and the decoder (:mod:`refcheck.trace.io`) are derived from
these declarations (:func:`columns`), so a new column is one annotated field here (plus, for a minor
version bump, its default, which is what files of older versions read as). ``Trace.prov`` reads the
provenance dict as a typed :class:`~refcheck.provenance.Provenance` (a
:class:`~refcheck.provenance.ProvenanceError` names the trace's file). No pyarrow here.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Annotated, Any

import torch

from refcheck.provenance import Provenance, ProvenanceError

SCHEMA_VERSION = "1.5"  # 1.1 checksum keys, 1.2 sampling columns, 1.3 residual_uniform, 1.4 the drafter's side, 1.5 each request's token limit (docs/trace-format.md)


@dataclass(frozen=True, slots=True)
class Column:
    """How one field is stored. ``kind``: ``string``, ``int32``, ``int64``, ``float64``; a list of one of
    them (``int32[]``, ``float32[]``, ``float64[]``; ``int32[][]``, ``float32[][]`` nested); ``tensor``
    (exact: dtype, shape, raw bytes; ``nullable`` for None); ``state[]`` (a list of :class:`StateEntry`);
    ``timings`` (the TIMING_FIELDS, seconds). ``since``: the schema version that added it (older files
    read as the field's default)."""

    kind: str
    nullable: bool = False
    since: tuple[int, int] = (1, 0)


STRING, INT32, INT64, FLOAT64 = Column("string"), Column("int32"), Column("int64"), Column("float64")
INT32S, FLOAT32S, INT32S2, FLOAT32S2 = Column("int32[]"), Column("float32[]"), Column("int32[][]"), Column("float32[][]")
TENSOR, TENSOR_OR_NONE = Column("tensor"), Column("tensor", nullable=True)
SAMPLING = (1, 2)  # the version that added the sampling columns
RESIDUAL = (1, 3)  # the version that added the residual uniform
DRAFT = (1, 4)  # the version that added what the drafter consumed and the shadow tree
LIMIT = (1, 5)  # the version that added each request's token limit


@dataclass(slots=True, eq=False)
class StateEntry:
    """One layer's committed-state summary after a step's commit (eq=False: holds tensors)."""

    name: Annotated[str, STRING]
    layer: Annotated[int, INT32]
    kind: Annotated[str, STRING]  # one of STATE_KINDS: "kv_k", "kv_v", "conv", "rec"
    sketch: Annotated[torch.Tensor, TENSOR]
    full: Annotated[torch.Tensor | None, TENSOR_OR_NONE] = None


@dataclass(slots=True, eq=False, kw_only=True)
class StepRow:
    """One verify step of one request (eq=False: holds tensors). N = tree nodes incl. root.
    Keyword-only: the fields are in column order, so defaults and required fields interleave."""

    request_id: Annotated[str, STRING]
    step: Annotated[int, INT32]
    committed_len: Annotated[int, INT32]  # committed tokens before the step = position of the root
    tree_tokens: Annotated[list[int], INT32S]  # [N], index 0 = root
    tree_parents: Annotated[list[int], INT32S]  # [N], parents[0] = -1
    tree_depths: Annotated[list[int], INT32S]  # [N]
    tree_ranks: Annotated[list[int], INT32S]  # [N]
    draft_topk_ids: Annotated[list[list[int]], INT32S2]  # [L][k], drafter top-k per depth 1..L
    draft_topk_logprobs: Annotated[list[list[float]], FLOAT32S2]  # [L][k]
    topk_ids: Annotated[list[list[int]], INT32S2]  # [N][k], target top-k at every node
    topk_logprobs: Annotated[list[list[float]], FLOAT32S2]  # [N][k]
    target_argmax: Annotated[list[int], INT32S]  # [N]
    accepted: Annotated[list[int], INT32S]  # node indices, root first
    accept_length: Annotated[int, INT32]  # tau: accepted drafted tokens + 1 (bonus included)
    bonus: Annotated[int, INT32]
    emitted: Annotated[list[int], INT32S]  # [E]
    emitted_logprobs: Annotated[list[float], FLOAT32S]  # [E], NaN where the engine reports none
    state: Annotated[list[StateEntry], Column("state[]")]  # one entry per (layer, kind)
    layer_sketch: Annotated[torch.Tensor | None, TENSOR_OR_NONE] = None  # [layers, N, r]
    timings: Annotated[dict[str, float], Column("timings")]  # keys TIMING_FIELDS, seconds
    # 1.2: sampling. [N] or [] (the engine exposes nothing); -1 / NaN at a node it does not expose.
    #: the token the target drew at each node
    node_draws: Annotated[list[int], Column("int32[]", since=SAMPLING)] = field(default_factory=list)
    #: the uniform in [0, 1) each draw used (inverse CDF, token-id order)
    node_uniforms: Annotated[list[float], Column("float64[]", since=SAMPLING)] = field(default_factory=list)
    #: 1.3: the step's second uniform, which a children-first sampler (rng "engine-children-first") draws the
    #: bonus with after every child of the last accepted node is rejected; NaN = not exposed / not used
    residual_uniform: Annotated[float, Column("float64", since=RESIDUAL)] = float("nan")
    # 1.4: the drafter's side of the step.
    #: positions the engine fed its drafter's context from this step's verify (the root, then the accepted
    #: nodes, in path order: what the next step's draft reads); [] = not exposed
    draft_context_positions: Annotated[list[int], Column("int32[]", since=DRAFT)] = field(default_factory=list)
    #: sketch (refcheck.sketch) of the target features fed with them, [len(draft_context_positions), r]; None = not exposed
    draft_context_sketch: Annotated[torch.Tensor | None, Column("tensor", nullable=True, since=DRAFT)] = None
    #: shadow mode (an engine that builds trees but verifies its chain): the tree its drafter built, [M] tokens
    #: and parents, root first; [] = the verified tree is the drafted tree
    shadow_tree_tokens: Annotated[list[int], Column("int32[]", since=DRAFT)] = field(default_factory=list)
    shadow_tree_parents: Annotated[list[int], Column("int32[]", since=DRAFT)] = field(default_factory=list)


@dataclass(slots=True)
class RequestRow:
    request_id: Annotated[str, STRING]
    kind: Annotated[str, STRING]
    prompt_ids: Annotated[list[int], INT32S]  # [P]
    output_ids: Annotated[list[int], INT32S]  # [T]
    output_logprobs: Annotated[list[float], FLOAT32S]  # [T] normally; NaN where unknown
    # 1.2: sampling parameters of the request; the defaults are greedy (temperature 0: the others unused)
    temperature: Annotated[float, Column("float64", since=SAMPLING)] = 0.0
    top_k: Annotated[int, Column("int32", since=SAMPLING)] = 0  # 0 = off
    top_p: Annotated[float, Column("float64", since=SAMPLING)] = 1.0  # 1 = off
    seed: Annotated[int, Column("int64", since=SAMPLING)] = -1  # -1 = unknown
    rng: Annotated[str, Column("string", since=SAMPLING)] = ""  # how uniforms are keyed: one of schema.RNG_KINDS
    #: the request word of the keyed generator; -1 = unknown
    rng_request: Annotated[int, Column("int64", since=SAMPLING)] = -1
    #: uniform of the draw after the prefill; NaN = not exposed
    first_uniform: Annotated[float, Column("float64", since=SAMPLING)] = float("nan")
    #: 1.5: the most tokens the request could generate, where it had its own limit; -1 = the run's (the provenance's
    #: ``max_new_tokens``)
    max_new_tokens: Annotated[int, Column("int32", since=LIMIT)] = -1

    def token_limit(self, run_limit: int) -> int:
        """The request's own token limit, else the run's."""
        return self.max_new_tokens if self.max_new_tokens >= 0 else run_limit

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


def columns(row: type) -> tuple[tuple[str, Column], ...]:
    """``(name, Column)`` of every field of a row class, in column order."""
    hints = typing.get_type_hints(row, vars(sys.modules[row.__module__]), include_extras=True)
    out = []
    for f in fields(row):
        col = next((m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Column)), None)
        if col is None:
            raise TypeError(f"{row.__name__}.{f.name} has no Column annotation")
        out.append((f.name, col))
    return tuple(out)


def defaults(row: type) -> dict[str, Any]:
    """The fields of ``row`` that have a default, with it (a fresh one for a default factory)."""
    out: dict[str, Any] = {}
    for f in fields(row):
        if f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not MISSING:
            out[f.name] = f.default
    return out


@dataclass(slots=True, eq=False)
class Trace:
    """A whole trace. ``schema_version`` is the version the file was written with (read) or
    :data:`SCHEMA_VERSION` (new); :func:`write_trace` always writes :data:`SCHEMA_VERSION`. ``source``: the
    file it was read from (what errors about its content name), None for a trace made in memory."""

    provenance: dict[str, Any]
    requests: list[RequestRow]
    steps: list[StepRow]
    schema_version: str = SCHEMA_VERSION
    checksummed: bool = True  # False: read from a 1.0 file, which carries no checksums ("unchecked")
    source: str | None = None

    @property
    def prov(self) -> Provenance:
        """The provenance, typed and checked (:class:`refcheck.provenance.Provenance`); a field of the wrong type
        or out of range is a :class:`ProvenanceError` naming :attr:`source`."""
        try:
            return Provenance.of(self.provenance)
        except ProvenanceError as exc:
            if self.source is None:
                raise
            raise ProvenanceError(f"{self.source}: {exc}") from None

    def steps_of(self, request_id: str) -> list[StepRow]:
        """The steps of one request, sorted by step."""
        return sorted((s for s in self.steps if s.request_id == request_id), key=lambda s: s.step)

    def request(self, request_id: str) -> RequestRow:
        """The request row with ``request_id``; KeyError when there is none."""
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)
