"""``refcheck trace show``: a trace file's summary; ``refcheck trace import``: a serving run's capture as a trace.

Contract: ``show``'s human output (stderr) is one fact a line: integrity, engine, models (hashes shortened),
run settings, requests and steps with mean τ, size, the library versions it was recorded with;
``--json`` prints every field, the whole provenance included. A corrupt trace is exit 4. ``import`` reads the
capture directory of an SGLang server started with ``REFCHECK_CAPTURE_DIR`` (:mod:`refcheck.sglang.served`) and
writes its trace atomically to ``--out``, saying how many requests and steps it holds and which requests were left
out and why; a directory that is not such a capture, or models not found here, is exit 2, nothing written.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import click

from refcheck.cli.app import err, main
from refcheck.errors import EXIT_PASS


@main.group()
def trace() -> None:
    """Inspect trace files."""

@trace.command("show")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def trace_show(path, as_json):
    """Summarise a trace: provenance, requests, steps, mean τ, bytes per step (and the steps' own)."""
    from refcheck.trace.io import read_trace
    from refcheck.trace.schema import SCHEMA_VERSION

    t = read_trace(path)
    size = path.stat().st_size
    taus = [s.accept_length for s in t.steps]
    alone = _step_bytes(t, size) if t.steps and t.schema_version == SCHEMA_VERSION else None
    info = {"path": str(path), "schema_version": t.schema_version,
            "integrity": "checksums verified" if t.checksummed else "unchecked (schema 1.0 file: no checksums)", "bytes": size, "requests": len(t.requests),
            "steps": len(t.steps), "bytes_per_step": size / max(len(t.steps), 1), "step_bytes_per_step": alone,
            "mean_tau": statistics.fmean(taus) if taus else None, "provenance": t.provenance}
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        for line in summary_lines(info, [r.request_id for r in t.requests]):
            err.print(line, markup=False, soft_wrap=True)
    sys.exit(EXIT_PASS)


def _step_bytes(t: Any, size: int) -> float | None:
    """A current-schema file's bytes per step less its fixed part (:func:`refcheck.trace.io.fixed_bytes`); None
    where its provenance cannot be written again as written (a file made elsewhere, NaN in it)."""
    from refcheck.trace.io import fixed_bytes
    from refcheck.trace.schema import TraceValidationError

    try:
        return (size - fixed_bytes(t)) / len(t.steps)
    except TraceValidationError:
        return None


@trace.command("import")
@click.argument("capture_dir", type=click.Path(path_type=Path))
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="The trace file to write.")
@click.option("--model-dir", "model_dir", type=click.Path(path_type=Path), default=None,
              help="The target's checkpoint directory here (default: the server's --model-path).")
@click.option("--draft-dir", "draft_dir", type=click.Path(path_type=Path), default=None,
              help="The drafter's checkpoint directory here (default: the server's draft model path).")
@click.option("--running", is_flag=True,
              help="The server is still serving: records queued but not yet written are in flight, not an error.")
@click.option("--last-records", "last_records", type=int, default=None, metavar="N",
              help="Read only each scheduler process's last N records (a long run's latest part); requests that "
                   "began before them are left out.")
def trace_import(capture_dir: Path, out: Path, model_dir: Path | None, draft_dir: Path | None, running: bool,
                 last_records: int | None) -> None:
    """Turn the capture directory of an SGLang server you started (REFCHECK_CAPTURE_DIR) into a trace to diff."""
    from refcheck.outputs import check_output_file
    from refcheck.sglang.served import served_trace
    from refcheck.trace.io import write_trace

    check_output_file(out, "--out")
    served = served_trace(capture_dir, model_dir, draft_dir, running=running, last_records=last_records)
    asm = served.assembly
    size = write_trace(asm.trace, out)
    steps = len(asm.trace.steps)
    err.print(f"{out}: {len(asm.trace.requests)} request(s), {steps} verify step(s), {size:,} bytes", markup=False)
    if asm.stats.get("in_flight_batches"):
        err.print(f"in flight: {asm.stats['in_flight_batches']} batch record(s) queued but not yet written",
                  markup=False)
    for why, n in sorted(served.left_out.items()):
        err.print(f"left out: {n} request(s) with {why}", markup=False)
    if served.state_not_judged:
        err.print(f"state not judged: {served.state_not_judged}", markup=False)
    if asm.problems:
        err.print(f"{len(asm.problems)} problem(s) in the records (refcheck trace show --json {out} lists them)",
                  markup=False)
    err.print(f"next: refcheck diff --against {out}", markup=False)
    sys.exit(EXIT_PASS)


def _short(v) -> str:
    return v[:12] + "…" if isinstance(v, str) and len(v) == 64 else str(v)


def summary_lines(info: dict, request_ids: list[str]) -> list[str]:
    """The human summary of ``trace show``: one fact a line, hashes shortened (``--json`` has them whole)."""
    p = info["provenance"]
    eng = _mapping(p.get("engine"))
    settings = _mapping(eng.get("settings"))
    tau = info["mean_tau"]
    lines = [f"{info['path']}: schema {info['schema_version']}, {info['integrity']}",
             f"engine: {eng.get('name', '?')} {eng.get('version', '')}".rstrip()
             + (f" · algorithm {settings['algorithm']}" if settings.get("algorithm") else ""),
             f"model: {p.get('model', '?')} (sha256 {_short(p.get('model_sha256'))})"
             + (f" · draft {settings.get('draft_dir') or 'of the pair'} (sha256 {_short(p['draft_sha256'])})"
                if p.get("draft_sha256") else " · no draft model"),
             f"run: {p.get('dtype', '?')} on {p.get('device', '?')} · budget {p.get('budget', '?')} · block size "
             f"{p.get('block_size', '?')} · drafter {p.get('drafter', '?')} · up to {p.get('max_new_tokens', '?')} new tokens",
             f"requests: {info['requests']} ({', '.join(request_ids)}) · verify steps: {info['steps']} · mean τ "
             + (f"{tau:.3f}" if tau is not None else "-") + " (bonus counted)",
             f"size: {info['bytes']:,} bytes, {info['bytes_per_step']:,.0f} per step"
             + (f" ({info['step_bytes_per_step']:,.0f} the steps alone, without the header, provenance and requests)"
                if info.get("step_bytes_per_step") is not None else ""),
             "recorded with: " + ", ".join(f"{k} {v}" for k, v in _mapping(p.get("versions")).items())
             + (f" · {p['created']}" if p.get("created") else "")]
    if p.get("case"):
        lines.append(f"golden case: {p['case']}")
    if settings.get("served"):  # refcheck trace import: a server refcheck did not start
        left = _mapping(settings.get("left_out"))
        lines.append("served: the capture of a server refcheck did not start; left out: "
                     + ("; ".join(f"{n} request(s) with {why}" for why, n in sorted(left.items())) or "none"))
    lines += capture_lines(_mapping(p.get("capture")))
    lines.append("everything else: refcheck trace show --json")
    return lines


def _mapping(v: object) -> dict:
    """A provenance field that should be a mapping, as one (anything else, e.g. a hand-edited trace's string: empty)."""
    return v if isinstance(v, dict) else {}


def _ms(v: object) -> str:
    return f"{v:.3f} ms" if isinstance(v, (int, float)) else "-"


def capture_lines(cap: dict) -> list[str]:
    """An engine capture's lines of the summary: which steps it holds (its sampling rule, batches lost to a full
    queue or past its byte budget), its errors, and what it cost the engine (its ledger, per batch)."""
    if not cap:
        return []
    lines = []
    stats, sample = _mapping(cap.get("stats")), _mapping(cap.get("sample"))
    every = sample.get("every", 1)
    held = ["every batch" if every == 1 else f"1 batch in {every} (seed {sample.get('seed', 0)})"]
    if stats.get("lost_batches"):
        held.append(f"{stats['lost_batches']} batch record(s) lost to a full queue")
    if isinstance(cap.get("max_bytes"), int):
        held.append(f"a {'rolling ' if cap.get('roll') else ''}budget of {cap['max_bytes'] / (1 << 20):g} MiB per "
                    "process"
                    + (f", {stats['over_budget_batches']} batch(es) past it" if stats.get("over_budget_batches") else "")
                    + (f", its {stats['rolled_out_records']} oldest record(s) deleted"
                       if stats.get("rolled_out_records") else ""))
    lines.append("capture: " + " · ".join(held))
    if cap.get("errors") or cap.get("problems") or cap.get("incomplete"):
        lines.append(f"capture: {len(cap.get('errors') or [])} error(s), {len(cap.get('problems') or [])} problem(s)"
                     + (", incomplete" if cap.get("incomplete") else "") + " (--json for the list)")
    cost = _mapping(stats.get("capture_cost"))
    if cost.get("recorded_batches") or cost.get("plain_batches"):
        lines.append(f"capture cost: {cost.get('recorded_batches', 0)} recorded batch(es) of "
                     f"{_ms(cost.get('recorded_ms_per_batch'))} (hooks {_ms(cost.get('hooks_ms_per_batch'))}), "
                     f"{cost.get('plain_batches', 0)} plain of {_ms(cost.get('plain_ms_per_batch'))} (passing over "
                     f"{_ms(cost.get('passed_ms_per_plain_batch'))}) · writer {_ms(cost.get('writer_ms_per_record'))} "
                     "per record" + _graph_runs(cost))
    return lines


def _graph_runs(cost: dict) -> str:
    """The capture's device work per recorded batch replayed from CUDA graphs and run eagerly, the caches that ran
    eagerly named (empty where the ledger booked no graph counts)."""
    replayed, eager = cost.get("graph_replays_per_batch"), cost.get("graph_eager_per_batch")
    if not isinstance(replayed, (int, float)) or not isinstance(eager, (int, float)):
        return ""
    by = _mapping(cost.get("graph_eager_by_cache"))
    named = ", ".join(f"{k} {v:g}" for k, v in by.items() if isinstance(v, (int, float)) and v)
    return f" · per recorded batch {replayed:g} graph replay(s), {eager:g} eager run(s){f' ({named})' if named else ''}"
