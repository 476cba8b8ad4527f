"""The capture hooks refcheck's SGLang plugin installs in SGLang's processes.

Contract: the plugin's entry point (:func:`refcheck.sglang.plugin.register`) calls :func:`install` once per
process, with what it patched (the model fixes of :func:`refcheck.sglang.capture.versions.patch_models`, the
REFCHECK_DDTREE registration; reported in the status file). Only when ``REFCHECK_CAPTURE_DIR``
(:data:`refcheck.sglang.env.ENV_DIR`) is set does :func:`install` register these AROUND hooks with
SGLang's ``HookRegistry``:

* ``Scheduler.run_batch``: snapshots each request (rid, committed length, root, pool row) before the
  batch runs and, once it has run (SGLang's commit, KV move and mamba-state scatter included),
  records prefill first tokens, target-only decode steps, and the committed KV / conv / recurrent
  state of every verify step recorded during the batch (and whether its forward replayed a CUDA graph);
* ``eagle_utils.eagle_sample`` (tree verify: NGRAM, EAGLE, any plugin algorithm that uses it): the
  tree, every node's log-probs (taken before SGLang adds penalties in place) and the accept outputs;
* ``DFlashWorkerV2.forward_batch_generation`` (DFLASH chain verify): candidates, logits and
  accepted lengths of each decode step, and the drafter's side (its top-k per depth, the context fed to it:
  :mod:`refcheck.sglang.capture.dflash_taps`, which also injects the opt-in ``REFCHECK_DRAFT_FAULT``);
* REFCHECK_DDTREE's worker keeps its drafter's side of each decode step (``last_sides``), attached to the
  step's tree records after the batch;
* ``refcheck.sglang.ddtree.sampling.keyed_sample`` (REFCHECK_DDTREE at temperature > 0, in place of
  ``eagle_sample``): the same tree records plus every node's draw and uniform; the prefill's keyed
  first-token uniforms are read from the worker (``last_first_uniforms``);
* ``sgl_kernel.tree_speculative_sampling_target_only`` (SGLang's tree sampler at temperature > 0,
  NGRAM): its coins, one per node and one per request for the bonus, and its accept thresholds; the
  ``eagle_sample`` record of the same call carries them (``uniforms``, ``residual_uniform``);
* ``ModelRunner.sample``: at temperature > 0 SGLang's sampler overwrites the logits in place with
  ``softmax(logits / T)``; the raw logits are kept from just before it, for the prefill and
  target-only decode records.

**Cost.** The hooks do on the device, in the engine's step and on its stream, only what must be done there:
the verify logits reduced to each node's top-k, argmax and emitted log-prob, the committed state gathered
and sketched (:func:`~refcheck.sglang.capture.state.batch_state`), the drafter's top ranks and context
sketched. Nothing synchronises the device or waits for the disk: each record's tensors are copied to
pinned host memory asynchronously and written by a background thread
(:mod:`refcheck.sglang.capture.shipper`); the per-request, per-node Python runs when refcheck reads the
capture (:mod:`refcheck.sglang.capture.expand`). The step's time comes from two CUDA events around it. With
``REFCHECK_CAPTURE_SAMPLE=N:SEED`` (:mod:`refcheck.sglang.capture.sample_rule`) only one decode batch in N and
one prefill batch in N are recorded, each on its own clock; a batch with no recorded request runs as if no
capture were loaded. With ``REFCHECK_CAPTURE_MAX_BYTES`` (:mod:`refcheck.sglang.capture.byte_budget`) the process
writes at most that many bytes of records: once a record is refused, every later batch the rule takes is counted
(``over_budget``) and runs as if not taken; with ``REFCHECK_CAPTURE_ROLL`` the oldest batch records are deleted to
make room instead, and recording goes on.

Capture never changes what SGLang computes (the exceptions are opt-in, for refcheck's own selftest:
``REFCHECK_SAMPLER_FAULT`` injects a fault into the tree sampler, ``sampler_faults.py``, and
``REFCHECK_DRAFT_FAULT`` one into DFLASH's drafter, ``dflash_taps.py``): hooks read and copy, and every failure inside a hook is
written to the capture directory as an error record instead of being raised into SGLang. The
first ``run_batch`` of each process writes a status file saying which hooks are live (HookRegistry
only logs failures), so the runner can refuse a capture that silently missed a hook.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from refcheck.sglang.capture import byte_budget, dflash_taps, layers, profiling, sampler_faults, snapshot, versions
from refcheck.sglang.capture.batch import Batch, device_index, host_lens, on_device, timed_part
from refcheck.sglang.capture.committed import committed_state
from refcheck.sglang.capture.graphs import GraphCache
from refcheck.sglang.capture.graphs import run as graphs_run
from refcheck.sglang.capture.packing import Plain, prepack
from refcheck.sglang.capture.records import Recorder
from refcheck.sglang.capture.sample_rule import ENV_SAMPLE, CaptureSampleError, SampleRule, parse
from refcheck.sglang.capture.shipper import GRAPH_CACHES
from refcheck.sglang.capture.step_clock import StepClock
from refcheck.sglang.capture.steps import summarise_nodes
from refcheck.sglang.capture.verify_parts import chain_part, tree_inputs, tree_part
from refcheck.sglang.env import ENV_DIR, ENV_GRAPHS, UNTRACED_RID_PREFIX

_patched: list[str] = []
_originals: dict[str, Any] = {}
_recorder: Recorder | None = None
_unrecordable: str | None = None  # why this process's capture directory took no recorder (then none is tried again)
_rule: SampleRule | None = None
_bad_rule: str | None = None  # why REFCHECK_CAPTURE_SAMPLE could not be read (the process then records nothing)
_clock: StepClock | None = None  # which decode steps this process records (made with the process's rule)


_batch: Batch | None = None
_after_recorded = False  # the last traced decode batch was recorded: the next plain one is booked as ``next`` too


def install(patched: list[str]) -> None:
    """Keep what the plugin patched (for the status file) and, when ``REFCHECK_CAPTURE_DIR`` is set, register the
    hooks (their targets: :data:`~refcheck.sglang.capture.versions.HOOK_TARGETS`)."""
    _patched.extend(patched)
    if not os.environ.get(ENV_DIR):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = {"run_batch": _run_batch, "eagle_sample": _eagle_sample, "dflash": _dflash_forward,
             "ddtree_sample": _eagle_sample, "sample": _sample, "verify_coins": _verify_coins}
    for name, target in versions.HOOK_TARGETS.items():
        try:
            _originals[name] = versions.resolve(target)
        except (ImportError, AttributeError) as exc:
            _originals[name] = exc
            continue
        HookRegistry.register(target, hooks[name], HookType.AROUND)


def hook_status() -> dict[str, Any]:
    """Which hooks replaced their targets (and bindings) in this process."""
    live: dict[str, Any] = {}
    for name, target in versions.HOOK_TARGETS.items():
        orig = _originals.get(name)
        if isinstance(orig, Exception) or orig is None:
            live[name] = f"missing: {orig}"
            continue
        ok = versions.resolve(target) is not orig
        for mod in versions.BINDINGS.get(name, ()):
            try:
                ok = ok and getattr(versions.resolve(mod), target.rsplit(".", 1)[1]) is not orig
            except (ImportError, AttributeError):
                pass  # a module this release does not have
        live[name] = ok
    return live


def _rec(scheduler: Any = None) -> Recorder:
    global _recorder
    if _recorder is None:
        max_bytes, roll, bad_budget = _budget_of_env()
        _recorder = Recorder(Path(os.environ[ENV_DIR]), versions.tp_of(scheduler)[0] if scheduler is not None else 0,
                             max_bytes, roll)
        if bad_budget is not None:
            _recorder.error("byte_budget", bad_budget)
        if getattr(getattr(scheduler, "server_args", None), "enable_dp_attention", False):
            _recorder.error("dp_attention", "--enable-dp-attention shards attention by data-parallel groups, which the "
                            "capture's state sketches do not model (its KV shards are read as tensor-parallel ones); "
                            "capture this server without it")
        try:
            _recorder.status({"pid": os.getpid(), "tp_rank": _recorder.tp_rank, "sglang": versions.sglang_version(),
                              "hooks": hook_status(), "patched": _patched,
                              "sample": rule.to_json() if (rule := _sample_rule()) is not None else None,
                              "max_bytes": max_bytes, "roll": roll,
                              "server_topk": versions.server_topk(scheduler) if scheduler is not None else None,
                              "serving": versions.serving_of(scheduler) if scheduler is not None else None,
                              "server": versions.server_of(scheduler) if scheduler is not None else None,
                              "host": profiling.host_speed()})
        except Exception as exc:  # a status we cannot compute must not stop the engine
            _recorder.error("status", f"{type(exc).__name__}: {exc}")
    return _recorder


def _budget_of_env() -> tuple[int | None, bool, str | None]:
    """(the byte budget, whether it rolls, why the environment's budget was not taken or None): a budget the process
    cannot read is said in an error record and the process records without one; a rolling one without a budget rolls
    nothing."""
    roll = byte_budget.rolls(os.environ.get(byte_budget.ENV_ROLL))
    try:
        max_bytes = byte_budget.parse(os.environ.get(byte_budget.ENV_MAX_BYTES))
    except byte_budget.CaptureBudgetError as exc:
        return None, False, f"{byte_budget.ENV_MAX_BYTES}: {exc}; this process records without a byte budget"
    if roll and max_bytes is None:
        return None, False, (f"{byte_budget.ENV_ROLL} rolls records within a byte budget, and "
                             f"{byte_budget.ENV_MAX_BYTES} is not set: this process records without one")
    return max_bytes, roll, None


def _recorder_for(scheduler: Any = None) -> Recorder | None:
    """This process's recorder, or None when its capture directory cannot take one (said once on stderr, the
    engine's log; every batch then runs unrecorded and the runner finds no status file for the process)."""
    global _unrecordable
    if _unrecordable is not None:
        return None
    try:
        return _rec(scheduler)
    except Exception as exc:  # capture must never break the engine
        _unrecordable = f"{type(exc).__name__}: {exc}"
        print(f"refcheck capture: cannot record in {os.environ.get(ENV_DIR)} ({_unrecordable}); this process's "
              "batches run unrecorded", file=sys.stderr, flush=True)
        return None


def _error(where: str, message: str) -> None:
    """An error record (:meth:`Recorder.error`, which never raises), when this process can record."""
    rec = _recorder_for()
    if rec is not None:
        rec.error(where, message)


def drain(timeout_s: float = 60.0) -> bool:
    """Wait until this process's queued records are written (tests, and code that reads in-process)."""
    return _recorder is None or _recorder.shipper.drain(timeout_s)


def _sample_rule() -> SampleRule | None:
    """The process's sampling rule; None when ``REFCHECK_CAPTURE_SAMPLE`` cannot be read (said once in an error
    record: the process then records nothing, rather than every batch of a run meant to be sampled)."""
    global _rule, _bad_rule
    if _rule is None and _bad_rule is None:
        try:
            _rule = parse(os.environ.get(ENV_SAMPLE))
        except CaptureSampleError as exc:
            _bad_rule = f"{ENV_SAMPLE}={os.environ.get(ENV_SAMPLE)!r}: {exc}; this process records nothing"
            _error("sample_rule", _bad_rule)
    return _rule


def _guard(where: str, fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # capture must never break the engine: record and carry on
        _error(where, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        return None


# -- run_batch -----------------------------------------------------------------------------------------
def _step_clock() -> StepClock:
    global _clock
    if _clock is None:
        _clock = StepClock(_sample_rule() or SampleRule(), on_enter=_met)
    return _clock


def _met() -> None:
    """A request the step clock meets for the first time, counted in the process's ledger (``requests``)."""
    if _recorder is not None:
        _recorder.shipper.counts.add(requests=1)


def _snapshot(scheduler: Any, batch: Any) -> Batch | str:
    """The batch before it runs (:func:`refcheck.sglang.capture.snapshot.take`), on this process's clock."""
    return snapshot.take(scheduler, batch, _step_clock(), _recorder, _error)


def _engine_stream(scheduler: Any) -> Any:
    """The stream SGLang's forward runs on: the overlap scheduler's forward stream, else the current one."""
    if torch.cuda.is_available() and getattr(scheduler, "enable_overlap", False):
        return getattr(scheduler, "forward_stream", None)
    return None


@contextmanager
def _on_engine_stream(scheduler: Any) -> Iterator[None]:
    stream = _engine_stream(scheduler)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        yield


def _graph_error(what: str) -> Callable[[Any, Exception], None]:
    def report(key: Any, exc: Exception) -> None:
        _error(f"{what}:graph", f"the {what} of shape {key} runs eagerly: it could not be captured as a CUDA graph "
                                f"({type(exc).__name__}: {exc})")

    return report


#: the hooks' device work replayed as CUDA graphs, one per shape (:mod:`refcheck.sglang.capture.graphs`): the
#: committed-state sketch; the verify step's node reductions (a DFLASH chain's, a target-only step's); the DFLASH
#: drafter's taps (its draft, its context).
#: A cache's graphs share their memory, so each cache replays at most one graph per batch, whose outputs the
#: batch's record copies out before the next batch
_STATE_GRAPHS = GraphCache(_graph_error("state sketch"))
_VERIFY_GRAPHS = GraphCache(_graph_error("verify reduction"))
_TAP_GRAPHS = (GraphCache(_graph_error("drafter's draft")), GraphCache(_graph_error("drafter's context")))


def _graph_calls() -> dict[str, int]:
    """The ledger's counts of the hooks' device computations on the GPU since the last take, over every cache:
    ``graph_replays`` (replayed from a CUDA graph) and ``graph_eager`` (run eagerly: a shape a cache refused, its
    static inputs past the cache's bytes, or one that could not be captured), and the eager runs of each cache
    (``graph_eager_{name}``, :data:`~refcheck.sglang.capture.shipper.GRAPH_CACHES`), which say whose work it was."""
    caches = (_STATE_GRAPHS, _VERIFY_GRAPHS, *_TAP_GRAPHS)  # in GRAPH_CACHES' order
    counts = dict(zip(GRAPH_CACHES, (c.take_counts() for c in caches), strict=True))
    return {"graph_replays": sum(r for r, _ in counts.values()), "graph_eager": sum(e for _, e in counts.values()),
            **{f"graph_eager_{name}": e for name, (_, e) in counts.items()}}


def _graphs(cache: Any) -> Any:
    """``cache``, unless ``REFCHECK_CAPTURE_GRAPHS=off`` asks for eager device work (None)."""
    return None if os.environ.get(ENV_GRAPHS, "").lower() in ("off", "0", "no") else cache


def _layers(scheduler: Any, snap: Batch, nodes: int) -> torch.Tensor | None:
    """The recorded requests' slices of the verify forward's layer sketches (when the layer hooks are on)."""
    if not layers.FORWARDS:
        return None
    n_layers = int(scheduler.tp_worker.model_runner.model_config.num_hidden_layers)
    sk = layers.take(len(snap.rids) * nodes, n_layers)  # [layers, bs*N, r]
    layers.FORWARDS.clear()
    if sk is None:
        return None
    return snap.rows(sk.transpose(0, 1), nodes).transpose(0, 1)  # [layers, b*N, r]


def _fields(scheduler: Any, snap: Batch, part: dict[str, Any], result: Any) -> dict[str, Any]:
    worker = getattr(scheduler, "draft_worker", None)
    meta = {"server_topk": snap.topk, "batch_size": len(snap.rids), **part.get("meta", {}),
            "cuda_graph": bool(getattr(result, "can_run_cuda_graph", False))}  # the verify replayed a CUDA graph
    draft_s = getattr(worker, "last_draft_s", None)  # REFCHECK_DDTREE's drafting
    if isinstance(draft_s, float):
        meta["batch_draft_s"] = draft_s
    sides = getattr(worker, "last_sides", None)  # REFCHECK_DDTREE's drafter side
    meta["capture_host_s"] = snap.host_s + time.perf_counter() - snap.after_t0
    rids = snap.host(snap.rids)
    return {"layout": part["layout"], "rids": rids, "origin": list(snap.take), "steps": list(snap.steps),
            "contexts": Plain(snap.contexts), "params": Plain(snap.params),
            "committed_host": snap.host(snap.committed), "roots_host": snap.host(snap.roots), "meta": meta,
            "sides": {r: sides.get(r) for r in rids} if isinstance(sides, dict) else None,
            "events": snap.events}


def _ship_decode(scheduler: Any, snap: Batch, result: Any) -> None:
    """Record a decode batch's verify calls (or its target-only step) with the committed state."""
    parts = snap.pending
    if not snap.speculative:
        part = _root_part(snap, result)
        if part is None:
            return
        parts = [part]
    elif not parts:
        _error("run_batch", "a speculative decode batch ran but no verify step was captured (is its hook live?)")
        return
    for part in parts:
        width = part.pop("width")
        with timed_part(snap, "state"):
            state = committed_state(scheduler, snap, part["committed"], width, _graphs(_STATE_GRAPHS))
        tensors = {"t": part.pop("t"), **state,
                   "layers": _layers(scheduler, snap, width), "draft": part.pop("draft", None),
                   "context": part.pop("context", None)}
        tensors["t"]["committed"] = part.pop("committed")
        with timed_part(snap, "ship"):
            _rec(scheduler).ship("batch", _fields(scheduler, snap, part, result), tensors)


def _copied(result: Any) -> Any:
    """The event that ends the copy of ``result``'s tokens to the host, when SGLang's overlap scheduler made one (it
    copies them on its copy stream, still in flight when ``run_batch`` returns); None otherwise."""
    ready = getattr(result, "copy_done", None)
    return ready if isinstance(ready, torch.cuda.Event) else None


def _root_part(snap: Batch, result: Any) -> dict[str, Any] | None:
    logits = getattr(getattr(result, "logits_output", None), "next_token_logits", None)
    if snap.raw_logits is not None:  # the sampler overwrote them with probabilities
        logits = snap.raw_logits
    if logits is None:
        _error("run_batch", "target-only decode result has no logits")
        return None
    nxt = snap.rows(on_device(result.next_token_ids, logits.device, _copied(result)).reshape(-1))
    rows = snap.rows(logits)  # [b, V]
    key = ("root", tuple(rows.shape), rows.dtype, tuple(nxt.shape), nxt.dtype)
    nodes = graphs_run(_graphs(_VERIFY_GRAPHS), key, lambda lg, o: prepack(summarise_nodes(lg, o).tensors()), rows, nxt)
    t: dict[str, Any] = {"nodes": nodes, "next_ids": nxt}
    committed = None
    if snap.decode_inputs is not None and len(snap.decode_inputs[0]) == len(snap.rids):
        t["roots"] = snap.rows(snap.decode_inputs[0])
        committed = snap.rows(snap.decode_inputs[1]) - 1  # seq lens count the root
    if committed is None:
        committed = host_lens(snap, logits.device)
    return {"layout": "root", "t": t, "committed": committed, "width": 1,
            "meta": {"server_topk": snap.topk}}


def _ship_prefill(scheduler: Any, snap: Batch, result: Any) -> None:
    logits = getattr(getattr(result, "logits_output", None), "next_token_logits", None)
    if snap.raw_logits is not None:  # the sampler overwrote them with probabilities
        logits = snap.raw_logits
    if logits is None:
        return
    done = snap.done  # taken, at their last prefill chunk, at their first token
    if not done:
        return
    idx = device_index(done, logits.device) if len(done) < len(snap.rids) else None
    nxt = on_device(result.next_token_ids, logits.device, _copied(result)).reshape(-1)
    lg = logits if idx is None else logits[idx]
    nxt = nxt if idx is None else nxt[idx]
    uniforms = getattr(getattr(scheduler, "draft_worker", None), "last_first_uniforms", None)
    rids = [snap.rids[i] for i in done]
    _rec(scheduler).ship("prefill_batch", {"rids": rids, "prompt_lens": [snap.prompt_lens[i] for i in done],
                                           "uniforms": dict(uniforms) if isinstance(uniforms, dict) else None,
                                           "contexts": Plain(snap.contexts), "params": Plain(snap.params)},
                         {"t": {"nodes": summarise_nodes(lg, nxt).tensors(), "next_ids": nxt}})


def _after(scheduler: Any, snap: Batch, result: Any) -> None:
    """Record what the batch produced, on the engine's stream (ordered after its commit, before its next step)."""
    snap.after_t0 = time.perf_counter()
    with _on_engine_stream(scheduler):
        if snap.mode == "extend":
            _ship_prefill(scheduler, snap, result)
        elif snap.mode == "decode" and snap.take:
            _ship_decode(scheduler, snap, result)


def _untraced(batch: Any) -> bool:
    """A batch made only of timing requests (rid prefix UNTRACED_RID_PREFIX) runs as if no capture were loaded."""
    reqs = getattr(batch, "reqs", None) or []
    if not reqs or not str(reqs[0].rid).startswith(UNTRACED_RID_PREFIX):  # a traced batch: one rid read
        return False
    return all(str(r.rid).startswith(UNTRACED_RID_PREFIX) for r in reqs)


def _event(scheduler: Any) -> Any:
    if not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(_engine_stream(scheduler) or torch.cuda.current_stream())
    return ev


def _plain(original, self, batch, t0: float, mode: str | None, *args, **kwargs):
    """A batch that records nothing, run as SGLang has it; once the process has a recorder (a traced batch came
    first: untraced requests alone leave nothing in the capture directory), a decode batch's wall time from ``t0``,
    the hook's entry, goes to the cost ledger's ``plain`` side (and, for the first traced one after a recorded batch,
    to its ``next`` side too), and the hook's own time before the batch ran to its ``passed`` side; a prefill's wall
    time to ``plain_prefill``. ``mode``: the batch's, when the snapshot read it (None: read here)."""
    global _after_recorded
    t1 = time.perf_counter()
    result = original(self, batch, *args, **kwargs)
    if _recorder is not None:
        traced = mode is not None  # a batch the snapshot read (traced, passed over), not one of untraced requests
        if mode is None:
            mode = _guard("run_batch:mode", lambda: "decode" if batch.forward_mode.is_decode()
                          else "extend" if batch.forward_mode.is_extend() else "other")
        wall = int(1e9 * (time.perf_counter() - t0))
        if mode == "decode":
            after = {"next_batches": 1, "next_ns": wall} if traced and _after_recorded else {}  # only fields that change
            _after_recorded = _after_recorded and not traced
            _recorder.shipper.counts.add(plain_batches=1, plain_ns=wall, passed_ns=int(1e9 * (t1 - t0)), **after)
        elif mode == "extend":
            _recorder.shipper.counts.add(plain_prefills=1, plain_prefill_ns=wall)
    return result


def _run_batch(original, self, batch, *args, **kwargs):
    global _batch
    t0 = time.perf_counter()
    if _untraced(batch):
        return _plain(original, self, batch, t0, None, *args, **kwargs)
    rec = _recorder_for(self)
    if rec is None or _sample_rule() is None:  # this process cannot record: SGLang's step as it is
        return _plain(original, self, batch, t0, None, *args, **kwargs)
    _guard("run_batch:profile", profiling.tick, rec.root, rec.tp_rank)
    with profiling.section("snapshot"):
        snap = _guard("run_batch:snapshot", _snapshot, self, batch)
    if not isinstance(snap, Batch):  # nothing recorded at this step (its mode; None: the snapshot failed)
        return _plain(original, self, batch, t0, snap, *args, **kwargs)
    snap.parts["snapshot"] = time.perf_counter() - t0
    _batch = snap
    start = _event(self)
    try:
        with profiling.section("step"):
            result = original(self, batch, *args, **kwargs)
    finally:
        _batch = None
    end = _event(self)
    if start is not None and end is not None:
        snap.events = (start, end)
    later = getattr(result, "delay_sample_func", None)
    if callable(later):  # SGLang samples this batch after run_batch returns: record it then
        result.delay_sample_func = _sampled_later(self, snap, result, later, time.perf_counter() - t0)
        return result
    _record(self, rec, snap, result, time.perf_counter() - t0)
    return result


def _record(scheduler: Any, rec: Recorder, snap: Batch, result: Any, ran_s: float) -> None:
    """Record the batch the scheduler ran (its tokens sampled) and book it in the ledger: ``ran_s``, the hooks' and
    SGLang's time in ``run_batch`` before this."""
    global _after_recorded
    with profiling.section("after"):
        _guard("run_batch:after", _after, scheduler, snap, result)
    after_s = time.perf_counter() - snap.after_t0
    wall, hooks_s = ran_s + after_s, snap.host_s + after_s
    _after_recorded = snap.mode == "decode"
    if snap.mode == "decode":
        rec.shipper.counts.add(recorded_batches=1, recorded_ns=int(1e9 * wall), hooks_ns=int(1e9 * hooks_s),
                               **{f"{k}_ns": int(1e9 * v) for k, v in snap.parts.items()}, **_graph_calls())
    elif snap.mode == "extend":
        rec.shipper.counts.add(prefills=1, prefill_ns=int(1e9 * wall), prefill_hooks_ns=int(1e9 * hooks_s))


def _sampled_later(scheduler: Any, snap: Batch, result: Any, later: Callable[[], Any],
                   ran_s: float) -> Callable[[], Any]:
    """SGLang's delayed sampling of ``result`` (its overlap scheduler without speculation samples a batch holding a
    grammar request after the previous batch's results are processed, through ``result.delay_sample_func``), then the
    batch's record: the sampler's hook sees the batch as in ``run_batch``, and the tokens are read once sampled."""

    def sample() -> Any:
        global _batch
        _batch = snap
        try:
            out = later()
        finally:
            _batch = None
        _record(scheduler, _rec(scheduler), snap, result, ran_s)
        return out

    return sample


def _sample(original, self, logits_output, forward_batch, *args, **kwargs):
    snap = _batch
    if snap is not None:  # the raw logits of a sampling batch; a target-only decode's inputs
        _guard("sample:before", _keep_raw_logits, snap, logits_output, forward_batch)
    return original(self, logits_output, forward_batch, *args, **kwargs)


def _keep_raw_logits(snap: Batch, logits_output: Any, forward_batch: Any) -> None:
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and mode.is_decode() and forward_batch.input_ids is not None:
        snap.decode_inputs = (forward_batch.input_ids.detach().reshape(-1).clone(),
                              forward_batch.seq_lens.detach().reshape(-1).clone())
    info = getattr(forward_batch, "sampling_info", None)
    logits = getattr(logits_output, "next_token_logits", None)
    if info is not None and not info.is_all_greedy and logits is not None:
        snap.raw_logits = logits.detach().clone()


# -- verify hooks ----------------------------------------------------------------------------------------
def _eagle_sample(original, *args, **kwargs):
    snap = _batch
    pre = None
    if snap is not None:
        with timed_part(snap, "verify", "verify.before"):
            pre = _guard("eagle_sample:before", tree_inputs, snap, args, kwargs)
    result = original(*args, **kwargs)
    if snap is not None and pre is not None:
        with timed_part(snap, "verify", "verify.after"):
            part = _guard("eagle_sample:after", tree_part, snap, pre, result)
        if part:
            snap.pending.append(part)
    return result


def _verify_coins(original, *args, **kwargs):
    snap = _batch
    call = {**dict(zip(versions.TREE_SAMPLER_ARGS, args)), **kwargs}  # every argument by name
    if snap is not None:
        _guard("verify_coins:before", _keep_coins, snap, call)
    fault = sampler_faults.active()
    if fault is not None:  # refcheck's selftest: SGLang samples wrongly, the record stays right
        return original(**sampler_faults.apply(fault, call))
    return original(*args, **kwargs)


def _keep_coins(snap: Batch, call: dict[str, Any]) -> None:
    """The coins SGLang's tree sampler is handed (copied before it runs; it does not change them)."""
    snap.coins = (call["uniform_samples"].detach().clone(), call["uniform_samples_for_final_sampling"].detach().clone(),
                  (float(call.get("threshold_single", 1.0)), float(call.get("threshold_acc", 1.0))))


def _dflash_forward(original, self, batch, *args, **kwargs):
    snap = _batch
    fault = dflash_taps.active()  # a drafter fault for refcheck's selftest acts on untraced batches too
    decode = False
    if snap is not None:
        decode = bool(_guard("dflash:before", lambda: not (batch.forward_mode.is_extend() or batch.is_extend_in_batch
                                                           or batch.forward_mode.is_idle())))
    if snap is None and fault is None:
        return original(self, batch, *args, **kwargs)
    with dflash_taps.dflash_taps(self, len(batch.reqs), snap is not None and decode, fault, _graphs(_TAP_GRAPHS)) as taps:
        result = original(self, batch, *args, **kwargs)
    if snap is not None and decode:
        with timed_part(snap, "verify", "dflash.after"):
            part = _guard("dflash:after", chain_part, self, snap, result, taps, _graphs(_VERIFY_GRAPHS))
        if part:
            snap.pending.append(part)
        snap.parts["taps"] = snap.parts.get("taps", 0.0) + taps.host_s
    return result


