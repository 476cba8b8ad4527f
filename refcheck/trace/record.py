"""Turning the reference decoder's per-step records into trace rows.

Contract: :func:`request_rows` converts one :class:`~ddtree_reference.decode.DecodeResult` (decoded with
``keep_states=True``, and ``keep_layers=True`` for layer sketches) into a ``RequestRow`` and its
``StepRow`` s. State summaries are state sketches (:func:`refcheck.sketch.state_sketch`, one ``[1, r]`` row
per layer and kind, stored as :func:`refcheck.sketch.stored_sketch` says for the engine's ``dtype``) of what
each step committed; full tensors are added only when asked (``full_state``). A sampled decode (``sampling`` with T > 0) also
records its parameters and keying on the request row and every node's draw and uniform on the step
rows (schema 1.2).
"""

from __future__ import annotations

import math
from typing import Any

from ddtree_reference.decode import DecodeResult, StepRecord
from ddtree_reference.sampling import Sampling
from refcheck.sketch import layer_sketch, state_rows, state_sketch, stored_sketch
from refcheck.trace.io import RequestRow, StateEntry, StepRow

DRAFT_TOPK = 8


def step_row(request_id: str, rec: StepRecord, full_state: bool = False, dtype: str = "float32") -> StepRow:
    state: list[StateEntry] = []
    if rec.state is not None:
        for name, (layer, kind, rows) in state_rows(rec.state, rec.committed_len).items():
            sketch = stored_sketch(state_sketch(rows).cpu(), dtype)
            state.append(StateEntry(name, layer, kind, sketch, rows.cpu().clone() if full_state else None))
    draft_ids: list[list[int]] = []
    draft_lps: list[list[float]] = []
    if rec.draft_logprobs is not None:
        top = rec.draft_logprobs.topk(min(DRAFT_TOPK, rec.draft_logprobs.shape[-1]), dim=-1)
        draft_ids, draft_lps = top.indices.tolist(), top.values.tolist()
    t = rec.tree
    return StepRow(
        request_id=request_id,
        step=rec.step,
        committed_len=rec.committed_len,
        tree_tokens=t.tokens.tolist(),
        tree_parents=t.parents.tolist(),
        tree_depths=t.depths.tolist(),
        tree_ranks=t.ranks.tolist(),
        draft_topk_ids=draft_ids,
        draft_topk_logprobs=draft_lps,
        topk_ids=rec.topk_ids.tolist(),
        topk_logprobs=rec.topk_logprobs.tolist(),
        target_argmax=rec.target_argmax.tolist(),
        accepted=list(rec.accepted),
        accept_length=rec.accept_length,
        bonus=rec.bonus,
        emitted=list(rec.emitted),
        emitted_logprobs=list(rec.emitted_logprobs),
        state=state,
        timings=dict(rec.timings),
        layer_sketch=layer_sketch(rec.layer_outputs) if rec.layer_outputs is not None else None,
        node_draws=rec.draws.tolist() if rec.draws is not None else [],
        node_uniforms=rec.uniforms.tolist() if rec.uniforms is not None else [],
    )


def sampling_columns(sampling: Sampling | None, result: DecodeResult) -> dict[str, Any]:
    """The request row's sampling columns (greedy defaults when not sampled)."""
    if sampling is None or sampling.greedy:
        return {}
    return {"temperature": float(sampling.temperature), "top_k": int(sampling.top_k), "top_p": float(sampling.top_p),
            "seed": int(sampling.seed), "rng": f"refcheck-philox-{sampling.keying}", "rng_request": int(result.request),
            "first_uniform": math.nan if result.first_uniform is None else float(result.first_uniform)}


def request_rows(request_id: str, kind: str, result: DecodeResult, full_state: bool = False,
                 sampling: Sampling | None = None, dtype: str = "float32",
                 max_new_tokens: int | None = None) -> tuple[RequestRow, list[StepRow]]:
    """One decode's request row and step rows (``dtype``: the engine's, for the state sketches' storage;
    ``max_new_tokens``: the request's own token limit, None where it ran to the run's)."""
    req = RequestRow(request_id, kind, list(result.prompt_ids), list(result.output_ids), list(result.output_logprobs),
                     **sampling_columns(sampling, result), max_new_tokens=-1 if max_new_tokens is None else max_new_tokens)
    return req, [step_row(request_id, s, full_state, dtype) for s in result.steps]
