"""Capture records + SGLang's generate results -> a refcheck trace.

Contract: :func:`assemble_trace` pairs each prompt with its SGLang rid, takes that request's prefill
record (first token and its log-prob) and step records (rank 0, in write order), and builds the
trace's request and step rows. SGLang emits whole verify blocks and then cuts the output at
``max_new_tokens`` or a stop token, so each step's ``emitted`` is cut to what the request's output
holds (the last step may be partial; steps wholly past the output are dropped). Under tensor
parallelism every rank records; :func:`merge_ranks` combines their state shards. When a request has
no generate result (the engine crashed), its output is rebuilt from the captured records and the
request is listed in :attr:`Assembly.incomplete`. A step's number is the engine's (``step_index``, counted by
the plugin): a sampled capture records some steps of each request, and a step after unrecorded ones is placed
in the output by its committed length (the request then carries no per-token log-probs). Inconsistencies between the records and the
output (a step's emitted tokens not matching the output, committed lengths that do not follow
each other, tensor-parallel ranks that disagree) are not repaired: they stay in the trace for the diff to report, and are listed in
:attr:`Assembly.problems`.

Sampled runs (``sampling`` given, temperature > 0): every request row carries the parameters and
``rng`` (how the engine's uniforms are keyed: ``refcheck-philox-position`` for REFCHECK_DDTREE's
keyed sampler, whose request word is CRC-32 of the prompt id; ``engine`` for SGLang's own
generator), and the steps and the first token carry the draws and uniforms the sampler exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddtree_reference.sampling import Sampling, request_key
from refcheck.prompts import Prompt
from refcheck.sglang.capture.contexts import Contexts
from refcheck.sglang.capture.records import Capture
from refcheck.sglang.capture.state import combine_shards
from refcheck.sglang.capture.steps import StepCapture
from refcheck.sketch import stored_sketch
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


def _step_row(prompt_id: str, k: int, s: StepCapture, keep: int, dtype: str = "float32") -> StepRow:
    """One recorded step as a trace row (``dtype``: the engine's, for the state sketches' storage)."""
    state = [StateEntry(name, layer, kind, stored_sketch(sketch, dtype), full)
             for name, (layer, kind, sketch, full) in sorted(s.state.items())]
    return StepRow(
        request_id=prompt_id, step=k, committed_len=s.committed_len, tree_tokens=list(s.tokens),
        tree_parents=list(s.parents), tree_depths=list(s.depths), tree_ranks=sibling_ranks(s.parents, s.tokens, s.depths),
        draft_topk_ids=s.draft_ids, draft_topk_logprobs=s.draft_logprobs, topk_ids=s.topk_ids, topk_logprobs=s.topk_logprobs,
        target_argmax=list(s.argmax), accepted=list(s.accepted), accept_length=len(s.accepted), bonus=s.bonus,
        emitted=list(s.emitted[:keep]), emitted_logprobs=list(s.emitted_logprobs[:keep]), state=state,
        layer_sketch=s.layer_sketch, node_draws=list(s.draws), node_uniforms=list(s.uniforms),
        residual_uniform=float(s.residual_uniform), draft_context_positions=list(s.context_positions),
        draft_context_sketch=s.context_sketch, shadow_tree_tokens=list(s.shadow_tokens),
        shadow_tree_parents=list(s.shadow_parents),
        # SGLang's whole scheduler step (draft, verify, commit) for the batch this step ran in; "draft":
        # the part of it REFCHECK_DDTREE spent drafting and building the batch's trees (NaN for others)
        timings={"draft": float(s.meta.get("batch_draft_s", math.nan)), "tree": math.nan,
                 "verify": float(s.meta.get("batch_step_s", math.nan)), "commit": math.nan},
    )


def _step_problems(where: str, s: StepCapture, previous: StepCapture | None, held: list[int]) -> list[str]:
    """A step's disagreements with the output (``held``: what the output holds where the step emitted), with the
    step just before it (when that one was recorded), and a lossy sampler setting."""
    out = []
    if s.emitted[:len(held)] != held:
        out.append(f"{where}: emitted {s.emitted[:len(held)]} but the output holds {held}")
    if previous is not None and s.committed_len != previous.committed_len + len(previous.accepted):
        out.append(f"{where}: committed length {s.committed_len} does not follow the previous step "
                   f"({previous.committed_len} + {len(previous.accepted)})")
    th = s.meta.get("accept_thresholds")
    if th is not None and list(th) != [1.0, 1.0]:  # SGLang's speculative_accept_threshold_single / _acc
        out.append(f"{where}: SGLang's tree sampler ran with accept thresholds {list(th)} (single, acc): below 1 it "
                   "accepts drafts the target would not draw, by design lossy")
    return out


def merge_ranks(capture: Capture, problems: list[str]) -> list[StepCapture]:
    """One step list from every tensor-parallel rank's records: tokens, log-probs and acceptance from
    rank 0 (every rank must agree), committed state combined from the ranks' shards."""
    ranks = sorted(capture.steps)
    if len(ranks) <= 1:
        return list(capture.steps.get(ranks[0], [])) if ranks else []
    per_rank = {r: {} for r in ranks}
    for r in ranks:
        for s in capture.steps[r]:
            per_rank[r].setdefault(s.rid, []).append(s)
    out = []
    seen: dict[str, int] = {}  # rid -> steps merged so far (rank 0's k-th step pairs with every rank's k-th)
    for s0 in capture.steps[ranks[0]]:
        k = seen.get(s0.rid, 0)
        seen[s0.rid] = k + 1
        group = [per_rank[r].get(s0.rid, [])[k] if k < len(per_rank[r].get(s0.rid, [])) else None for r in ranks]
        if any(g is None for g in group):
            problems.append(f"{s0.rid} step {k}: not recorded by every tensor-parallel rank")
            out.append(s0)
            continue
        if any((g.committed_len, g.tokens, g.accepted) != (s0.committed_len, s0.tokens, s0.accepted) for g in group):
            problems.append(f"{s0.rid} step {k}: tensor-parallel ranks disagree on the tree or the accepted path")
        groups = tuple(s0.meta.get("conv_groups") or ()) or None
        merged = StepCapture.from_dict({**s0.to_dict(), "state": {}})
        for name in s0.state:
            if all(name in g.state for g in group):
                merged.state[name] = combine_shards([g.state[name] for g in group], groups,
                                                    int(s0.meta.get("kv_replicas") or 1))
            else:
                problems.append(f"{s0.rid} step {k}: state {name} missing on some rank")
        out.append(merged)
    return out


def _request_row(p: Prompt, output: list[int], lps: list[float], first_uniform: float, sampling: Sampling | None,
                 rng: str) -> RequestRow:
    row = RequestRow(p.id, p.kind, list(p.prompt_ids), output, lps,
                     max_new_tokens=-1 if p.max_new_tokens is None else p.max_new_tokens)
    if sampling is not None and not sampling.greedy:
        row.temperature, row.top_k, row.top_p, row.rng = sampling.temperature, sampling.top_k, sampling.top_p, rng
        if rng.startswith("refcheck-philox"):  # refcheck's keys: recomputable by the diff
            row.seed, row.rng_request, row.first_uniform = sampling.seed, request_key(p.id), first_uniform
    return row


def capture_contexts(capture: Capture) -> Contexts:
    """Every request's context as the first rank's records carry it (:mod:`refcheck.sglang.capture.contexts`)."""
    rank = capture.first_rank
    return Contexts.of([*capture.prefills.get(rank, []), *capture.steps.get(rank, [])])


def _check_contexts(out: Assembly, prompts: list[Prompt], rids: dict[str, str], contexts: Contexts) -> None:
    """Each request's carried context against its prompt and output: a record that says the engine held other
    tokens is a problem, and so are the contexts' holes and conflicts."""
    out.problems += contexts.holes + contexts.conflicts
    outputs = {r.request_id: r.output_ids for r in out.trace.requests}
    for p in prompts:
        rid = rids[p.id]
        if rid in contexts:
            at = contexts.differs(rid, list(p.prompt_ids) + list(outputs.get(p.id, [])))
            if at is not None:
                out.problems.append(f"{p.id}: the context its records carry differs from its prompt and output at "
                                    f"token {at}")


def _stats(kept: list[StepCapture], past_end: int) -> dict:
    n_steps, n_accepted = len(kept), sum(len(s.accepted) for s in kept)
    return {"steps": n_steps, "branching_steps": sum(bool(s.meta.get("branching")) for s in kept),
            "steps_past_output_dropped": past_end, "tau": n_accepted / n_steps if n_steps else None,
            # steps whose target forward replayed one of SGLang's CUDA graphs (the rest ran eagerly)
            "cuda_graph_steps": sum(bool(c.meta.get("cuda_graph")) for c in kept),
            # how far the scheduler's request lists lagged the device (the overlap scheduler: 1 step's tokens)
            "committed_lag_max": max((int(c.meta.get("committed_lag") or 0) for c in kept), default=0),
            # steps that carry the drafter's side (its top-k per depth), and why a drafter could not be captured
            "draft_steps": sum(bool(c.draft_ids) for c in kept),
            "draft_not_captured": next((c.meta["draft_not_captured"] for c in kept if c.meta.get("draft_not_captured")),
                                       None),
            # the capture hooks' time on the scheduler's thread per recorded batch (its requests share it), in ms
            "capture_host_ms_per_batch": _per_batch_ms(kept)}


def _per_batch_ms(kept: list[StepCapture]) -> float | None:
    batches = {(c.meta.get("batch_step_s"), c.meta.get("capture_host_s")) for c in kept
               if isinstance(c.meta.get("capture_host_s"), float)}
    return round(1000 * sum(h for _, h in batches) / len(batches), 4) if batches else None


def _request_steps(out: Assembly, kept: list[StepCapture], p: Prompt, recs: list[StepCapture], output: list[int],
                   lps: list[float], overlap: bool, dtype: str) -> tuple[list[float], int]:
    """One request's captured steps into ``out.trace.steps`` (their records into ``kept``), each checked against the
    output it emits: (the output's log-probs, [] where the records do not cover it; steps dropped past its end)."""
    filled = 1 if output else 0
    for k, s in enumerate(recs):
        index = int(s.meta.get("step_index", k))
        follows = k == 0 and index == 0 or k > 0 and index == int(recs[k - 1].meta.get("step_index", k - 1)) + 1
        if not follows:  # steps the capture did not record (sampled, or lost) lie before this one
            filled, lps = s.committed_len - len(p.prompt_ids) + 1, []
        if filled >= len(output):
            if not (overlap and len(recs) - k == 1):
                out.problems.append(f"{p.id}: {len(recs) - k} captured step(s) past the end of the output dropped")
            return (lps if len(lps) == len(output) else []), len(recs) - k
        keep = min(len(s.emitted), len(output) - filled)
        out.problems += _step_problems(f"{p.id} step {index}", s, recs[k - 1] if k and follows else None,
                                       output[filled:filled + keep])
        out.trace.steps.append(_step_row(p.id, index, s, keep, dtype))
        kept.append(s)
        if lps:
            lps.extend(s.emitted_logprobs[:keep])
        filled += keep
    # the records do not cover the whole output: no per-token log-probs rather than a misaligned list
    return (lps if len(lps) == len(output) else []), 0


def assemble_trace(prompts: list[Prompt], rids: dict[str, str], results: dict[str, dict], capture: Capture,
                   provenance: dict, sampling: Sampling | None = None, rng: str = "engine",
                   overlap: bool = False, contexts: Contexts | None = None) -> Assembly:
    """prompts in order; rids: prompt id -> SGLang rid; results: prompt id -> generate result (may
    lack crashed requests); sampling / rng: the run's sampling parameters (module docstring); overlap: SGLang ran
    the overlap scheduler, which launches a request's next step before it processes the finish of the last one,
    so one captured step past the end of each output is expected (dropped and counted, not a problem); contexts:
    the capture's :func:`capture_contexts` where the caller has them already."""
    out = Assembly(Trace(provenance=provenance, requests=[], steps=[]))
    steps_by_rid: dict[str, list[StepCapture]] = {}
    for s in merge_ranks(capture, out.problems):
        steps_by_rid.setdefault(s.rid, []).append(s)
    first_rank = min(capture.prefills) if capture.prefills else 0
    prefill = {p.rid: p for p in capture.prefills.get(first_rank, [])}  # one per rid: the chunk ending its prompt
    past_end = 0
    kept: list[StepCapture] = []  # the records behind out.trace.steps, in the same order
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
        lps, dropped = _request_steps(out, kept, p, recs, output, lps, overlap, str(provenance.get("dtype", "float32")))
        past_end += dropped
        out.trace.requests.append(_request_row(p, output, lps, first.uniform if first is not None else math.nan,
                                               sampling, rng))
    _check_contexts(out, prompts, rids, contexts if contexts is not None else capture_contexts(capture))
    out.stats = _stats(kept, past_end)
    # branching trees verified while the engine ran its recurrent layers as a chain (topk <= 1): the leak's
    # configuration, visible without any numerics
    chain = [(row.request_id, row.step) for row, cap in zip(out.trace.steps, kept)
             if cap.meta.get("branching") and cap.meta.get("layout_in_engine") == "chain"]
    if chain:
        out.stats["chain_layout_branching_steps"] = len(chain)
        out.stats["chain_layout_first"] = list(chain[0])
    return out


def capture_provenance(cap: Capture, asm: Assembly, crash: str | None, hook_errors: list[str], sample: dict[str, Any],
                       max_bytes: int | None, enabled: bool = True, roll: bool = False) -> dict[str, Any]:
    """A trace's ``capture`` provenance: the capture's errors (``hook_errors`` after the records' own), the assembly's
    problems (a release the hooks were not checked against added) and statistics (records lost, batches past the byte
    budget, records a rolling budget deleted, the cost ledger), the crash, the schedulers' status, the sampling rule
    and the byte budget (and whether it rolls)."""
    from refcheck.sglang.capture.versions import SUPPORTED

    seen = {str(st.get("sglang")) for st in cap.status} - set(SUPPORTED)
    if seen:  # not an error: the hook targets may still hold, but nobody has read this release
        asm.problems.append(f"SGLang {', '.join(sorted(seen))} is not a release refcheck's hooks were checked "
                            f"against ({', '.join(SUPPORTED)})")
    errors = list(cap.errors) + hook_errors
    if cap.lost:
        asm.stats["lost_batches"] = cap.lost
    if cap.over_budget:
        asm.stats["over_budget_batches"] = cap.over_budget
    if cap.rolled_out:
        asm.stats["rolled_out_records"] = cap.rolled_out
    if cap.cost:
        asm.stats["capture_cost"] = cap.cost
    return {"enabled": enabled, "errors": errors[:50], "problems": asm.problems[:50], "incomplete": asm.incomplete,
            "crash": crash, "stats": asm.stats, "status": cap.status[:8], "sample": sample, "max_bytes": max_bytes,
            "roll": roll}
