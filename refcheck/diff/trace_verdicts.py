"""Verdicts over a whole replayed trace, beside its per-step checks: the engine's run itself, the distributional
test of sampled requests, and the temperature check of their keyed draws.

Contract: :func:`capture_findings` turns a captured engine's crash, capture errors and chain-layout branching into
findings; :func:`judge_distribution` and :func:`judge_temperature` judge the evidence the replay of every sampled
request collected (:mod:`refcheck.diff.distribution`, :mod:`refcheck.diff.temperature`) once over the trace.
"""

from __future__ import annotations

from refcheck.diff.distribution import Evidence, judge
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.diff.rounding_guard import withdraw_trace
from refcheck.diff.temperature import Leans, judge_leans
from refcheck.trace.rows import Trace


def capture_findings(rep: Report, trace: Trace) -> None:
    """An engine run that crashed or whose capture failed is a failure of its own ("engine")."""
    cap = trace.prov.capture
    if cap is None:
        return
    rep.check("engine")
    if cap.crash or cap.incomplete:
        rep.add(Finding(Verdict.FAIL, "engine", None, None,
                        message=f"engine run incomplete ({cap.crash or 'no result'}); requests without a result: "
                                f"{list(cap.incomplete)}; partial trace: {cap.partial_trace or '-'}"))
    for msg in cap.errors:
        rep.add(Finding(Verdict.FAIL, "engine", None, None, message=f"capture: {msg}"))
    stats = cap.stats
    if stats.get("lost_batches"):
        rep.add(Finding(Verdict.SKIPPED, "engine", None, None,
                        message=f"the capture fell behind the engine: {stats['lost_batches']} batch record(s) found its "
                                "queue full and were not recorded; the replay crosses their steps by re-prefilling"))
    if stats.get("over_budget_batches"):
        limit = cap.max_bytes
        rep.add(Finding(Verdict.SKIPPED, "engine", None, None,
                        message=f"the capture reached its byte budget ({_mib(limit)} per scheduler process): "
                                f"{stats['over_budget_batches']} batch(es) after it were not recorded; the steps "
                                "before it are judged"))
    if stats.get("rolled_out_records"):
        rep.add(Finding(Verdict.SKIPPED, "engine", None, None,
                        message=f"the capture kept within its byte budget ({_mib(cap.max_bytes)} per scheduler process) "
                                f"by deleting its {stats['rolled_out_records']} oldest batch record(s); the steps they "
                                "held are not judged"))
    if stats.get("chain_layout_branching_steps"):
        rid, step = stats.get("chain_layout_first", [None, None])
        rep.check("tree")
        rep.add(Finding(Verdict.FAIL, "tree", rid, step,
                        message=f"the engine verified {stats['chain_layout_branching_steps']} branching trees with its "
                                "recurrent layers in the chain layout (speculative_eagle_topk <= 1): sibling nodes run "
                                "through each other's state (first at this step)"))


def _mib(limit: object) -> str:
    return f"{limit / (1 << 20):g} MiB" if isinstance(limit, int) else "unknown"


def judge_distribution(rep: Report, evidence: Evidence, hidden: list[str]) -> None:
    """The distributional verdict over a trace's sampled requests: a finding, stats, or INCONCLUSIVE."""
    evidence.hidden_requests = len(hidden)
    v = judge(evidence)
    rep.check("distribution")
    rep.stats["distribution"] = {**v.to_json(), "hidden_requests": hidden}
    where = f"{v.n_tokens} tokens, {v.n_walk_nodes} walk nodes"
    if v.verdict == "fail":
        what = f"{v.impossible} emitted tokens of probability 0" if v.impossible else \
            f"p = {v.p_value:.3g} < alpha {v.alpha:g} (" + ", ".join(f"{k} {p:.3g}" for k, p in v.p_values.items()) + ")"
        rep.add(Finding(Verdict.FAIL, "distribution", None, None, message=f"emitted tokens are not draws from the "
                        f"target's sampling distribution: {what}; {where}", details=v.to_json()))
    elif v.verdict == "inconclusive" and hidden:
        rep.inconclusive.append(f"distribution: p = {v.p_value:.3g} on {where}; {v.n_required} tokens are needed for power "
                                f"{v.power:g} against a {v.effect:g}-SD shift at alpha {v.alpha:g} "
                                f"({len(hidden)} requests hide their randomness)")


def judge_temperature(rep: Report, leans: Leans, emitted: dict[tuple[str, int], int] | None = None) -> None:
    """The temperature check over a trace's keyed draws (:mod:`refcheck.diff.temperature`): a finding and
    stats (with ``emitted``, :func:`refcheck.diff.temperature.emitted_after`, the emitted tokens after which it
    first fails). When it fails, no deviation in the trace stays triaged as rounding."""
    v = judge_leans(leans, emitted_after=emitted)
    rep.stats["temperature"] = v.to_json()
    if not leans.keyed_draws:
        return  # no draw with a known uniform: nothing to judge (the distributional test covers the trace)
    rep.check("temperature")
    if v.verdict != "fail":
        return
    where = "the temperature check"
    rep.add(Finding(Verdict.FAIL, "temperature", None, None,
                    message=f"the sampled draws that differ from the reference's lean to a {v.side} temperature: "
                            f"{max(v.higher, v.lower)} of {v.higher + v.lower} verify steps ({v.draws_higher} draws "
                            f"higher, {v.draws_lower} lower, of {v.keyed_draws} keyed draws); p = {v.p_value:.3g} < "
                            f"alpha {v.alpha:g} even for a correct engine whose steps lean {50 + 100 * v.slack:g} / "
                            f"{50 - 100 * v.slack:g}"
                            + (f" (failing from {v.fails_after_tokens} emitted tokens on)" if v.fails_after_tokens else "")
                            + ". Rounding moves draws either way alike: the engine samples at a temperature other "
                            "than the request's",
                    details=v.to_json()))
    rep.stats["temperature"]["withdrawn"] = withdraw_trace(rep, where)
