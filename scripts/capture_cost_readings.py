"""What a capture_cost cell's passes and books say: the per-round ratios, their readings against the issue's targets,
the ratio the engine's books account for, and earlier runs' rows re-read or pooled.

Contract: pure functions of a row's ``passes`` ({kind: wall seconds per pass}, kinds ``untraced``, ``sampled`` and
``full``, round r holding pass r of each) and ``pass_costs`` (the engine's cost ledger per kind,
:func:`refcheck.sglang.capture.shipper.ledger_summary`): :func:`medians` (each kind's median pass over the untraced
one), :func:`readings` (each pass over its own round's untraced pass, :func:`per_round`, with the median's 95 %
interval, :func:`median_interval`, read against :data:`FULL_LIMIT` and :data:`SAMPLED_LIMIT` by :func:`against`),
:func:`booked` and :func:`ledger_of` (the books behind the table's batch columns); :func:`reread` and :func:`pooled`
recompute them for rows of earlier runs' ``capture_cost.json``. No engine, no I/O: ``scripts/capture_cost.py`` runs
the cells, ``scripts/capture_cost_table.py`` prints the rows.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing or zero."""
    return a / b if a and b else None


def _median(times: list[float] | None) -> float | None:
    return statistics.median(times) if times else None


#: the issue's targets: full capture within 1.5x with CUDA graphs and 1.3x without, 1 in 16 within 1.05x (held to for
#: DFLASH and NGRAM; the other algorithms' cells are read against the same lines)
FULL_LIMIT = {True: 1.5, False: 1.3}
SAMPLED_LIMIT = 1.05


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``values``: the order statistics
    [x_(k), x_(n+1-k)] (1-based) for the largest k with P(Bin(n, 1/2) < k) <= (1 - level) / 2, so it covers the
    median with probability at least ``level`` whatever the values' distribution. None when there are too few
    values for any such k (fewer than 6 at 95 %)."""
    n, tail = len(values), (1.0 - level) / 2
    k, below = 0, 0.0  # below: P(Bin(n, 1/2) < k + 1), summed as k grows
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def per_round(passes: list[float], untraced: list[float]) -> dict[str, Any] | None:
    """Each round's pass over the same round's untraced pass (a round runs one pass of each kind, so a drift of the
    engine's speed over the rounds cancels): their median, its 95 % interval (:func:`median_interval`; None with
    fewer than 6 rounds), min and max; None without a round of both."""
    ratios = [a / b for a, b in zip(passes, untraced) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "ci95": median_interval(ratios), "min": min(ratios),
            "max": max(ratios), "rounds": len(ratios)}


def against(rounds: dict[str, Any] | None, limit: float) -> str:
    """A kind's per-round ratios read against a target: ``within`` when the median's 95 % interval lies at or under
    ``limit``, ``over`` when it lies above it, ``undecided`` when it straddles it (more rounds decide), ``—`` without
    an interval."""
    ci = (rounds or {}).get("ci95")
    if not ci:
        return "—"
    return "within" if ci[1] <= limit else "over" if ci[0] > limit else "undecided"


def rounds_to_decide(rounds: dict[str, Any] | None, limit: float) -> int | None:
    """For an undecided reading (:func:`against`), about how many rounds would decide it if the median stayed where
    it is: the interval's half-width on the median's side of ``limit`` shrinks as one over the root of the rounds,
    so it clears ``limit`` at n * (half-width / distance to limit)^2 rounds. A planning figure for the next run's
    ``--round-budget``, not a reading. None when the reading is decided or has no interval, or the median sits on
    ``limit``."""
    ci = (rounds or {}).get("ci95")
    if not ci or against(rounds, limit) != "undecided":
        return None
    m, n = rounds["median"], rounds["rounds"]  # type: ignore[index]
    if m == limit:
        return None
    half = ci[1] - m if m < limit else m - ci[0]
    return math.ceil(n * (half / abs(limit - m)) ** 2 - 1e-9)  # 1e-9: a product that is whole up to rounding


def booked(costs: dict[str, Any], kind: str, passes: int, untraced_s: float | None) -> dict[str, float] | None:
    """What a kind's passes booked above the untraced passes' books, in ms per pass (the engine's ledger,
    :func:`refcheck.sglang.capture.shipper.ledger_summary`, summed over the kind's ``passes``): the hooks' pass-over
    of its plain decode batches (``pass_over``), the rest of their excess over an untraced plain batch
    (``plain``: e.g. the device work or the writer of a recorded batch slowing the batches after it), its recorded
    decode batches' excess (``recorded``) and its prefills' (``prefill``, recorded and plain); ``ratio``: 1 + their
    sum over the median untraced pass. None without both kinds' books."""
    mine, base = costs.get(kind) or {}, costs.get("untraced") or {}
    plain_ms, prefill_ms = base.get("plain_ms_per_batch"), base.get("plain_prefill_ms_per_batch")
    if not passes or not untraced_s or plain_ms is None:
        return None

    def excess(n_key: str, ms_key: str, against: float | None) -> float:
        n, ms = mine.get(n_key) or 0, mine.get(ms_key)
        return n * (ms - against) if n and ms is not None and against is not None else 0.0

    n_plain = mine.get("plain_batches") or 0
    pass_over = n_plain * (mine.get("passed_ms_per_plain_batch") or 0.0)
    parts = {"pass_over": pass_over, "plain": excess("plain_batches", "plain_ms_per_batch", plain_ms) - pass_over,
             "recorded": excess("recorded_batches", "recorded_ms_per_batch", plain_ms),
             "prefill": excess("prefills", "prefill_ms_per_batch", prefill_ms)
             + excess("plain_prefills", "plain_prefill_ms_per_batch", prefill_ms)}
    out = {k: v / passes for k, v in parts.items()}
    out["ratio"] = 1 + sum(out.values()) / (1000 * untraced_s)
    return out


def medians(passes: dict[str, list[float]], captured_s: float | None = None) -> dict[str, Any]:
    """Each kind's median pass and its ratio to the median untraced pass, and the untraced passes' max/min (the
    noise); without full passes the full median is ``captured_s``, the trace's own captured pass."""
    untraced, sampled = _median(passes.get("untraced")), _median(passes.get("sampled"))
    full = _median(passes.get("full")) or captured_s
    spread = passes.get("untraced") or []
    return {"full_s": full, "sampled_s": sampled, "untraced_s": untraced,
            "untraced_spread": ratio(max(spread, default=None), min(spread, default=None)),
            "overhead_full": ratio(full, untraced), "overhead_sampled": ratio(sampled, untraced)}


def ledger_of(costs: dict[str, Any], fallback: dict[str, Any] | None = None) -> dict[str, Any]:
    """The books of the table's batch columns: the full passes' (one-off costs of earlier passes left out), else the
    sampled passes' where they recorded a batch (``--no-full``), else the first captured pass's (first-use costs
    in it), else ``fallback`` (the trace's own); a plain batch's time is the untraced passes'."""
    sampled = costs.get("sampled") or {}
    books = costs.get("full") or (sampled if sampled.get("recorded_batches") else None) or costs.get("captured")
    return {**(books or fallback or {}), "plain_ms_per_batch": (costs.get("untraced") or {}).get("plain_ms_per_batch")}


def readings(passes: dict[str, list[float]], costs: dict[str, Any], graphs: bool) -> dict[str, Any]:
    """A cell's per-round readings: the full and sampled passes' wall times over their rounds' untraced ones
    (``per_round``), the same for the seconds each pass booked to ``run_batch`` (``per_round_run_batch``, from the
    kinds' ``pass_costs``), and the wall-time reading against the targets (``target``, :func:`against`)."""
    kinds = ("full", "sampled")
    rounds = {kind: per_round(passes.get(kind) or [], passes.get("untraced") or []) for kind in kinds}
    steps = {kind: per_round((costs.get(kind) or {}).get("run_batch_s") or [],
                             (costs.get("untraced") or {}).get("run_batch_s") or []) for kind in kinds}
    return {"per_round": rounds, "per_round_run_batch": steps,
            "target": {"full": against(rounds["full"], FULL_LIMIT[graphs]),
                       "sampled": against(rounds["sampled"], SAMPLED_LIMIT)},
            "decide_rounds": {"full": rounds_to_decide(rounds["full"], FULL_LIMIT[graphs]),
                              "sampled": rounds_to_decide(rounds["sampled"], SAMPLED_LIMIT)}}


def _measured(r: dict[str, Any]) -> bool:
    """A row of a cell's passes (not, say, a deadline's list of cells not run)."""
    return isinstance(r.get("passes"), dict) and "graphs" in r


def reread(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of an earlier run's JSON with their :func:`readings` and :func:`ledger_of` recomputed from the passes and
    books they hold (rows without passes, such as a deadline's list of cells not run, are left out)."""
    return [{**r, **readings(r["passes"], r.get("pass_costs") or {}, bool(r["graphs"])),
             **({"ledger": ledger_of(r["pass_costs"])} if r.get("pass_costs") else {})} for r in rows if _measured(r)]


def pooled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell (algorithm, graphs, workload) of several runs' rows (of one tree: the rounds are read as one
    sample): each kind's passes, and its passes' ``run_batch_s``, laid end to end, so every round keeps its own
    untraced pass; the medians and the readings recomputed from them (:func:`reread`); the books, which do not pool
    by pass, and the first captured pass's ratio left out; each traced kind's tokens against its round's untraced
    pass held over every run, the rounds that differed numbered in the pooled order; the first row's other fields."""
    cells: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for r in filter(_measured, rows):
        cell = cells.setdefault((r["algorithm"], r["graphs"], r["workload"]),
                                {**r, "passes": {}, "pass_costs": {}, "pooled_runs": 0, "ledger": {}, "booked": {},
                                 "overhead_captured": None, "tokens_same_round": {}, "round_mismatch": {}})
        cell["pooled_runs"] += 1
        _pool_rounds(cell, r)
        for kind, times in r["passes"].items():
            cell["passes"][kind] = cell["passes"].get(kind, []) + list(times or [])
        for kind, books in (r.get("pass_costs") or {}).items():
            _pool_books(cell["pass_costs"].setdefault(kind, {"run_batch_s": []}), books or {})
    for cell in cells.values():
        cell.update(medians(cell["passes"]))
    return reread(list(cells.values()))


def _pool_rounds(cell: dict[str, Any], r: dict[str, Any]) -> None:
    """One run's round checks added to a pooled cell's (before its passes are): a kind is the same as its rounds'
    untraced passes only where every run says so, and a run's differing rounds follow the rounds pooled before it (a
    run that recorded no rounds, only whether any differed, adds none to the count)."""
    for kind, same in (r.get("tokens_same_round") or {}).items():
        cell["tokens_same_round"][kind] = cell["tokens_same_round"].get(kind, True) and same
    for kind, rounds in (r.get("round_mismatch") or {}).items():
        before = len(cell["passes"].get(kind, []))
        cell["round_mismatch"][kind] = cell["round_mismatch"].get(kind, []) + [before + k for k in rounds]


def _pool_books(into: dict[str, Any], books: dict[str, Any]) -> None:
    """One run's books of a kind of pass added to a pooled cell's: the seconds each pass booked to ``run_batch``
    laid end to end, and an unrecorded batch's ms, the hooks' pass-over of it and the ms of a plain batch right after a
    recorded one as means weighted by batches."""
    into["run_batch_s"] += list(books.get("run_batch_s") or [])
    if _pool_means(into, books, "plain_batches", ("plain_ms_per_batch", "passed_ms_per_plain_batch")):
        _pool_means(into, books, "next_batches", ("next_ms_per_batch",))


def _pool_means(into: dict[str, Any], books: dict[str, Any], count: str, keys: tuple[str, ...]) -> bool:
    """One run's per-batch means ``keys`` (over its ``count`` batches) added to the pooled cell's, weighted by
    batches; False when the run booked no such batch or not the first of ``keys``."""
    n = int(books.get(count) or 0)
    if not n or books.get(keys[0]) is None:
        return False
    had = into.get(count, 0)
    for key in keys:
        if books.get(key) is not None:
            into[key] = (into.get(key, 0.0) * had + books[key] * n) / (had + n)
    into[count] = had + n
    return True
