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
``REFCHECK_CAPTURE_SAMPLE=N:SEED`` (:mod:`refcheck.sglang.capture.sample_rule`) only one decode batch in N is
recorded, all its requests (the prefill's first token always); a batch with no recorded request runs as if
no capture were loaded.

Capture never changes what SGLang computes (the exceptions are opt-in, for refcheck's own selftest:
``REFCHECK_SAMPLER_FAULT`` injects a fault into the tree sampler, ``sampler_faults.py``, and
``REFCHECK_DRAFT_FAULT`` one into DFLASH's drafter, ``dflash_taps.py``): hooks read and copy, and every failure inside a hook is
written to the capture directory as an error record instead of being raised into SGLang. The
first ``run_batch`` of each process writes a status file saying which hooks are live (HookRegistry
only logs failures), so the runner can refuse a capture that silently missed a hook.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refcheck.sglang.capture import dflash_taps, layers, profiling, sampler_faults, versions
from refcheck.sglang.capture.graphs import GraphCache
from refcheck.sglang.capture.records import Recorder
from refcheck.sglang.capture.sample_rule import ENV_SAMPLE, SampleRule, parse, rule_for
from refcheck.sglang.capture.state import MambaPools, batch_state
from refcheck.sglang.capture.steps import node_logprobs, pick, summarise_nodes
from refcheck.sglang.env import ENV_DIR, ENV_FULL, ENV_GRAPHS, UNTRACED_RID_PREFIX

_patched: list[str] = []
_originals: dict[str, Any] = {}
_recorder: Recorder | None = None
_rule: SampleRule | None = None
_steps_seen: dict[str, int] = {}  # rid -> decode / verify steps this process has run for it
_batches_seen = 0  # decode batches holding a traced request this process has run (the sampling rule's clock)


@dataclass
class _Batch:
    """What the scheduler's batch looked like before it ran, and which of its requests this step records."""

    mode: str  # "extend", "decode" or "other"
    speculative: bool
    rids: list[str]
    # the rest is read only for a batch that records (:func:`_snapshot`)
    committed: list[int] = field(default_factory=list)  # decode: tokens with KV before the step (the root's position)
    roots: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    fill_lens: list[int] = field(default_factory=list)
    pool_rows: torch.Tensor | None = None  # [bs] the requests' rows of req_to_token, on the device
    topk: int | None = None
    take: list[int] = field(default_factory=list)  # batch rows recorded at this step
    steps: list[int] = field(default_factory=list)  # their step numbers
    index: torch.Tensor | None = None  # ``take`` on the device (None: every row)
    pending: list[dict[str, Any]] = field(default_factory=list)  # the verify calls' records, tensors on the device
    events: tuple[Any, Any] | None = None  # CUDA events around the scheduler's step
    host_s: float = 0.0  # the hooks' own time on the scheduler's thread at this step (what capture costs it)
    parts: dict[str, float] = field(default_factory=dict)  # ... by part (the ledger's PARTS), in seconds
    after_t0: float = 0.0  # when recording the finished batch began
    raw_logits: torch.Tensor | None = None  # [bs, V] before a sampling batch's sampler overwrote them
    #: the tree sampler's coins [bs, N], bonus coins [bs] and (threshold_single, threshold_acc) of this batch's verify
    coins: tuple[torch.Tensor, torch.Tensor, tuple[float, float]] | None = None
    # target-only decode, from the forward batch on the device: [bs] input ids (the roots) and seq lens (with the
    # root): right even under the overlap scheduler, whose per-request lists lag one step behind
    decode_inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, t: torch.Tensor, per: int = 1) -> torch.Tensor:
        """The recorded requests' rows of a batch tensor [bs*per, ...] (or [bs, ...] with per=1)."""
        if self.index is None:
            return t
        bs = len(self.rids)
        shaped = t.reshape(bs, per, *t.shape[1:]) if per > 1 else t  # [bs*per, ...] -> [bs, per, ...]
        sel = shaped[self.index.to(t.device)]
        return sel.reshape(-1, *t.shape[1:]) if per > 1 else sel

    def host(self, values: list[Any]) -> list[Any]:
        return [values[i] for i in self.take]


_batch: _Batch | None = None


@contextmanager
def _part(snap: _Batch, name: str, label: str | None = None) -> Iterator[None]:
    """One part of the hooks' work at this step: its wall time into ``snap.parts[name]`` (the cost ledger's
    ``{name}_ns``), and labelled ``refcheck.{label or name}`` in an open profiler window."""
    t0 = time.perf_counter()
    try:
        with profiling.section(label or name):
            yield
    finally:
        snap.parts[name] = snap.parts.get(name, 0.0) + time.perf_counter() - t0


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
        _recorder = Recorder(Path(os.environ[ENV_DIR]), versions.tp_of(scheduler)[0] if scheduler is not None else 0)
        try:
            _recorder.status({"pid": os.getpid(), "tp_rank": _recorder.tp_rank, "sglang": versions.sglang_version(),
                              "hooks": hook_status(), "patched": _patched, "sample": _sample_rule().to_json(),
                              "server_topk": versions.server_topk(scheduler) if scheduler is not None else None,
                              "serving": versions.serving_of(scheduler) if scheduler is not None else None})
        except Exception as exc:  # a status we cannot compute must not stop the engine
            _recorder.error("status", f"{type(exc).__name__}: {exc}")
    return _recorder


def drain(timeout_s: float = 60.0) -> bool:
    """Wait until this process's queued records are written (tests, and code that reads in-process)."""
    return _recorder is None or _recorder.shipper.drain(timeout_s)


def _sample_rule() -> SampleRule:
    global _rule
    if _rule is None:
        _rule = parse(os.environ.get(ENV_SAMPLE))
    return _rule


def _guard(where: str, fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # capture must never break the engine: record and carry on
        _rec().error(where, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        return None


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs[name]


# -- run_batch -----------------------------------------------------------------------------------------
def _device_index(rows: list[int], device: Any) -> torch.Tensor:
    """A host index list on ``device`` without a stream synchronisation (pinned source, asynchronous copy)."""
    t = torch.tensor(rows, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _on(t: Any, device: Any) -> torch.Tensor:
    """A batch output (a tensor on either side, or a list) on ``device``, without a stream synchronisation."""
    t = torch.as_tensor(t)
    if t.device == torch.device(device) or torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # a host tensor: pinned first, so the copy is asynchronous


def _choose(snap: _Batch, device: Any) -> None:
    """Which requests this step records: every one at a prefill; at a decode step, those the rule takes."""
    if snap.mode == "extend":
        snap.take = list(range(len(snap.rids)))
        return
    if snap.mode != "decode":
        return
    global _batches_seen
    rule, g = _sample_rule(), _batches_seen
    _batches_seen += 1
    for b, rid in enumerate(snap.rids):
        k = _steps_seen.get(rid, 0)
        _steps_seen[rid] = k + 1
        if rule_for(rid, rule).takes(g):
            snap.take.append(b)
            snap.steps.append(k)
    if snap.take and len(snap.take) < len(snap.rids):
        snap.index = _device_index(snap.take, device)


def _snapshot(scheduler: Any, batch: Any) -> _Batch:
    """The batch before it runs: which requests it records (:func:`_choose`) and, only when it records any,
    what the records need of it (a decode batch the sampling rule passes over costs its rids and step counts)."""
    fm = batch.forward_mode
    mode = "extend" if fm.is_extend() else "decode" if fm.is_decode() else "other"
    reqs = list(batch.reqs)
    rows = batch.req_pool_indices
    snap = _Batch(mode=mode, speculative=not batch.spec_algorithm.is_none(), rids=[r.rid for r in reqs])
    _choose(snap, rows.device if isinstance(rows, torch.Tensor) else "cpu")
    if mode != "extend" and not snap.take:
        return snap
    snap.committed = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in reqs]
    snap.roots = [int(r.output_ids[-1]) if r.output_ids else -1 for r in reqs]
    snap.prompt_lens = [len(r.origin_input_ids) for r in reqs]
    snap.fill_lens = [len(getattr(r, "fill_ids", None) or r.origin_input_ids) for r in reqs]
    snap.pool_rows = rows.detach().clone() if isinstance(rows, torch.Tensor) else None
    snap.topk = versions.server_topk(scheduler)
    return snap


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


def _pools(scheduler: Any) -> tuple[Any, Any]:
    runner = scheduler.tp_worker.model_runner
    return runner.token_to_kv_pool, runner.req_to_token_pool


def _pool_views(scheduler: Any) -> tuple[dict, MambaPools | None, Any]:
    """(kv buffers by layer, the stacked mamba pools or None, req_to_token pool)."""
    kv_pool, rtp = _pools(scheduler)
    if hasattr(kv_pool, "full_attention_layer_id_mapping"):
        kv_layers = sorted(kv_pool.full_attention_layer_id_mapping)
    else:
        start = int(getattr(kv_pool, "start_layer", 0) or 0)
        kv_layers = list(range(start, start + int(kv_pool.layer_num)))
    kv = {layer: (kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer)) for layer in kv_layers}
    mamba = None
    if hasattr(rtp, "mamba_map"):
        pool = rtp.mamba_pool
        order = sorted(rtp.mamba_map.items(), key=lambda item: item[1])  # (global layer id, row in the stack)
        mamba = MambaPools([layer for layer, _ in order], [int(i) for _, i in order], pool.mamba_cache.conv[0],
                           pool.mamba_cache.temporal, int(getattr(pool, "conv_window_axis", -1)))
    return kv, mamba, rtp


def _graph_error(what: str) -> Callable[[Any, Exception], None]:
    def report(key: Any, exc: Exception) -> None:
        _rec().error(f"{what}:graph", f"the {what} of shape {key} runs eagerly: it could not be captured as a CUDA "
                                      f"graph ({type(exc).__name__}: {exc})")

    return report


#: the hooks' device work replayed as CUDA graphs, one per shape (:mod:`refcheck.sglang.capture.graphs`): the
#: committed-state sketch; the verify step's node reductions; the DFLASH drafter's taps (its draft, its context).
#: A cache's graphs share their memory, so each cache replays at most one graph per batch, whose outputs the
#: batch's record copies out before the next batch
_STATE_GRAPHS = GraphCache(_graph_error("state sketch"))
_VERIFY_GRAPHS = GraphCache(_graph_error("verify reduction"))
_TAP_GRAPHS = (GraphCache(_graph_error("drafter's draft")), GraphCache(_graph_error("drafter's context")))


def _graphs(cache: Any) -> Any:
    """``cache``, unless ``REFCHECK_CAPTURE_GRAPHS=off`` asks for eager device work (None)."""
    return None if os.environ.get(ENV_GRAPHS, "").lower() in ("off", "0", "no") else cache


def bucket(b: int) -> int:
    """The batch size a state graph is captured for: the next power of two (a serving engine's batch size changes
    from step to step; one graph per size would be captured at every new one)."""
    return 1 << max(b - 1, 0).bit_length()


def _bucketed(graphs: GraphCache, key: tuple, sketch: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]],
              rows: torch.Tensor, lens: torch.Tensor) -> dict[str, Any]:
    """:func:`~refcheck.sglang.capture.state.batch_state` of ``b`` requests from the graph of :func:`bucket` (b)
    rows: the first request's row repeated to fill it, its sketches dropped from the result (each request's
    sketch reads only its own slots)."""
    b = int(rows.shape[0])
    pad = bucket(b) - b
    if pad:
        rows = torch.cat([rows, rows[:1].expand(pad)])  # [b] -> [B]
        lens = torch.cat([lens, lens[:1].expand(pad)])
    state = graphs.run((bucket(b), *key), sketch, rows, lens)
    if not pad:
        return state
    kv = {name: (layer, kind, sk[:b], None if full is None else full[:b]) for name, (layer, kind, sk, full) in
          state["kv"].items()}  # [B, W, ...] -> [b, W, ...]
    mamba = state["mamba"]
    if mamba is not None:  # [L, B, ...] -> [L, b, ...]
        mamba = {k: (v[:, :b] if isinstance(v, torch.Tensor) else v) for k, v in mamba.items()}
    return {"kv": kv, "mamba": mamba}


def _state(scheduler: Any, snap: _Batch, committed: torch.Tensor, width: int) -> dict[str, Any]:
    """The recorded requests' committed state after the step, sketched on the device (``state``, ``tp``): one
    graph replay per batch on CUDA, from the graph of the batch's :func:`bucket` (eagerly for the full rows of
    ``REFCHECK_CAPTURE_FULL``, or with ``REFCHECK_CAPTURE_GRAPHS=off``)."""
    kv, mamba, rtp = _pool_views(scheduler)
    table = rtp.req_to_token
    tp_rank, tp_size = versions.tp_of(scheduler)
    groups = getattr(getattr(rtp, "mamba_pool", None), "conv_shard_groups", None)
    groups = tuple(groups) if groups else None
    shard = (tp_rank, tp_size, groups) if tp_size > 1 else None
    full = bool(os.environ.get(ENV_FULL))

    def sketch(rows: torch.Tensor, lens: torch.Tensor) -> dict[str, Any]:
        cols = lens[:, None] + torch.arange(width, device=table.device)  # [b, W]
        slots = table[rows[:, None], cols.clamp(max=table.shape[1] - 1)]  # [b, W]: rows past the commit dropped later
        mslots = rtp.req_index_to_mamba_index_mapping[rows] if mamba else None
        return batch_state(kv, slots, mamba, mslots, full, shard)

    rows = snap.rows(snap.pool_rows).to(table.device).long()  # type: ignore[arg-type]
    lens = committed.to(table.device).long()
    # the graph reads the pools at the addresses it was captured with: they are part of its key
    pools = (table.data_ptr(), *(k.data_ptr() for k, _ in kv.values()), mamba.ssm.data_ptr() if mamba else 0)
    graphs = None if full else _graphs(_STATE_GRAPHS)
    state = sketch(rows, lens) if graphs is None else _bucketed(graphs, (width, shard, pools), sketch, rows, lens)
    out: dict[str, Any] = {"state": state}
    if shard is not None:
        out["tp"] = {"tp_rank": tp_rank, "tp_size": tp_size, "conv_groups": list(groups) if groups else None}
    return out


def _layers(scheduler: Any, snap: _Batch, nodes: int) -> torch.Tensor | None:
    """The recorded requests' slices of the verify forward's layer sketches (when the layer hooks are on)."""
    if not layers.FORWARDS:
        return None
    n_layers = int(scheduler.tp_worker.model_runner.model_config.num_hidden_layers)
    sk = layers.take(len(snap.rids) * nodes, n_layers)  # [layers, bs*N, r]
    layers.FORWARDS.clear()
    if sk is None:
        return None
    return snap.rows(sk.transpose(0, 1), nodes).transpose(0, 1)  # [layers, b*N, r]


def _fields(scheduler: Any, snap: _Batch, part: dict[str, Any], result: Any) -> dict[str, Any]:
    worker = getattr(scheduler, "draft_worker", None)
    meta = {"server_topk": snap.topk, "batch_size": len(snap.rids), **part.get("meta", {}),
            "cuda_graph": bool(getattr(result, "can_run_cuda_graph", False))}  # the verify replayed a CUDA graph
    draft_s = getattr(worker, "last_draft_s", None)  # REFCHECK_DDTREE's drafting
    if isinstance(draft_s, float):
        meta["batch_draft_s"] = draft_s
    sides = getattr(worker, "last_sides", None)  # REFCHECK_DDTREE's drafter side
    meta["capture_host_s"] = snap.host_s + time.perf_counter() - snap.after_t0
    return {"layout": part["layout"], "rids": snap.host(snap.rids), "origin": list(snap.take), "steps": list(snap.steps),
            "committed_host": snap.host(snap.committed), "roots_host": snap.host(snap.roots), "meta": meta,
            "sides": {r: sides.get(r) for r in snap.host(snap.rids)} if isinstance(sides, dict) else None,
            "events": snap.events}


def _ship_decode(scheduler: Any, snap: _Batch, result: Any) -> None:
    """Record a decode batch's verify calls (or its target-only step) with the committed state."""
    parts = snap.pending
    if not snap.speculative:
        part = _root_part(snap, result)
        if part is None:
            return
        parts = [part]
    elif not parts:
        _rec(scheduler).error("run_batch", "a speculative decode batch ran but no verify step was captured "
                                           "(is its hook live?)")
        return
    for part in parts:
        width = part.pop("width")
        with _part(snap, "state"):
            state = _state(scheduler, snap, part["committed"], width)
        tensors = {"t": part.pop("t"), **state,
                   "layers": _layers(scheduler, snap, width), "draft": part.pop("draft", None),
                   "context": part.pop("context", None)}
        tensors["t"]["committed"] = part.pop("committed")
        with _part(snap, "ship"):
            _rec(scheduler).ship("batch", _fields(scheduler, snap, part, result), tensors)


def _root_part(snap: _Batch, result: Any) -> dict[str, Any] | None:
    logits = getattr(getattr(result, "logits_output", None), "next_token_logits", None)
    if snap.raw_logits is not None:  # the sampler overwrote them with probabilities
        logits = snap.raw_logits
    if logits is None:
        _rec().error("run_batch", "target-only decode result has no logits")
        return None
    nxt = snap.rows(_on(result.next_token_ids, logits.device).reshape(-1))
    t: dict[str, Any] = {"nodes": summarise_nodes(snap.rows(logits), nxt).tensors(), "next_ids": nxt}
    committed = None
    if snap.decode_inputs is not None and len(snap.decode_inputs[0]) == len(snap.rids):
        t["roots"] = snap.rows(snap.decode_inputs[0])
        committed = snap.rows(snap.decode_inputs[1]) - 1  # seq lens count the root
    if committed is None:
        committed = _host_lens(snap, logits.device)
    return {"layout": "root", "t": t, "committed": committed, "width": 1,
            "meta": {"server_topk": snap.topk}}


def _ship_prefill(scheduler: Any, snap: _Batch, result: Any) -> None:
    logits = getattr(getattr(result, "logits_output", None), "next_token_logits", None)
    if snap.raw_logits is not None:  # the sampler overwrote them with probabilities
        logits = snap.raw_logits
    if logits is None:
        return
    done = [i for i, (p, f) in enumerate(zip(snap.prompt_lens, snap.fill_lens)) if f >= p]  # last prefill chunk
    if not done:
        return
    idx = _device_index(done, logits.device) if len(done) < len(snap.rids) else None
    nxt = _on(result.next_token_ids, logits.device).reshape(-1)
    lg = logits if idx is None else logits[idx]
    nxt = nxt if idx is None else nxt[idx]
    uniforms = getattr(getattr(scheduler, "draft_worker", None), "last_first_uniforms", None)
    rids = [snap.rids[i] for i in done]
    _rec(scheduler).ship("prefill_batch", {"rids": rids, "prompt_lens": [snap.prompt_lens[i] for i in done],
                                           "uniforms": dict(uniforms) if isinstance(uniforms, dict) else None},
                         {"t": {"nodes": summarise_nodes(lg, nxt).tensors(), "next_ids": nxt}})


def _after(scheduler: Any, snap: _Batch, result: Any) -> None:
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
    return bool(reqs) and all(str(r.rid).startswith(UNTRACED_RID_PREFIX) for r in reqs)


def _event(scheduler: Any) -> Any:
    if not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(_engine_stream(scheduler) or torch.cuda.current_stream())
    return ev


def _plain(original, self, batch, t0: float, *args, **kwargs):
    """A batch that records nothing, run as SGLang has it; once the process has a recorder (a traced batch came
    first: untraced requests alone leave nothing in the capture directory), a decode batch's wall time from
    ``t0``, the hook's entry, goes to the cost ledger's ``plain`` side."""
    result = original(self, batch, *args, **kwargs)
    if _recorder is not None and _guard("run_batch:mode", lambda: bool(batch.forward_mode.is_decode())):
        _recorder.shipper.counts.add(plain_batches=1, plain_ns=int(1e9 * (time.perf_counter() - t0)))
    return result


def _run_batch(original, self, batch, *args, **kwargs):
    global _batch
    t0 = time.perf_counter()
    if _untraced(batch):
        return _plain(original, self, batch, t0, *args, **kwargs)
    rec = _rec(self)
    _guard("run_batch:profile", profiling.tick, rec.dir.parent, rec.tp_rank)
    with profiling.section("snapshot"):
        snap = _guard("run_batch:snapshot", _snapshot, self, batch)
    if snap is None or (snap.mode != "extend" and not snap.take):  # nothing recorded at this step
        return _plain(original, self, batch, t0, *args, **kwargs)
    snap.host_s += time.perf_counter() - t0
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
    with profiling.section("after"):
        _guard("run_batch:after", _after, self, snap, result)
    if snap.mode == "decode":
        t1 = time.perf_counter()
        rec.shipper.counts.add(recorded_batches=1, recorded_ns=int(1e9 * (t1 - t0)),
                               hooks_ns=int(1e9 * (snap.host_s + t1 - snap.after_t0)),
                               **{f"{k}_ns": int(1e9 * v) for k, v in snap.parts.items()})
    return result


def _sample(original, self, logits_output, forward_batch, *args, **kwargs):
    snap = _batch
    if snap is not None:  # the raw logits of a sampling batch; a target-only decode's inputs
        _guard("sample:before", _keep_raw_logits, snap, logits_output, forward_batch)
    return original(self, logits_output, forward_batch, *args, **kwargs)


def _keep_raw_logits(snap: _Batch, logits_output: Any, forward_batch: Any) -> None:
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
        t0 = time.perf_counter()
        with _part(snap, "verify", "verify.before"):
            pre = _guard("eagle_sample:before", _tree_inputs, snap, args, kwargs)
        snap.host_s += time.perf_counter() - t0
    result = original(*args, **kwargs)
    if snap is not None and pre is not None:
        t0 = time.perf_counter()
        with _part(snap, "verify", "verify.after"):
            part = _guard("eagle_sample:after", _tree_part, snap, pre, result)
        if part:
            snap.pending.append(part)
        snap.host_s += time.perf_counter() - t0
    return result


def _opt(snap: _Batch, t: torch.Tensor | None, per: int = 1) -> torch.Tensor | None:
    return None if t is None else snap.rows(t.detach(), per).clone()


def _tree_inputs(snap: _Batch, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    verify_input, batch, logits_output = (_arg(args, kwargs, 0, "verify_input"), _arg(args, kwargs, 1, "batch"),
                                          _arg(args, kwargs, 2, "logits_output"))
    if batch.forward_mode.is_idle():
        return None
    tokens = verify_input.draft_token
    n = int(tokens.shape[0]) // len(snap.rids)
    # before the original runs: eagle_sample adds penalties and logit bias to the logits in place
    logits = snap.rows(logits_output.next_token_logits.detach(), n)  # [b*N, V]
    logp = node_logprobs(logits)
    lens = getattr(batch, "seq_lens", None)  # tokens with KV before the step (the roots' positions), on the device
    return {"n": n, "logp": logp, "nodes": summarise_nodes(logits, None, logp=logp),
            "tokens": _opt(snap, tokens, n), "nt": _opt(snap, getattr(verify_input, "retrieve_next_token", None)),
            "ns": _opt(snap, getattr(verify_input, "retrieve_next_sibling", None)),
            "pos": _opt(snap, getattr(verify_input, "positions", None), n),
            "seq_lens": _opt(snap, lens) if isinstance(lens, torch.Tensor) and len(lens) == len(snap.rids) else None}


def _tree_part(snap: _Batch, pre: dict[str, Any], result: tuple) -> dict[str, Any]:
    predict, accept_lens, accept_index = result[:3]
    draws, uniforms = result[3:5] if len(result) >= 5 else (None, None)  # the keyed sampler's
    n, residuals = pre["n"], None
    coins, snap.coins = snap.coins, None
    if coins is not None and uniforms is None:  # SGLang's tree sampler ran inside this eagle_sample
        uniforms, residuals = coins[0].reshape(-1), coins[1]  # [bs, N] -> [bs*N]
    pred = snap.rows(predict.detach(), n)
    nodes = pre["nodes"]
    nodes.picked = pick(pre["logp"], pred)
    t = {"tokens": pre["tokens"], "nt": pre["nt"], "ns": pre["ns"], "pos": pre["pos"], "nodes": nodes.tensors(),
         "accept_index": _opt(snap, accept_index), "accept_lens": _opt(snap, accept_lens), "predict": pred,
         "draws": _opt(snap, draws, n), "uniforms": _opt(snap, uniforms, n), "residuals": _opt(snap, residuals)}
    committed = pre["seq_lens"]
    if committed is None:
        committed = _host_lens(snap, pred.device)
    meta: dict[str, Any] = {"layout_in_engine": "tree" if (snap.topk or 0) > 1 else "chain"}
    if coins is not None:
        meta["accept_thresholds"] = list(coins[2])
    return {"layout": "tree", "t": t, "committed": committed, "width": n, "meta": meta}


def _host_lens(snap: _Batch, device: Any) -> torch.Tensor:
    """The scheduler's committed lengths of the recorded requests, on ``device`` (no device lengths to use)."""
    return _device_index(snap.host(snap.committed), device)


def _verify_coins(original, *args, **kwargs):
    snap = _batch
    call = {**dict(zip(versions.TREE_SAMPLER_ARGS, args)), **kwargs}  # every argument by name
    if snap is not None:
        _guard("verify_coins:before", _keep_coins, snap, call)
    fault = sampler_faults.active()
    if fault is not None:  # refcheck's selftest: SGLang samples wrongly, the record stays right
        return original(**sampler_faults.apply(fault, call))
    return original(*args, **kwargs)


def _keep_coins(snap: _Batch, call: dict[str, Any]) -> None:
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
        t0 = time.perf_counter()
        with _part(snap, "verify", "dflash.after"):
            part = _guard("dflash:after", _chain_part, self, snap, result, taps)
        if part:
            snap.pending.append(part)
        snap.host_s += time.perf_counter() - t0 + taps.host_s
        snap.parts["taps"] = snap.parts.get("taps", 0.0) + taps.host_s
    return result


def _chain_part(worker: Any, snap: _Batch, result: Any, taps: dflash_taps.DFlashTaps) -> dict[str, Any]:
    bs = len(snap.rids)
    logits = result.logits_output.next_token_logits
    if logits is None:
        raise RuntimeError("DFLASH verify result carries no logits (skipped for TP > 1 greedy in newer SGLang)")
    cand = worker._draft_block_tokens_buf[:bs]  # [bs, B]: column 0 the root, then the drafts
    block = int(cand.shape[1])
    outs = snap.rows(_on(result.next_token_ids, logits.device).reshape(bs, -1))  # [b, B]
    rows = snap.rows(logits.detach(), block)  # [b*B, V]
    flat = outs.reshape(-1)  # [b, B] -> [b*B]
    graphs = _graphs(_VERIFY_GRAPHS) if not snap.pending else None  # one replay of the cache per batch
    key = ("chain", tuple(rows.shape), rows.dtype, tuple(flat.shape), flat.dtype)
    nodes = (summarise_nodes(rows, flat).tensors() if graphs is None
             else graphs.run(key, lambda lg, o: summarise_nodes(lg, o).tensors(), rows, flat))
    new_lens = getattr(result, "new_seq_lens", None)
    committed = (snap.rows(new_lens) - snap.rows(result.accept_lens) if isinstance(new_lens, torch.Tensor)
                 else _host_lens(snap, logits.device))  # after the step minus what it appended
    t = {"cand": snap.rows(cand).clone(), "nodes": nodes, "accept_lens": _opt(snap, result.accept_lens),
         "out_tokens": outs.clone()}
    draft = {k: (v if v.dim() == 0 else snap.rows(v)) for k, v in taps.draft.items()} if taps.draft else None
    context = {k: snap.rows(v) for k, v in taps.context.items()} if taps.context else None
    meta: dict[str, Any] = {"layout_in_engine": "chain"}
    if taps.missing:
        meta["draft_not_captured"] = taps.missing
    return {"layout": "chain", "t": t, "committed": committed, "width": block, "meta": meta, "draft": draft,
            "context": context}
