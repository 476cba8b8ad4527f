"""refcheck's SGLang plugin: the ``sglang.srt.plugins`` entry point and its capture hooks.

Contract: SGLang calls :func:`register` (no arguments) in its main process and again in every
spawned scheduler process, before the scheduler is built. It always applies the model fixes of
:func:`refcheck.sglang_capture.versions.patch_models` (DFLASH needs them whether or not anything
is captured). Only when ``REFCHECK_CAPTURE_DIR`` is set does it register three AROUND hooks with
SGLang's ``HookRegistry``:

* ``Scheduler.run_batch``: snapshots each request (rid, committed length, root, pool row) before the
  batch runs and, once it has run (SGLang's commit, KV move and mamba-state scatter included),
  records prefill first tokens, target-only decode steps, and the committed KV / conv / recurrent
  state of every verify step recorded during the batch (and whether its forward replayed a CUDA graph);
* ``eagle_utils.eagle_sample`` (tree verify: NGRAM, EAGLE, any plugin algorithm that uses it): the
  tree, every node's log-probs (taken before SGLang adds penalties in place) and the accept outputs;
* ``DFlashWorkerV2.forward_batch_generation`` (DFLASH chain verify): candidates, logits and
  accepted lengths of each decode step, and the drafter's side (its top-k per depth, the context fed to it:
  :mod:`refcheck.sglang_capture.dflash_taps`, which also injects the opt-in ``REFCHECK_DRAFT_FAULT``);
* REFCHECK_DDTREE's worker keeps its drafter's side of each decode step (``last_sides``), attached to the
  step's tree records after the batch;
* ``refcheck.sglang_ddtree.sampling.keyed_sample`` (REFCHECK_DDTREE at temperature > 0, in place of
  ``eagle_sample``): the same tree records plus every node's draw and uniform; the prefill's keyed
  first-token uniforms are read from the worker (``last_first_uniforms``);
* ``sgl_kernel.tree_speculative_sampling_target_only`` (SGLang's tree sampler at temperature > 0,
  NGRAM): its coins, one per node and one per request for the bonus, and its accept thresholds; the
  ``eagle_sample`` record of the same call carries them (``uniforms``, ``residual_uniform``);
* ``ModelRunner.sample``: at temperature > 0 SGLang's sampler overwrites the logits in place with
  ``softmax(logits / T)``; the raw logits are kept from just before it, for the prefill and
  target-only decode records.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refcheck.sglang_capture import dflash_taps, layers, sampler_faults, versions
from refcheck.sglang_capture.records import ENV_DIR, ENV_FULL, UNTRACED_RID_PREFIX, Recorder
from refcheck.sglang_capture.state import committed_rows, summarise, summarise_shard
from refcheck.sglang_capture.steps import StepCapture, chain_steps, prefill_records, root_steps, tree_steps

_registered = False
_patched: list[str] = []
_originals: dict[str, Any] = {}
_recorder: Recorder | None = None


@dataclass
class _Batch:
    """What the scheduler's batch looked like before it ran."""

    mode: str  # "extend", "decode" or "other"
    speculative: bool
    rids: list[str]
    committed: list[int]  # decode: tokens with KV before the step (the root's position)
    roots: list[int]
    prompt_lens: list[int]
    fill_lens: list[int]
    pool_rows: list[int]
    topk: int | None
    pending: list[StepCapture] = field(default_factory=list)
    step_s: float = float("nan")
    raw_logits: torch.Tensor | None = None  # [bs, V] before a sampling batch's sampler overwrote them
    #: the tree sampler's coins [bs, N], bonus coins [bs] and (threshold_single, threshold_acc) of this batch's verify
    coins: tuple[torch.Tensor, torch.Tensor, tuple[float, float]] | None = None
    # target-only decode, from the forward batch on the device: [bs] input ids (the roots) and seq lens (with the
    # root): right even under the overlap scheduler, whose per-request lists lag one step behind
    decode_inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def committed_of(self, rids: list[str]) -> list[int]:
        where = dict(zip(self.rids, self.committed))
        return [where[r] for r in rids]


_batch: _Batch | None = None


def register() -> None:
    """The entry point (``[project.entry-points."sglang.srt.plugins"] refcheck``)."""
    global _registered
    if _registered:
        return
    _registered = True
    _patched.extend(versions.patch_models())
    from refcheck.sglang_ddtree.algorithm import register_algorithm

    if register_algorithm():
        _patched.append("speculative algorithm REFCHECK_DDTREE")
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
                              "hooks": hook_status(), "patched": _patched,
                              "server_topk": versions.server_topk(scheduler) if scheduler is not None else None,
                              "serving": versions.serving_of(scheduler) if scheduler is not None else None})
        except Exception as exc:  # a status we cannot compute must not stop the engine
            _recorder.error("status", f"{type(exc).__name__}: {exc}")
    return _recorder


def _guard(where: str, fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # capture must never break the engine: record and carry on
        _rec().error(where, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        return None


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs[name]


# -- run_batch -----------------------------------------------------------------------------------------
def _snapshot(scheduler: Any, batch: Any) -> _Batch:
    fm = batch.forward_mode
    mode = "extend" if fm.is_extend() else "decode" if fm.is_decode() else "other"
    reqs = list(batch.reqs)
    spec = not batch.spec_algorithm.is_none()
    return _Batch(
        mode=mode, speculative=spec, rids=[r.rid for r in reqs],
        committed=[len(r.origin_input_ids) + len(r.output_ids) - 1 for r in reqs],
        roots=[int(r.output_ids[-1]) if r.output_ids else -1 for r in reqs],
        prompt_lens=[len(r.origin_input_ids) for r in reqs],
        fill_lens=[len(getattr(r, "fill_ids", None) or r.origin_input_ids) for r in reqs],
        pool_rows=[int(i) for i in batch.req_pool_indices.tolist()] if batch.req_pool_indices is not None else [],
        topk=versions.server_topk(scheduler),
    )


def _pools(scheduler: Any) -> tuple[Any, Any]:
    runner = scheduler.tp_worker.model_runner
    return runner.token_to_kv_pool, runner.req_to_token_pool


def _attach_state(scheduler: Any, snap: _Batch, steps: list[StepCapture]) -> None:
    kv_pool, rtp = _pools(scheduler)
    if hasattr(kv_pool, "full_attention_layer_id_mapping"):
        kv_layers = sorted(kv_pool.full_attention_layer_id_mapping)
    else:
        start = int(getattr(kv_pool, "start_layer", 0) or 0)
        kv_layers = list(range(start, start + int(kv_pool.layer_num)))
    kv = {layer: (kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer)) for layer in kv_layers}
    mamba: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    axis = -1
    if hasattr(rtp, "mamba_map"):
        pool = rtp.mamba_pool
        cache = pool.mamba_cache
        axis = int(getattr(pool, "conv_window_axis", -1))
        mamba = {layer: (cache.conv[0][i], cache.temporal[i]) for layer, i in rtp.mamba_map.items()}
    full = bool(os.environ.get(ENV_FULL))
    row_of = dict(zip(snap.rids, snap.pool_rows))
    tp_rank, tp_size = versions.tp_of(scheduler)
    groups = getattr(getattr(rtp, "mamba_pool", None), "conv_shard_groups", None)
    for s in steps:
        rpi = row_of[s.rid]
        slots = rtp.req_to_token[rpi, s.committed_len: s.committed_len + len(s.accepted)]
        mslot = int(rtp.req_index_to_mamba_index_mapping[rpi]) if mamba else None
        rows = committed_rows(kv, slots, mamba, mslot, axis)
        if tp_size > 1:  # this rank's shards, sketched so that the ranks' sketches combine exactly
            s.state = summarise_shard(rows, tp_rank, tp_size, tuple(groups) if groups else None, full)
            s.meta.update(tp_rank=tp_rank, tp_size=tp_size, conv_groups=list(groups) if groups else None)
        else:
            s.state = summarise(rows, full)


def _attach_layers(scheduler: Any, steps: list[StepCapture]) -> None:
    """Per-request slices of the verify forward's layer sketches (when the layer hooks are on)."""
    if not layers.FORWARDS:
        return
    n_layers = int(scheduler.tp_worker.model_runner.model_config.num_hidden_layers)
    sk = layers.take(sum(len(s.tokens) for s in steps), n_layers)  # [layers, bs*N, r]
    layers.FORWARDS.clear()
    if sk is None:
        return
    off = 0
    for s in steps:
        s.layer_sketch = sk[:, off: off + len(s.tokens)].clone()  # [layers, N, r]
        off += len(s.tokens)


def _after(scheduler: Any, snap: _Batch, result: Any) -> None:
    """Record what the batch produced (``_run_batch`` has synchronised the device after it)."""
    rec = _rec(scheduler)
    logits = getattr(getattr(result, "logits_output", None), "next_token_logits", None)
    if snap.raw_logits is not None:  # the sampler overwrote them with probabilities
        logits = snap.raw_logits
    if snap.mode == "extend":
        if logits is None:
            return
        done = [i for i, (p, f) in enumerate(zip(snap.prompt_lens, snap.fill_lens)) if f >= p]  # last prefill chunk
        recs = prefill_records(logits[done], torch.as_tensor(result.next_token_ids).reshape(-1)[done],
                               [snap.rids[i] for i in done], [snap.prompt_lens[i] for i in done],
                               getattr(getattr(scheduler, "draft_worker", None), "last_first_uniforms", None))
        for r in recs:
            rec.prefill(r)
        return
    if snap.mode != "decode":
        return
    if not snap.speculative:
        if logits is None:
            rec.error("run_batch", "target-only decode result has no logits")
            return
        roots, committed, source = snap.roots, snap.committed, "requests"
        if snap.decode_inputs is not None and len(snap.decode_inputs[0]) == len(snap.rids):
            roots = [int(t) for t in snap.decode_inputs[0].tolist()]
            committed = [int(n) - 1 for n in snap.decode_inputs[1].tolist()]  # seq lens count the root
            source = "forward_batch"
        snap.pending = root_steps(roots, logits, torch.as_tensor(result.next_token_ids), snap.rids, committed,
                                  meta={"server_topk": snap.topk, "committed_from": source,
                                        "committed_lag": _lags(snap.committed, committed)})
    elif not snap.pending:
        rec.error("run_batch", "a speculative decode batch ran but no verify step was captured (is its hook live?)")
        return
    _attach_state(scheduler, snap, snap.pending)
    _attach_layers(scheduler, snap.pending)
    draft_s = getattr(getattr(scheduler, "draft_worker", None), "last_draft_s", None)  # REFCHECK_DDTREE's drafting
    sides = getattr(getattr(scheduler, "draft_worker", None), "last_sides", None)  # REFCHECK_DDTREE's drafter side
    for s in snap.pending:
        if isinstance(sides, dict) and s.layout == "tree":
            s.attach_draft(sides.get(s.rid))
        s.meta["batch_step_s"] = snap.step_s
        if isinstance(draft_s, float):
            s.meta["batch_draft_s"] = draft_s
        s.meta["batch_size"] = len(snap.rids)
        s.meta["cuda_graph"] = bool(getattr(result, "can_run_cuda_graph", False))  # the verify replayed a CUDA graph
        rec.step(s)


def _untraced(batch: Any) -> bool:
    """A batch made only of timing requests (rid prefix UNTRACED_RID_PREFIX) runs as if no capture were loaded."""
    reqs = getattr(batch, "reqs", None) or []
    return bool(reqs) and all(str(r.rid).startswith(UNTRACED_RID_PREFIX) for r in reqs)


def _run_batch(original, self, batch, *args, **kwargs):
    global _batch
    if _untraced(batch):
        return original(self, batch, *args, **kwargs)
    _rec(self)
    snap = _guard("run_batch:snapshot", _snapshot, self, batch)
    _batch = snap
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the step's wall time starts with an idle device
    t0 = time.perf_counter()
    try:
        result = original(self, batch, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0  # the whole scheduler step (draft + verify + commit), capture excluded
    finally:
        _batch = None
    if snap is not None:
        snap.step_s = step_s
        _guard("run_batch:after", _after, self, snap, result)
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
        pre = _guard("eagle_sample:before", _tree_inputs, args, kwargs)
    result = original(*args, **kwargs)
    if snap is not None and pre is not None:
        recs = _guard("eagle_sample:after", _tree_records, snap, pre, result)
        if recs:
            snap.pending.extend(recs)
    return result


def _tree_inputs(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    verify_input, batch, logits_output = (_arg(args, kwargs, 0, "verify_input"), _arg(args, kwargs, 1, "batch"),
                                          _arg(args, kwargs, 2, "logits_output"))
    if batch.forward_mode.is_idle():
        return None
    nt = getattr(verify_input, "retrieve_next_token", None)
    ns = getattr(verify_input, "retrieve_next_sibling", None)
    pos = getattr(verify_input, "positions", None)
    return {"tokens": verify_input.draft_token.detach().clone(), "nt": None if nt is None else nt.detach().clone(),
            "ns": None if ns is None else ns.detach().clone(), "pos": None if pos is None else pos.detach().clone(),
            # before the original runs: eagle_sample adds penalties and logit bias to these in place
            "logits": logits_output.next_token_logits.detach().clone(), "rids": [r.rid for r in batch.reqs],
            # tokens with KV before the step (the roots' positions), on the device: right under overlap too
            "seq_lens": _seq_lens(batch)}


def _tree_records(snap: _Batch, pre: dict[str, Any], result: tuple) -> list[StepCapture]:
    predict, accept_lens, accept_index = result[:3]
    draws, uniforms = result[3:5] if len(result) >= 5 else (None, None)  # the keyed sampler's
    residuals = None
    coins, snap.coins = snap.coins, None
    if coins is not None and uniforms is None:  # SGLang's tree sampler ran inside this eagle_sample
        uniforms, residuals = coins[0].reshape(-1), coins[1]  # [bs, N] -> [bs*N]
    committed, meta = _committed(snap, pre["rids"], pre["seq_lens"])
    if coins is not None:
        meta["accept_thresholds"] = list(coins[2])
    return tree_steps(pre["tokens"], pre["nt"], pre["ns"], pre["logits"], accept_index, accept_lens, predict,
                      pre["rids"], committed, positions=pre["pos"], draws=draws, uniforms=uniforms, residuals=residuals,
                      meta={"server_topk": snap.topk, "layout_in_engine": "tree" if (snap.topk or 0) > 1 else "chain",
                            **meta})


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


def _seq_lens(batch: Any) -> list[int] | None:
    lens = getattr(batch, "seq_lens", None)
    return [int(n) for n in lens.tolist()] if isinstance(lens, torch.Tensor) else None


def _lags(requests: list[int], used: list[int]) -> int:
    """How many steps' tokens the scheduler's request lists were behind the device (0 without overlap)."""
    return max((abs(a - b) for a, b in zip(requests, used)), default=0)


def _committed(snap: _Batch, rids: list[str], device_lens: list[int] | None) -> tuple[list[int], dict[str, Any]]:
    """Committed lengths of a verify batch: the forward batch's (device) where it has them, else the requests'."""
    from_requests = snap.committed_of(rids)
    if device_lens is None or len(device_lens) != len(rids):
        return from_requests, {"committed_from": "requests"}
    return device_lens, {"committed_from": "forward_batch", "committed_lag": _lags(from_requests, device_lens)}


def _dflash_forward(original, self, batch, *args, **kwargs):
    snap = _batch
    fault = dflash_taps.active()  # a drafter fault for refcheck's selftest acts on untraced batches too
    decode = False
    if snap is not None:
        decode = bool(_guard("dflash:before", lambda: not (batch.forward_mode.is_extend() or batch.is_extend_in_batch
                                                           or batch.forward_mode.is_idle())))
        rids = [r.rid for r in batch.reqs]
    if snap is None and fault is None:
        return original(self, batch, *args, **kwargs)
    with dflash_taps.dflash_taps(self, len(batch.reqs), snap is not None and decode, fault) as taps:
        result = original(self, batch, *args, **kwargs)
    if snap is not None and decode:
        recs = _guard("dflash:after", _chain_records, self, snap, rids, result)
        if recs:
            for b, rec in enumerate(recs):
                rec.attach_draft(taps.side(b))
                if taps.missing:
                    rec.meta["draft_not_captured"] = taps.missing
            snap.pending.extend(recs)
    return result


def _chain_records(worker: Any, snap: _Batch, rids: list[str], result: Any) -> list[StepCapture]:
    bs = len(rids)
    logits = result.logits_output.next_token_logits
    if logits is None:
        raise RuntimeError("DFLASH verify result carries no logits (skipped for TP > 1 greedy in newer SGLang)")
    cand = worker._draft_block_tokens_buf[:bs]  # [bs, B]: column 0 the root, then the drafts
    new_lens = getattr(result, "new_seq_lens", None)
    device = ([int(n) - int(a) for n, a in zip(new_lens.tolist(), result.accept_lens.tolist())]
              if isinstance(new_lens, torch.Tensor) else None)  # after the step minus what it appended
    committed, meta = _committed(snap, rids, device)
    return chain_steps(cand, logits, result.accept_lens, result.next_token_ids.reshape(bs, -1), rids,
                       committed, meta={"server_topk": snap.topk, "layout_in_engine": "chain", **meta})
