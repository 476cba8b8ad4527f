"""Capture records + SGLang's generate results -> a refcheck trace.

Contract: :func:`assemble_trace` pairs each prompt with its SGLang rid, takes that request's prefill
record (first token and its log-prob) and step records (rank 0, in write order), and builds the
trace's request and step rows. SGLang emits whole verify blocks and then cuts the output at
``max_new_tokens`` or a stop token, so each step's ``emitted`` is cut to what the request's output
holds (the last step may be partial; steps wholly past the output are dropped). When a request has
no generate result (the engine crashed), its output is rebuilt from the captured records and the
request is listed in :attr:`Assembly.incomplete`. Inconsistencies between the records and the
output (a step's emitted tokens not matching the output, committed lengths that do not follow
each other) are not repaired: they stay in the trace for the diff to report, and are listed in
:attr:`Assembly.problems`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from refcheck.prompts import Prompt
from refcheck.sglang_capture.records import Capture
from refcheck.sglang_capture.steps import StepCapture
from refcheck.trace.io import RequestRow, StateEntry, StepRow, Trace


@dataclass
class Assembly:
    trace: Trace
    incomplete: list[str] = field(default_factory=list)  # prompt ids without a generate result
    problems: list[str] = field(default_factory=list)
    stats: dict[str, float | None] = field(default_factory=dict)


def sibling_ranks(parents: list[int], tokens: list[int], depths: list[int]) -> list[int]:
    """Per-depth token ranks consistent with refcheck's tree rules (one rank per (depth, token)),
    in first-appearance order: engine trees carry no drafter ranks of their own."""
    seen: dict[tuple[int, int], int] = {}
    count: dict[int, int] = {}
    ranks = [0] * len(parents)
    for i in range(1, len(parents)):
        key = (depths[i], tokens[i])
        if key not in seen:
            seen[key] = count.get(depths[i], 0)
            count[depths[i]] = seen[key] + 1
        ranks[i] = seen[key]
    return ranks


def _step_row(prompt_id: str, k: int, s: StepCapture, keep: int) -> StepRow:
    state = [StateEntry(name, layer, kind, sketch, full) for name, (layer, kind, sketch, full) in sorted(s.state.items())]
    return StepRow(
        request_id=prompt_id, step=k, committed_len=s.committed_len, tree_tokens=list(s.tokens),
        tree_parents=list(s.parents), tree_depths=list(s.depths), tree_ranks=sibling_ranks(s.parents, s.tokens, s.depths),
        draft_topk_ids=[], draft_topk_logprobs=[], topk_ids=s.topk_ids, topk_logprobs=s.topk_logprobs,
        target_argmax=list(s.argmax), accepted=list(s.accepted), accept_length=len(s.accepted), bonus=s.bonus,
        emitted=list(s.emitted[:keep]), emitted_logprobs=list(s.emitted_logprobs[:keep]), state=state,
        timings={"draft": math.nan, "tree": math.nan, "verify": math.nan, "commit": math.nan},
    )


def assemble_trace(prompts: list[Prompt], rids: dict[str, str], results: dict[str, dict], capture: Capture,
                   provenance: dict, rank: int = 0) -> Assembly:
    """prompts in order; rids: prompt id -> SGLang rid; results: prompt id -> generate result (may
    lack crashed requests)."""
    steps_by_rid: dict[str, list[StepCapture]] = {}
    for s in capture.steps.get(rank, []):
        steps_by_rid.setdefault(s.rid, []).append(s)
    prefill = {p.rid: p for p in capture.prefills.get(rank, [])}  # the last chunk of a chunked prefill wins
    out = Assembly(Trace(provenance=provenance, requests=[], steps=[]))
    n_steps = n_branching = n_accepted = 0
    for p in prompts:
        rid = rids[p.id]
        recs = steps_by_rid.get(rid, [])
        first = prefill.get(rid)
        if p.id in results:
            output = [int(t) for t in results[p.id]["output_ids"]]
        else:
            out.incomplete.append(p.id)
            output = ([first.token] if first else []) + [t for s in recs for t in s.emitted]
        if first is not None and output and first.token != output[0]:
            out.problems.append(f"{p.id}: prefill record token {first.token} but output starts with {output[0]}")
        lps = [first.logprob] if first is not None and output else []
        filled = 1 if output else 0
        for k, s in enumerate(recs):
            if filled >= len(output):
                out.problems.append(f"{p.id}: {len(recs) - k} captured step(s) past the end of the output dropped")
                break
            keep = min(len(s.emitted), len(output) - filled)
            if s.emitted[:keep] != output[filled:filled + keep]:
                out.problems.append(f"{p.id} step {k}: emitted {s.emitted[:keep]} but the output holds "
                                    f"{output[filled:filled + keep]}")
            if k and s.committed_len != recs[k - 1].committed_len + len(recs[k - 1].accepted):
                out.problems.append(f"{p.id} step {k}: committed length {s.committed_len} does not follow the previous "
                                    f"step ({recs[k - 1].committed_len} + {len(recs[k - 1].accepted)})")
            out.trace.steps.append(_step_row(p.id, k, s, keep))
            if lps:
                lps.extend(s.emitted_logprobs[:keep])
            filled += keep
            n_steps += 1
            n_branching += bool(s.meta.get("branching"))
            n_accepted += len(s.accepted)
        if lps and len(lps) != len(output):
            lps = []  # the records do not cover the whole output: no per-token log-probs rather than a misaligned list
        out.trace.requests.append(RequestRow(p.id, p.kind, list(p.prompt_ids), output, lps))
    out.stats = {"steps": n_steps, "branching_steps": n_branching,
                 "tau": n_accepted / n_steps if n_steps else None}
    return out
