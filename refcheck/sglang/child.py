"""The SGLang engine process: ``python -m refcheck.sglang.child JOB.json``.

Contract: runs one ``sglang.Engine`` for a job written by :class:`refcheck.sglang.runner.SGLangRunner`
(engine arguments, token ids, sampling parameters, rids) and reports through ``JOB.result.json``,
rewritten atomically at each stage: ``started`` (engine up, ``start_s``), then ``done`` (output ids per
request, ``generate_s``), or ``failed`` with the stage and a one-line summary of the error. With
``timing_rids`` (k untraced passes: the capture plugin passes their rids through, no synchronisation, no
records) the same requests run again on the warm engine, and ``done`` carries ``repeat_generate_s`` (their wall
times: tokens/s without first-use kernel compilation or capture), ``repeats_match`` (whether every repeat produced
the captured output ids) and ``untraced_diffs`` where an untraced pass left the captured one
(:func:`first_differences`). With ``sampled_rids`` (passes of rids marked for a sampled capture,
:func:`refcheck.sglang.capture.sample_rule.sampled_rid`) and ``full_rids`` (passes of rids marked for full capture)
the passes of the three kinds run interleaved after the captured one: round r runs pass r of each kind in the
order rotated by r (untraced, sampled, full; then sampled, full, untraced; ...), so a drift of the engine's speed
over the rounds (clocks, caches, allocators) reaches every kind alike; ``sampled_generate_s``, ``sampled_match``,
``full_generate_s``, ``full_match`` (each pass against the captured one), and ``round_match`` ({kind: whether each
of its passes gave the tokens of the untraced pass of the same round}: the capture's own effect, where an engine's
state that moves between passes, such as NGRAM's cache, makes a later pass differ from the captured one;
``round_mismatch``: {kind: the rounds where it did not}). With
``timing_budget_s`` no round starts once that many seconds have passed since the first began and
:data:`MIN_TIMED_ROUNDS` have run (short passes then get many rounds, long ones few);
with ``timing_until`` (a wall-clock time, ``time.time()`` seconds) no round starts that would end past it, judged by
the longest round so far, whatever rounds have run (a device call's time limit: the rounds end inside it, however
long the engine took to start).
After the captured pass and after each sampled or full pass the child waits until the scheduler processes have
written every capture record they queued
(:func:`refcheck.sglang.capture.shipper.wait_drained`; ``drain_s``: how long the captured pass's writers still
needed; ``capture_behind`` lists any that did not within a minute), so no pass is timed while an earlier pass's
records are written; ``pass_costs`` holds what the captured pass and each kind of timing pass (summed over its
passes) booked in the capture's cost ledger (per decode batch: ``run_batch``'s wall time and the
hooks' share, by part; per timing pass, ``run_batch_s``: the seconds booked to ``run_batch`` in that pass, and
``client_gc_s``: this process's garbage collections during it). With
``warmup_rids`` one untraced pass runs before the captured one (``warmup_generate_s``, ``warmup_match``), and
with ``capture_warm_rids`` a captured pass whose records nobody reads (the capture's kernels load and its
buffers grow before the timed passes; the child waits for its records to be written);
with ``stagger_s`` > 0 the requests of each pass arrive one every ``stagger_s`` seconds. With ``more`` (the paths
of further parts' job files, each holding another workload's requests, rids, passes and ``result``) the parts run
in turn on the same engine (:func:`run_part`), each writing its own ``result`` (``started`` as it begins, then
``done`` or ``failed``; a start-up failure is the first part's, :mod:`refcheck.sglang.engine_process` reads it for
every part) and printing :data:`PART_MARKER` to the log
as it begins; each part's timing rounds end by an equal share of the time left before its ``timing_until`` as the
part begins (:func:`part_until`). SGLang
answers a dead scheduler by killing its whole process tree (SIGQUIT, then SIGKILL): running it here
keeps refcheck's own process, and the records captured so far, alive; whatever stage the file last
reached tells the runner what happened. The child leads a session of its own (the runner starts it so), and
ends it whole, SGLang's schedulers with it, as soon as the runner is gone, whatever ended the runner
(:func:`refcheck.lifetime.watch_parent`): an engine never holds the GPU for nobody. Exit codes: 0 done, 3 SGLang
missing, 4 start-up failed, 5 generate failed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from refcheck.atomic_file import atomic_write_bytes
from refcheck.lifetime import watch_parent
from refcheck.sglang.capture.gc_clock import CollectionClock


def _write(path: Path, payload: dict) -> None:
    atomic_write_bytes(path, json.dumps(payload).encode(), durable=False)  # the parent polls it: whole or absent


def summarise_error(exc: BaseException, limit: int = 600) -> str:
    """The end of a (possibly multi-process, multi-line) error message, on one line."""
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    text = " | ".join(lines[-4:])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _outputs(results: list[dict]) -> list[list[int]]:
    return [[int(t) for t in r["output_ids"]] for r in results]


def first_differences(captured: list[list[int]], other: list[list[int]]) -> list[list[int]]:
    """Where an untraced pass's outputs leave the captured pass's: [request index, output position,
    captured token (-1: ended), untraced token (-1: ended)] per request that differs."""
    out = []
    for i, (a, b) in enumerate(zip(captured, other)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            out.append([i, k, a[k] if k < len(a) else -1, b[k] if k < len(b) else -1])
    return out


def generate(engine: Any, job: dict, rids: list[str]) -> list[dict]:
    """One pass over the job's requests under ``rids``: all in one ``generate`` call, or, with
    ``stagger_s`` > 0, request i submitted ``i * stagger_s`` seconds after the first (they then meet
    the running batch at every stage: prefill beside decode and verify)."""
    stagger = float(job.get("stagger_s") or 0.0)
    if stagger <= 0:
        return engine.generate(input_ids=job["input_ids"], sampling_params=job["sampling_params"], rid=rids)

    async def one(i: int) -> dict:
        await asyncio.sleep(i * stagger)
        return await engine.async_generate(input_ids=job["input_ids"][i], sampling_params=job["sampling_params"][i],
                                           rid=rids[i])

    async def every() -> list[dict]:
        return list(await asyncio.gather(*(one(i) for i in range(len(rids)))))

    return engine.loop.run_until_complete(every())


def _passes(engine: Any, job: dict, passes: list[list[str]]) -> None:
    """Run each pass (a list of rids) over the job's requests, then wait for the capture's writers: a captured
    warm-up, whose records are not read."""
    for rids in passes:
        generate(engine, job, rids)
    if passes:
        _drained()


#: rounds a timing budget lets run whatever it is (a median of three at least)
MIN_TIMED_ROUNDS = 3

#: the cost ledger's fields that together hold the scheduler's ``run_batch`` wall time, every batch of a pass
STEP_FIELDS = ("plain_ns", "recorded_ns", "plain_prefill_ns", "prefill_ns")
#: kind of timing pass -> (the job's key for its passes' rids, the result's keys for their wall times and for whether
#: they gave the captured outputs)
TIMING_KINDS = {"untraced": ("timing_rids", "repeat_generate_s", "repeats_match"),
                "sampled": ("sampled_rids", "sampled_generate_s", "sampled_match"),
                "full": ("full_rids", "full_generate_s", "full_match")}


class _Collections(CollectionClock):
    """This process's garbage collections while installed (``gc.callbacks``): their total nanoseconds. SGLang's
    tokenizer manager runs in this process, so a collection here delays a pass the engine itself did not slow."""

    def __init__(self) -> None:
        super().__init__()
        self.ns = 0

    def collected(self, ns: int) -> None:
        self.ns += ns

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def interleaved(engine: Any, job: dict, outputs: list[list[int]], diffs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The timing passes of every kind in :data:`TIMING_KINDS` the job holds, round r running pass r of each kind in
    the order rotated by r, within the job's ``timing_budget_s`` and ``timing_until`` (module docstring). Per kind:
    ``times`` (wall seconds per pass), ``match`` (every pass gave ``outputs``), ``books`` (what its passes booked in
    the cost ledger, summed), ``run_batch_s`` (per pass, the seconds the ledger booked to the scheduler's
    ``run_batch``: every decode and prefill batch, hooks included; empty when the engine does not capture) and
    ``client_gc_s`` (per pass, this process's garbage collections, :class:`_Collections`); an untraced pass r's
    first differences from ``outputs`` go to ``diffs`` as ``repeat{r}``."""
    plans = {kind: job.get(key) or [] for kind, (key, _, _) in TIMING_KINDS.items()}
    kinds = [kind for kind, passes in plans.items() if passes]
    got: dict[str, dict[str, Any]] = {kind: {"times": [], "match": True, "books": {}, "run_batch_s": [],
                                             "client_gc_s": []} for kind in kinds}
    budget, until, start = job.get("timing_budget_s"), job.get("timing_until"), time.perf_counter()
    longest = 0.0  # the longest round so far, in seconds
    before = _ledger()  # the ledger as the next pass finds it (each pass's end is the next one's start)
    with _Collections() as client:
        for r in range(max((len(plans[k]) for k in kinds), default=0)):
            if budget is not None and r >= MIN_TIMED_ROUNDS and time.perf_counter() - start > budget:
                break
            if until is not None and time.time() + longest > until:
                break
            began = time.perf_counter()
            ran = [kind for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)] if r < len(plans[kind])]
            for kind in ran:
                before = _timed_pass(engine, job, outputs, diffs, kind, r, plans[kind][r], got[kind], before, client)
            _round_match(got, ran, r)
            longest = max(longest, time.perf_counter() - began)
    return got


def _round_match(got: dict[str, dict[str, Any]], ran: list[str], r: int) -> None:
    """Round ``r``'s traced passes against its untraced pass: each traced kind's ``round_mismatch`` lists the rounds
    where its pass did not give the tokens of its round's untraced pass (none: the capture changed nothing, whatever
    moved between rounds, NGRAM's cache of earlier requests say; one early round apart, as an engine's state settles,
    is not the capture's doing; every round would be), and :func:`_timing_result` reads ``round_match`` from it; a
    round without an untraced pass compares nothing."""
    if "untraced" not in ran:
        return
    base = got["untraced"]["last"]
    for kind in ran:
        if kind != "untraced":
            got[kind].setdefault("round_mismatch", [])
            if got[kind]["last"] != base:
                got[kind]["round_mismatch"].append(r)


def _timed_pass(engine: Any, job: dict, outputs: list[list[int]], diffs: dict[str, Any], kind: str, r: int,
                rids: list[str], got: dict[str, Any], before: dict[str, int], client: _Collections) -> dict[str, int]:
    """Pass ``r`` of ``kind`` (:func:`interleaved`), its results added to ``got``; returns the ledger after it."""
    gc0, t0 = client.ns, time.perf_counter()
    again = _outputs(generate(engine, job, rids))
    got["times"].append(time.perf_counter() - t0)
    got["client_gc_s"].append((client.ns - gc0) / 1e9)
    if kind != "untraced":
        _drained()  # its records written before the next pass is timed
    after, books = _ledger(), got["books"]
    for field, value in after.items():
        books[field] = books.get(field, 0) + value - before.get(field, 0)
    if after:
        got["run_batch_s"].append(sum(after[f] - before.get(f, 0) for f in STEP_FIELDS) / 1e9)
    got["match"] = got["match"] and again == outputs
    got["last"] = again  # the round's tokens of this kind (_round_match)
    if kind == "untraced":
        diffs[f"repeat{r}"] = first_differences(outputs, again)
    return after


def _timing_result(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """:func:`interleaved`'s times and matches under the result's keys: a kind without passes has no times, and no
    match (an untraced one: nothing differed)."""
    out: dict[str, Any] = {}
    for kind, (_, times, match) in TIMING_KINDS.items():
        got = kinds.get(kind)
        out[times] = got["times"] if got else []
        out[match] = got["match"] if got else (True if kind == "untraced" else None)
    out["round_mismatch"] = {kind: got["round_mismatch"] for kind, got in kinds.items() if "round_mismatch" in got}
    out["round_match"] = {kind: not rounds for kind, rounds in out["round_mismatch"].items()}
    return out


def _drained() -> dict[str, int]:
    """Wait for the capture's writer threads (when this engine captures): {queue file: records not written}."""
    from refcheck.sglang.capture.shipper import wait_drained
    from refcheck.sglang.env import ENV_DIR

    root = os.environ.get(ENV_DIR)
    return wait_drained(Path(root)) if root else {}


def _ledger() -> dict[str, int]:
    """The capture's cost ledger so far, summed over the scheduler processes (empty when this engine does not
    capture)."""
    from refcheck.sglang.capture.shipper import read_ledgers
    from refcheck.sglang.env import ENV_DIR

    root = os.environ.get(ENV_DIR)
    return read_ledgers(Path(root)) if root else {}


def _pass_costs(start: dict[str, int], captured: dict[str, int], kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What each pass booked in the cost ledger (:func:`~refcheck.sglang.capture.shipper.ledger_summary`): the
    captured pass's, between the ledger read before it and the one read once its records were written, and each
    timing kind's books (:func:`interleaved`); empty when this engine does not capture."""
    from refcheck.sglang.capture.shipper import ledger_between, ledger_summary

    if not start:
        return {}
    return {"captured": ledger_between(start, captured),
            **{kind: {**ledger_summary(got["books"], got["books"].get("written", 0)),
                      "run_batch_s": [round(t, 6) for t in got["run_batch_s"]],
                      "client_gc_s": [round(t, 6) for t in got["client_gc_s"]]} for kind, got in kinds.items()}}


def _end_with_the_runner() -> None:
    """Leading a group of its own (the runner's ``start_new_session``): SIGKILL to the whole group, this process and
    every scheduler SGLang started in it, as soon as the runner is gone."""
    if os.getpgrp() == os.getpid():
        watch_parent(lambda: os.killpg(os.getpgrp(), signal.SIGKILL))


def parts_of(job: dict) -> list[dict]:
    """The job's parts in order: the job itself, then each job file its ``more`` names (another workload, run on the
    same engine once the one before it is done; each part writes its own ``result``)."""
    return [job, *(json.loads(Path(p).read_text()) for p in job.get("more") or [])]


def part_until(until: float | None, now: float, parts_left: int) -> float | None:
    """A part's ``timing_until`` as it begins, where the engine still has ``parts_left`` parts to run (this one
    included): an equal share of the time left before the job's ``until`` (None: no end); the part's warm-ups and
    captured pass come out of its own share."""
    if until is None or parts_left <= 1:
        return until
    return now + max(until - now, 0.0) / parts_left


#: the line the child prints to its log (the engine's, shared by every part) as part K begins: a part's errors are
#: the log's lines from its own marker to the next (:func:`refcheck.sglang.engine_process.log_error`)
PART_MARKER = "refcheck-child: part {} begins"


def run_part(engine: Any, part: dict, start_s: float, version: str) -> int:
    """One part on the started engine: the warm-ups, the captured pass, the timing rounds; its ``done`` (or
    ``failed``) written to the part's ``result``. Returns 0, or 5 when its generate failed."""
    result = Path(part["result"])
    try:
        warm: dict[str, Any] = {}
        if part.get("warmup_rids"):  # untraced: compiles kernels (and, with the radix cache, fills it) first
            t0 = time.perf_counter()
            warm_out = _outputs(generate(engine, part, part["warmup_rids"]))
            warm = {"warmup_generate_s": time.perf_counter() - t0}
        _passes(engine, part, [part["capture_warm_rids"]] if part.get("capture_warm_rids") else [])
        start = _ledger()
        t1 = time.perf_counter()
        out = generate(engine, part, part["rids"])
        generate_s = time.perf_counter() - t1
        outputs = _outputs(out)
        diffs: dict[str, list[list[int]]] = {}
        if warm:
            warm["warmup_match"] = warm_out == outputs
            diffs["warmup"] = first_differences(outputs, warm_out)
        t2 = time.perf_counter()
        behind = _drained()  # the captured pass's records written before the next pass is timed
        drain_s = time.perf_counter() - t2
        captured = _ledger()
        kinds = interleaved(engine, part, outputs, diffs)
        timing = _timing_result(kinds)
        _write(result, {"stage": "done", "start_s": start_s, "generate_s": generate_s, "drain_s": drain_s,
                        "sglang": version, "outputs": outputs, **timing, **warm,
                        "capture_behind": behind, "pass_costs": _pass_costs(start, captured, kinds),
                        "untraced_diffs": {name: d for name, d in diffs.items() if d},
                        "meta": [{k: v for k, v in r.get("meta_info", {}).items() if isinstance(v, (int, float, str))}
                                 for r in out]})
    except Exception as exc:  # noqa: BLE001
        _write(result, {"stage": "failed", "failed_at": "generate", "error": summarise_error(exc), "start_s": start_s,
                        "sglang": version})
        return 5
    return 0


def main(job_path: str) -> int:
    _end_with_the_runner()
    job = json.loads(Path(job_path).read_text())
    result = Path(job["result"])
    try:
        import sglang
    except ImportError as exc:
        _write(result, {"stage": "failed", "failed_at": "import", "error": summarise_error(exc)})
        return 3
    version = str(getattr(sglang, "__version__", "unknown"))
    t0 = time.perf_counter()
    try:
        engine = sglang.Engine(**job["engine_kwargs"])
    except Exception as exc:  # noqa: BLE001 - reported to the runner, which raises a typed error
        _write(result, {"stage": "failed", "failed_at": "start", "error": summarise_error(exc), "sglang": version})
        return 4
    start_s = time.perf_counter() - t0
    parts = parts_of(job)
    code = 0
    try:
        for k, part in enumerate(parts):
            print(f"\n{PART_MARKER.format(k)}", flush=True)  # on a line of its own, whatever was printed before it
            _write(Path(part["result"]), {"stage": "started", "start_s": start_s, "sglang": version})
            until = part_until(part.get("timing_until"), time.time(), len(parts) - k)
            code = max(code, run_part(engine, {**part, "timing_until": until}, start_s, version))
    finally:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - the outputs are written already
            pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
