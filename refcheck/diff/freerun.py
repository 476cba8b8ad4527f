"""Free-run mode: the engine's decoded tokens against target-only greedy decoding and against the
reference's own DDTree run; acceptance statistics side by side.

Contract: :func:`free_run` checks, per request, the lossless invariant (engine output == greedy
output of the target alone; the first divergence is triaged as a benign near-tie or a failure by
the reference's log-prob margin at that position) and, when a reference run is given, compares
tokens and per-step acceptance: with ``strict_acceptance`` (same dtype and device, e.g. a golden
of the reference itself) any per-step τ difference fails; otherwise the τ statistics are reported
only (acceptance is not correctness).

A sampled request (temperature > 0) is held against target-only *sampling* with the engine's own
keys (:func:`ddtree_reference.oracle.sample_decode`) when its uniforms are refcheck's position-keyed
ones; a first difference at a draw within ``cdf_tol`` of a CDF edge is a benign tie. With the
engine's own generator there is no token-level oracle: "unsupported" here, and the distributional
test of replay judges it.
"""

from __future__ import annotations

import statistics

import torch

from ddtree_reference.compat import full_forward_logits
from ddtree_reference.decode import DecodeResult
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.diff.tolerance import Tolerance
from refcheck.trace.rows import RequestRow, Trace


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _check_greedy(rep: Report, req: RequestRow, out: list[int], want: list[int], model: torch.nn.Module, device: torch.device,
                  tol: Tolerance) -> None:
    """The engine's output against target-only greedy decoding; a first difference at a near-tie is benign."""
    rid = req.request_id
    rep.check("ar_tokens")
    i = _first_diff(out, want)
    if i is None:
        return
    if i < min(len(out), len(want)):
        logits = full_forward_logits(model, torch.tensor(list(req.prompt_ids) + want[:i], device=device))[-1]
        logp = torch.log_softmax(logits, dim=-1).cpu()
        margin = float(logp[want[i]] - logp[out[i]])
        benign = margin < tol.tie_margin
        rep.add(Finding(
            Verdict.BENIGN_TIE if benign else Verdict.FAIL, "ar_tokens", rid, None, position=len(req.prompt_ids) + i,
            message=f"output differs from target greedy decoding at token {i}: engine {out[i]}, greedy {want[i]} "
                    f"(margin {margin:.4g}, {'near-tie' if benign else 'not a near-tie'})",
            details={"index": i, "engine": out[i], "greedy": want[i], "margin": margin}))
    else:
        rep.add(Finding(Verdict.FAIL, "ar_tokens", rid, None, message=f"output has {len(out)} tokens, greedy {len(want)}",
                        details={"engine_len": len(out), "greedy_len": len(want)}))


def _check_sampled(rep: Report, req: RequestRow, out: list[int], want: list[int], margins: list[float], cdf_tol: float) -> None:
    """The engine's output against target-only sampling with its keys; a first difference at a CDF edge is benign."""
    rid = req.request_id
    rep.check("ar_tokens")
    i = _first_diff(out, want)
    if i is None:
        return
    if i < min(len(out), len(want)) and i < len(margins) and margins[i] <= cdf_tol:
        rep.add(Finding(Verdict.BENIGN_TIE, "ar_tokens", rid, None, position=len(req.prompt_ids) + i,
                        message=f"output differs from target-only sampling at token {i} at a CDF edge "
                                f"(distance {margins[i]:.3g} <= {cdf_tol:.3g})"))
        return
    rep.add(Finding(Verdict.FAIL, "ar_tokens", rid, None, position=len(req.prompt_ids) + i,
                    message=f"output differs from target-only sampling with the same keys at token {i}: engine "
                            f"{out[i] if i < len(out) else '-'}, oracle {want[i] if i < len(want) else '-'}",
                    details={"index": i}))


def free_run(
    trace: Trace,
    model: torch.nn.Module,
    greedy: dict[str, list[int] | None],
    tol: Tolerance,
    reference: dict[str, DecodeResult] | None = None,
    strict_acceptance: bool = False,
    case: str = "",
    margins: dict[str, list[float] | None] | None = None,
    cdf_tol: float = 0.0,
) -> Report:
    rep = Report(case=case, mode="free")
    taus_engine: list[int] = []
    taus_ref: list[int] = []
    device = next(model.parameters()).device
    for req in trace.requests:
        rid, out = req.request_id, list(req.output_ids)
        steps = trace.steps_of(rid)
        taus_engine += [s.accept_length for s in steps]
        if not out and not steps:
            rep.add(Finding(Verdict.SKIPPED, "ar_tokens", rid, None, message="request has no output"))
            continue
        want = greedy[rid]
        if want is None:
            rep.add(Finding(Verdict.UNSUPPORTED, "ar_tokens", rid, None,
                            message="sampled with the engine's own generator: no token-level oracle"))
        elif req.sampled:
            _check_sampled(rep, req, out, want, (margins or {}).get(rid) or [], cdf_tol)
        else:
            _check_greedy(rep, req, out, want, model, device, tol)
        if reference is not None:
            ref = reference[rid]
            taus_ref += ref.accept_lengths
            rep.check("acceptance")
            eng_taus = [s.accept_length for s in steps]
            if strict_acceptance and (eng_taus != ref.accept_lengths or out != ref.output_ids):
                j = _first_diff(eng_taus, ref.accept_lengths)
                rep.add(Finding(Verdict.FAIL, "acceptance", rid, j,
                                message=f"per-step acceptance differs from the reference run (first at step {j}: "
                                        f"{eng_taus[j] if j is not None and j < len(eng_taus) else '-'} vs "
                                        f"{ref.accept_lengths[j] if j is not None and j < len(ref.accept_lengths) else '-'})"))
    rep.stats = {
        "mean_tau_engine": statistics.fmean(taus_engine) if taus_engine else None,
        "mean_tau_reference": statistics.fmean(taus_ref) if taus_ref else None,
        "steps_engine": len(taus_engine),
        "steps_reference": len(taus_ref),
        "tau_convention": "accepted drafted tokens + 1 (bonus counted)",
    }
    if taus_engine and taus_ref:
        rep.stats["mean_tau_delta"] = rep.stats["mean_tau_engine"] - rep.stats["mean_tau_reference"]
    return rep
