"""Statistics on measured acceptance lengths, for comparison with published baselines.

Input convention: ``tau`` is the acceptance length of one verify round (one "step") with the bonus
token INCLUDED, an integer in ``1..block_size``. ``taus_by_request`` groups the steps of each
request (prompt) in a list; steps within one request are correlated (same text, same difficulty),
so uncertainty is estimated by resampling whole requests (cluster bootstrap), not steps.

The mean acceptance length is the pooled ratio ``sum(all taus) / n_steps`` (what papers report as
"tau": total tokens emitted per verify round), not the mean of per-request means.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "acceptance_verdict",
    "bootstrap_mean_ci",
    "histogram",
    "histogram_distance",
    "per_position_acceptance",
    "positions_from_histogram",
]

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


def _as_requests(taus_by_request: Sequence[Sequence[int]]) -> list[np.ndarray]:
    reqs = []
    for i, r in enumerate(taus_by_request):
        a = np.asarray(list(r), dtype=np.int64)
        if a.ndim != 1:
            raise ValueError(f"request {i}: taus must be a flat list of ints")
        if a.size and a.min() < 1:
            raise ValueError(f"request {i}: tau {a.min()} < 1 (tau includes the bonus token)")
        if a.size:
            reqs.append(a)
    return reqs


def _check_taus(taus: Sequence[int], block_size: int) -> np.ndarray:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    a = np.asarray(list(taus), dtype=np.int64)
    if a.size == 0:
        raise ValueError("no acceptance lengths given")
    if a.min() < 1 or a.max() > block_size:
        raise ValueError(f"tau values must lie in 1..{block_size} (bonus included); "
                         f"got min {a.min()}, max {a.max()}")
    return a


def _boot_indices(n_clusters: int, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_clusters, size=(n_boot, n_clusters))


def bootstrap_mean_ci(taus_by_request: Sequence[Sequence[int]], n_boot: int = 2000,
                      alpha: float = 0.05, seed: int = 0) -> tuple[float, float, float]:
    """Pooled mean tau and a percentile ``1 - alpha`` cluster-bootstrap CI: ``(mean, lo, hi)``.

    Each of ``n_boot`` replicates draws as many requests as there are (non-empty) requests, with
    replacement, and takes the pooled mean of their steps. Deterministic for a given ``seed``.
    With a single request there is no between-request variation to resample, so the steps are
    resampled individually instead; that CI ignores within-request correlation and is too
    narrow (``acceptance_verdict`` refuses to decide on fewer than ``min_requests`` requests).
    Empty requests are ignored; no steps at all raises ``ValueError``.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    reqs = _as_requests(taus_by_request)
    if not reqs:
        raise ValueError("no acceptance lengths given")
    if len(reqs) == 1:
        reqs = [np.array([t]) for t in reqs[0]]
    sums = np.array([r.sum() for r in reqs], dtype=np.float64)
    lens = np.array([r.size for r in reqs], dtype=np.float64)
    mean = float(sums.sum() / lens.sum())
    boots = np.empty(n_boot)
    chunk = max(1, 2_000_000 // len(reqs))
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = _boot_indices(len(reqs), stop - start, seed + start)
        boots[start:stop] = sums[idx].sum(axis=1) / lens[idx].sum(axis=1)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    # the percentile interval of a ratio estimator can (rarely, tiny samples) exclude the
    # point estimate; widen it to contain the mean so "CI contains the mean" always holds.
    return mean, float(min(lo, mean)), float(max(hi, mean))


def per_position_acceptance(taus: Sequence[int], block_size: int) -> list[float]:
    """``P(tau > d)`` for ``d = 1..block_size-1``: the fraction of steps that accepted at least
    ``d`` drafted tokens (tau counts the bonus token, so ``tau > d`` <=> ``>= d`` drafts accepted).
    Non-increasing in ``d`` by construction."""
    a = _check_taus(taus, block_size)
    return [float(np.mean(a > d)) for d in range(1, block_size)]


def histogram(taus: Sequence[int], block_size: int) -> list[float]:
    """Fractions of steps with ``tau = 1..block_size`` (sums to 1)."""
    a = _check_taus(taus, block_size)
    counts = np.bincount(a, minlength=block_size + 1)[1:]
    return [float(c) / a.size for c in counts]


def positions_from_histogram(hist: Sequence[float]) -> list[float]:
    """Per-position acceptance ``P(tau > d)``, d = 1..len(hist)-1, from a tau histogram
    (fractions for tau = 1..block_size, normalised to sum 1), e.g. a published one."""
    p = _normalise(hist, "hist")
    tail = np.cumsum(p[::-1])[::-1]  # tail[k] = P(tau >= k+1)
    return [float(x) for x in tail[1:]]


def _normalise(p: Sequence[float], name: str) -> np.ndarray:
    a = np.asarray(list(p), dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence")
    if np.any(a < 0) or not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has negative or non-finite entries")
    s = a.sum()
    if s <= 0:
        raise ValueError(f"{name} sums to 0")
    return a / s


def histogram_distance(p: Sequence[float], q: Sequence[float]) -> float:
    """Total-variation distance ``0.5 * sum |p - q|`` in [0, 1]. Each argument is normalised to
    sum 1 first (transcribed histograms are rounded); lengths must be equal."""
    a, b = _normalise(p, "p"), _normalise(q, "q")
    if a.size != b.size:
        raise ValueError(f"histograms differ in length: {a.size} vs {b.size}")
    return float(0.5 * np.abs(a - b).sum())


def _position_cis(reqs: list[np.ndarray], block_size: int, n_boot: int, alpha: float,
                  seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Cluster-bootstrap percentile CIs of P(tau > d), d = 1..block_size-1 (same scheme as
    bootstrap_mean_ci, including the single-request fallback)."""
    if len(reqs) == 1:
        reqs = [np.array([t]) for t in reqs[0]]
    depths = np.arange(1, block_size)
    hits = np.array([[np.sum(r > d) for d in depths] for r in reqs], dtype=np.float64)
    lens = np.array([r.size for r in reqs], dtype=np.float64)
    idx = _boot_indices(len(reqs), n_boot, seed + 7919)
    boots = hits[idx].sum(axis=1) / lens[idx].sum(axis=1)[:, None]
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2], axis=0)
    return lo, hi


def acceptance_verdict(taus_by_request: Sequence[Sequence[int]], baseline_tau: float,
                       rtol: float = 0.05, position_floor: float = 0.0,
                       baseline_positions: Sequence[float] | None = None, min_steps: int = 30,
                       *, min_requests: int = 2, n_boot: int = 2000, alpha: float = 0.05,
                       seed: int = 0) -> dict:
    """Compare measured acceptance lengths with a published mean tau (and per-position rates).

    Decision rule (in the spirit of vLLM's spec-decode acceptance tests: a measured rate must not
    fall below a published/expected one by more than a tolerance, here with the sample size
    accounted for by a cluster-bootstrap CI over requests):

    Let ``band = [b*(1-rtol), b*(1+rtol)]`` with ``b = baseline_tau``, ``(mean, lo, hi)`` the
    pooled mean and its ``1-alpha`` bootstrap CI, and ``h = max(mean-lo, hi-mean)`` its half-width.
    Steps are evaluated in this order:

    1. ``n_steps < min_steps`` -> INCONCLUSIVE (``inconclusive_reason="too_few_steps"``).
    2. ``n_requests < min_requests`` -> INCONCLUSIVE (``"too_few_requests"``): with one request
       the within-request correlation cannot be estimated.
    3. ``hi < band[0]`` -> FAIL: the mean is significantly below the allowed band (this holds at
       any CI width, so it is checked before the width).
       With ``baseline_positions`` (``P(tau > d)`` for d = 1..block_size-1): a position whose CI
       upper bound is below ``baseline_positions[d] - position_floor`` is significantly worse and
       also gives FAIL.
    4. ``h > rtol * b`` -> INCONCLUSIVE (``"ci_too_wide"``): the CI is wider than the band, so
       the sample cannot tell a run inside the band from one a whole band-width below it.
       Collect more requests.
    5. A position whose point estimate is below ``baseline - position_floor`` but not
       significantly so -> INCONCLUSIVE (``"position_not_significant"``).
    6. Otherwise PASS: the mean is not significantly below the band, the CI is at most the band's
       width (so PASS implies ``mean >= b*(1-2*rtol)``), and every per-position acceptance is at
       least its baseline minus ``position_floor``.

    A mean significantly ABOVE the band (``lo > band[1]``) is still PASS but adds a note: the run
    beats the published figure, which may mean its conditions differ (prompts, template, length).

    ``block_size`` for the per-position statistics is ``len(baseline_positions) + 1``, or the
    largest observed tau when no baseline positions are given.

    Returns a JSON-serialisable dict with keys ``verdict``, ``inconclusive_reason`` (None unless
    INCONCLUSIVE), ``reason`` (one line), ``mean``, ``ci`` ([lo, hi] or None), ``ci_level``,
    ``ci_halfwidth``, ``max_halfwidth``, ``n_steps``, ``n_requests``, ``baseline_tau``, ``rtol``,
    ``band``, ``delta`` (mean - b), ``rel_delta``, ``positions`` (list of per-depth dicts with
    ``depth, observed, ci, baseline, delta, threshold, status`` where status is
    ``ok | below | significantly_below``; None without ``baseline_positions``), ``observed_positions``,
    ``notes`` and ``rule``.
    """
    _check_verdict_args(baseline_tau, rtol, position_floor)
    reqs = _as_requests(taus_by_request)
    n_steps = int(sum(r.size for r in reqs))
    b = float(baseline_tau)
    band = [b * (1 - rtol), b * (1 + rtol)]
    out = _undecided(n_steps, len(reqs), b, rtol, band, rtol * b, alpha)
    if n_steps == 0:
        return _done(out, INCONCLUSIVE, f"no steps (need >= {min_steps})", "too_few_steps")
    mean, lo, hi, sig_below, below = _measure(out, reqs, baseline_positions, position_floor, n_boot, alpha, seed)
    return _decide(out, mean, lo, hi, alpha, sig_below, below, min_steps, min_requests)


def _check_verdict_args(baseline_tau: float, rtol: float, position_floor: float) -> None:
    if baseline_tau <= 0:
        raise ValueError(f"baseline_tau must be > 0, got {baseline_tau}")
    if not 0 <= rtol < 1:
        raise ValueError(f"rtol must be in [0, 1), got {rtol}")
    if position_floor < 0:
        raise ValueError(f"position_floor must be >= 0, got {position_floor}")


def _done(out: dict, verdict: str, reason: str, why: str | None = None) -> dict:
    """:func:`acceptance_verdict`'s record with its verdict, its one-line reason and, when INCONCLUSIVE, why."""
    out["verdict"], out["reason"], out["inconclusive_reason"] = verdict, reason, why
    return out


def _measure(out: dict, reqs: list[np.ndarray], baseline_positions: Sequence[float] | None, position_floor: float,
             n_boot: int, alpha: float, seed: int) -> tuple[float, float, float, list[int], list[int]]:
    """Fill in :func:`acceptance_verdict`'s statistics: the pooled mean and its CI, the per-position
    acceptance and, with ``baseline_positions``, the per-depth rows. Returns ``(mean, lo, hi, depths
    significantly below, depths below)`` (the depths: their baseline minus ``position_floor``)."""
    if baseline_positions is not None:
        bpos = np.asarray(list(baseline_positions), dtype=np.float64)
        block_size = bpos.size + 1
    else:
        bpos = None
        block_size = int(max(r.max() for r in reqs))
    all_taus = np.concatenate(reqs)
    if all_taus.max() > block_size:
        raise ValueError(f"observed tau {all_taus.max()} exceeds block_size {block_size} "
                         f"implied by baseline_positions")

    mean, lo, hi = bootstrap_mean_ci(reqs, n_boot=n_boot, alpha=alpha, seed=seed)
    h = max(mean - lo, hi - mean)
    b = out["baseline_tau"]
    out.update(mean=mean, ci=[lo, hi], ci_halfwidth=h, delta=mean - b, rel_delta=(mean - b) / b)
    observed = per_position_acceptance(all_taus.tolist(), block_size) if block_size > 1 else []
    out["observed_positions"] = observed

    sig_below: list[int] = []
    below: list[int] = []
    if bpos is not None and block_size > 1:
        plo, phi = _position_cis(reqs, block_size, n_boot, alpha, seed)
        out["positions"] = _position_rows(observed, bpos, plo, phi, position_floor, sig_below, below)
    return mean, lo, hi, sig_below, below


def _undecided(n_steps: int, n_requests: int, b: float, rtol: float, band: list[float], max_h: float,
               alpha: float) -> dict:
    """:func:`acceptance_verdict`'s record before the statistics and the verdict are filled in."""
    return {
        "verdict": None, "inconclusive_reason": None, "reason": "",
        "mean": None, "ci": None, "ci_level": 1 - alpha, "ci_halfwidth": None,
        "max_halfwidth": max_h, "n_steps": n_steps, "n_requests": n_requests,
        "baseline_tau": b, "rtol": rtol, "band": band, "delta": None, "rel_delta": None,
        "positions": None, "observed_positions": None, "notes": [],
        "rule": ("FAIL if CI upper < band low or a position's CI upper < baseline-floor; "
                 "INCONCLUSIVE if n_steps < min_steps, n_requests < min_requests, "
                 "CI half-width > rtol*baseline, or a position estimate < baseline-floor "
                 "without significance; else PASS"),
    }


def _position_rows(observed: Sequence[float], bpos: np.ndarray, plo: np.ndarray, phi: np.ndarray,
                   position_floor: float, sig_below: list[int], below: list[int]) -> list[dict]:
    """:func:`acceptance_verdict`'s per-depth rows; the depths significantly below (and below, not
    significantly) their baseline minus ``position_floor`` are appended to ``sig_below`` (``below``)."""
    positions = []
    for d in range(1, len(bpos) + 1):
        obs, base = observed[d - 1], float(bpos[d - 1])
        thr = base - position_floor
        if phi[d - 1] < thr:
            status = "significantly_below"
            sig_below.append(d)
        elif obs < thr:
            status = "below"
            below.append(d)
        else:
            status = "ok"
        positions.append({"depth": d, "observed": obs, "ci": [float(plo[d - 1]),
                          float(phi[d - 1])], "baseline": base, "delta": obs - base,
                          "threshold": thr, "status": status})
    return positions


def _decide(out: dict, mean: float, lo: float, hi: float, alpha: float, sig_below: list[int], below: list[int],
            min_steps: int, min_requests: int) -> dict:
    """Steps 1-6 of :func:`acceptance_verdict`'s decision rule, its statistics measured."""
    n_steps, n_requests, max_h = out["n_steps"], out["n_requests"], out["max_halfwidth"]
    b, rtol, band = out["baseline_tau"], out["rtol"], out["band"]
    if n_steps < min_steps:
        return _done(out, INCONCLUSIVE, f"too few steps: {n_steps} < min_steps={min_steps}",
                     "too_few_steps")
    if n_requests < min_requests:
        out["notes"].append("single-request CI resamples steps and ignores their correlation")
        return _done(out, INCONCLUSIVE, f"too few requests: {n_requests} < min_requests={min_requests}",
                     "too_few_requests")
    h = out["ci_halfwidth"]
    stats = f"mean tau {mean:.3f}, {100 * (1 - alpha):g}% CI [{lo:.3f}, {hi:.3f}]"
    if hi < band[0] or sig_below:
        parts = []
        if hi < band[0]:
            parts.append(f"{stats} is significantly below the band low {band[0]:.3f} "
                         f"(baseline {b:.3f}, rtol {rtol:g})")
        if sig_below:
            parts.append(f"per-position acceptance significantly below baseline-floor at "
                         f"depth(s) {sig_below}")
        return _done(out, FAIL, "; ".join(parts))
    if h > max_h:
        return _done(out, INCONCLUSIVE, f"CI too wide: half-width {h:.3f} > rtol*baseline {max_h:.3f} "
                     f"({stats}, {n_requests} requests); add requests", "ci_too_wide")
    if below:
        return _done(out, INCONCLUSIVE, f"per-position acceptance below baseline-floor at depth(s) "
                     f"{below}, not significantly; add requests", "position_not_significant")
    if lo > band[1]:
        out["notes"].append(f"mean significantly above the band high {band[1]:.3f}: better than "
                            f"published; check that the conditions match")
    return _done(out, PASS, f"{stats} is not significantly below the band low {band[0]:.3f} "
                 f"(baseline {b:.3f}, rtol {rtol:g})")
