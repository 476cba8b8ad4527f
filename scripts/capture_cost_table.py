"""capture_cost's table: one markdown row per cell from its row (``scripts/capture_cost.py: row_of``, readings of
``scripts/capture_cost_readings.py``).

Contract: :func:`markdown` prints the rows as they are, computing nothing: an error row as its error; a measured row's
untraced pass and its spread, the full and sampled overheads with their per-round readings, the books' batch
columns, the writer's cost, bytes per step, tokens, verdicts, diff speed and the reading against the targets.
"""

from __future__ import annotations

from typing import Any

from capture_cost_readings import FULL_LIMIT, SAMPLED_LIMIT


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _bytes(r: dict[str, Any]) -> str:
    """The written trace's bytes per step, and beside them the steps' alone (a row that has them): a short or long
    timed run's file also holds its provenance and requests, which do not grow with the steps."""
    alone = r.get("step_bytes_per_step")
    return _fmt(r.get("bytes_per_step"), ".0f") + ("" if alone is None else f" ({_fmt(alone, '.0f')})")


def _ledger(cost: dict[str, Any]) -> str:
    """The engine's own books: a plain decode batch's ms, a recorded one's and the hooks' share of it; where booked,
    the hooks' device computations per recorded batch replayed from CUDA graphs and run eagerly (the eager runs by
    cache, where any ran)."""
    parts = cost.get("parts_ms_per_batch") or {}
    split = ", ".join(f"{k} {_fmt(v)}" for k, v in parts.items() if v)
    eager = ", ".join(f"{k} {_fmt(v, '.3g')}" for k, v in (cost.get("graph_eager_by_cache") or {}).items() if v)
    graphs = (f"; graphs {_fmt(cost['graph_replays_per_batch'])} replayed / {_fmt(cost.get('graph_eager_per_batch'))} "
              f"eager{f' ({eager})' if eager else ''}" if cost.get("graph_replays_per_batch") is not None else "")
    return (f"{_fmt(cost.get('plain_ms_per_batch'))} / {_fmt(cost.get('recorded_ms_per_batch'))} "
            f"({_fmt(cost.get('hooks_ms_per_batch'))}{': ' + split if split else ''}{graphs})")


def _unrecorded(costs: dict[str, Any]) -> str:
    """An unrecorded decode batch's ms in the untraced passes and in the sampled ones, and the hooks' pass-over of
    it (and, where booked, the ms of the sampled passes' plain batches that come right after a recorded one): what a
    sampled run costs the batches it does not record."""
    u, s = costs.get("untraced") or {}, costs.get("sampled") or {}
    after = f"; next {_fmt(s['next_ms_per_batch'])}" if s.get("next_ms_per_batch") is not None else ""
    return (f"{_fmt(u.get('plain_ms_per_batch'))} / {_fmt(s.get('plain_ms_per_batch'))} "
            f"({_fmt(s.get('passed_ms_per_plain_batch'), '.3f')}{after})")


def _booked(b: dict[str, float] | None, steps: dict[str, Any] | None = None) -> str:
    """``, booked RATIO×``: the ratio the engine's books account for (:func:`booked`); with ``steps`` (the per-round
    ratios of the seconds booked to ``run_batch``), ``; run_batch per round MEDIAN [LO–HI]``."""
    out = "" if not b else f", booked {b['ratio']:.2f}×"
    if steps:
        out += f"; run_batch per round {_median_text(steps)}"
    return out


def _median_text(rounds: dict[str, Any]) -> str:
    """``MEDIAN [LO–HI]``: a per-round reading's median and its 95 % interval (when it has one)."""
    ci = rounds.get("ci95")
    return f"{rounds['median']:.3f}" + (f" [{ci[0]:.3f}–{ci[1]:.3f}]" if ci else "")


def _spread(rounds: dict[str, Any] | None) -> str:
    """`` (per round MEDIAN [LO–HI] of N, MIN–MAX)``: the ratio within each round, its median with that median's 95 %
    interval, and its range."""
    if not rounds:
        return ""
    return f" (per round {_median_text(rounds)} of {rounds['rounds']}, {rounds['min']:.2f}–{rounds['max']:.2f})"


def _round(r: dict[str, Any]) -> str:
    """The tokens column's second half: the sampled and full passes against the untraced pass of their round, a kind
    that differed followed by how many of its rounds did (where the run recorded them)."""
    same, rounds = r.get("tokens_same_round") or {}, r.get("round_mismatch") or {}

    def text(kind: str) -> str:
        differed = rounds.get(kind)
        return f"{same.get(kind, '—')}" + (f" ({len(differed)} of {len(r['passes'][kind])} rounds: "
                                           f"{','.join(map(str, differed[:3]))}{'…' if len(differed) > 3 else ''})"
                                           if differed and r.get("passes") else "")

    return f"; {text('sampled')}/{text('full')}" if same else ""


def _target(r: dict[str, Any]) -> str:
    """The per-round ratios read against the targets (:func:`against`): full / sampled, an undecided one with about
    how many rounds would decide it (:func:`rounds_to_decide`)."""
    t, n = r.get("target") or {}, r.get("decide_rounds") or {}

    def text(kind: str) -> str:
        return t.get(kind, "—") + (f" (~{n[kind]} rounds)" if n.get(kind) else "")

    return f"≤{FULL_LIMIT[bool(r['graphs'])]}: {text('full')} / ≤{SAMPLED_LIMIT}: {text('sampled')}"


def markdown(rows: list[dict[str, Any]], sample: int) -> str:
    head = (f"| algorithm | graphs | workload | steps | untraced s (max/min) | full capture (first pass) | 1 in {sample} | "
            f"batch ms plain / recorded (hooks) | unrecorded batch ms, untraced / 1 in {sample} (its pass-over) | "
            "writer ms/record | bytes/step (steps alone) | "
            "tokens same (untraced / sampled / full; sampled / full as their round's untraced) | "
            "verdict (full / sampled) | diff steps/s | target, per round (full / sampled) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['algorithm']} | {'on' if r['graphs'] else 'off'} | {r['workload']} | "
        + (f"error: {r['error'][:120]} | | | | | | | | | | | |\n" if "error" in r else
           f"{r.get('steps', '— (trace not read)')} | {_fmt(r['untraced_s'], '.3f')} ({_fmt(r.get('untraced_spread'))}) | "
           f"{_fmt(r['overhead_full'])}× ({_fmt(r.get('overhead_captured'))}×)"
           f"{_spread((r.get('per_round') or {}).get('full'))} | "
           f"{_fmt(r['overhead_sampled'])}×{_spread((r.get('per_round') or {}).get('sampled'))}"
           f"{_booked((r.get('booked') or {}).get('sampled'), (r.get('per_round_run_batch') or {}).get('sampled'))} | "
           f"{_ledger(r.get('ledger') or {})} | {_unrecorded(r.get('pass_costs') or {})} | "
           f"{_fmt((r.get('ledger') or {}).get('writer_ms_per_record'))} | {_bytes(r)} | "
           f"{r['tokens_same_untraced']}/{r['tokens_same_sampled']}/{r.get('tokens_same_full')}{_round(r)} | "
           f"{r.get('verdict', '—')} / {r.get('sampled_verdict', '—')} ({r.get('sampled_steps', '—')} steps) | "
           f"{_fmt(r.get('diff_steps_per_s'), '.1f')} | {_target(r)} |\n")
        for r in rows)
    return head + body
