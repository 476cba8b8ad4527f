"""Every SGLang-version difference the capture plugin and the runner depend on, in one place.

Contract: :data:`HOOK_TARGETS` names the functions the plugin wraps (identical in SGLang 0.5.17 and
0.5.23, the two releases we read and support); :data:`BINDINGS` lists modules that import a hooked
function by name, whose binding must be patched too (the plugin checks them). :func:`patch_models`
applies model fixes an older release needs (0.5.17's text-only ``Qwen3_5ForCausalLM`` lacks
``set_dflash_layers_to_capture``; 0.5.23 has it) and returns what it patched.
:func:`server_topk` reads ``speculative_eagle_topk`` (a server-args field in 0.5.17, the spec
namespace in 0.5.23); :func:`prefill_end` where a request's prefill chunk ends (``extend_range`` in 0.5.17,
``fill_ids`` before). Nothing here imports SGLang at module import time.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

SUPPORTED = ("0.5.17", "0.5.23")

HOOK_TARGETS = {
    "run_batch": "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "eagle_sample": "sglang.srt.speculative.eagle_utils.eagle_sample",
    "dflash": "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
    # REFCHECK_DDTREE's keyed sampler (temperature > 0), refcheck's own: the same tree records plus the draws
    "ddtree_sample": "refcheck.sglang.ddtree.sampling.keyed_sample",
    # SGLang's sampler (prefill and target-only decode) overwrites the logits in place with softmax(logits / T)
    # when a batch samples: the capture keeps the raw logits from just before it
    "sample": "sglang.srt.model_executor.model_runner.ModelRunner.sample",
    # SGLang's tree sampler at temperature > 0 (eagle_sample imports it from sgl_kernel when it runs): the
    # capture keeps its coins, so NGRAM's walk can be replayed exactly (ddtree_reference/children_first.py)
    "verify_coins": "sgl_kernel.tree_speculative_sampling_target_only",
}

#: sgl_kernel.tree_speculative_sampling_target_only's parameters, in order (0.5.17 and 0.5.23): a positional
#: call is read by these names
TREE_SAMPLER_ARGS = ("predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
                     "retrive_next_token", "retrive_next_sibling", "uniform_samples",
                     "uniform_samples_for_final_sampling", "target_probs", "draft_probs", "threshold_single",
                     "threshold_acc", "deterministic")

#: hook name -> modules that do ``from ... import <function>`` (their binding is what runs)
BINDINGS = {
    "eagle_sample": ("sglang.srt.speculative.ngram_worker", "sglang.srt.speculative.eagle_worker_common"),
}


def resolve(target: str) -> Any:
    """'pkg.mod.Class.attr' or 'pkg.mod.func' -> the attribute (imports the module)."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import any module of {target}")


#: (release, model_type prefix) -> why that release cannot run that model family in float32 (measured)
NO_FLOAT32 = {
    ("0.5.17", "qwen3_5"): "sgl_kernel's gemma_rmsnorm (Qwen3.5's RMSNorm) has no float32 kernel: the engine "
                           "fails with 'failed to dispatch data type Float' (measured on the H200)",
}


def float32_refusal(version: str, model_type: str) -> str | None:
    """Why SGLang ``version`` cannot run a ``model_type`` target in float32, or None where nothing is known."""
    for (release, prefix), why in NO_FLOAT32.items():
        if version == release and model_type.startswith(prefix):
            return why
    return None


def installed_version() -> str:
    """The installed SGLang's version from its distribution metadata (no import), or 'not installed'."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "not installed"


def sglang_version() -> str:
    try:
        import sglang
    except ImportError:
        return "not installed"
    return str(getattr(sglang, "__version__", "unknown"))


def patch_models() -> list[str]:
    """Apply the model fixes this SGLang needs; returns the names of what was patched."""
    patched = []
    try:
        text = importlib.import_module("sglang.srt.models.qwen3_5_text")
    except ImportError:
        return patched
    cls = getattr(text, "Qwen3_5ForCausalLM", None)
    if cls is not None and not hasattr(cls, "set_dflash_layers_to_capture"):
        def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
            # DFlash wants each target layer's output (HF hidden_states[k+1]); SGLang's body captures
            # the residual stream *entering* a layer, hence k + 1 (as the VL and Next classes do).
            self.capture_aux_hidden_states = True
            self.model.set_dflash_layers_to_capture([k + 1 for k in layer_ids])

        cls.set_dflash_layers_to_capture = set_dflash_layers_to_capture
        patched.append("qwen3_5_text.Qwen3_5ForCausalLM.set_dflash_layers_to_capture")
    return patched


def serving_of(scheduler: Any) -> dict[str, Any]:
    """How this scheduler actually serves (after SGLang's own start-up resolution, which may change what was
    asked: e.g. a hybrid target's radix cache without the mamba extra buffer turns overlap off)."""
    args = getattr(scheduler, "server_args", None)
    radix_off = getattr(scheduler, "disable_radix_cache", getattr(args, "disable_radix_cache", None))
    overlap, page = getattr(scheduler, "enable_overlap", None), getattr(scheduler, "page_size", None)
    decode, prefill = graph_backends(args)
    return {"overlap": None if overlap is None else bool(overlap),  # (None: this release does not say)
            "page_size": None if page is None else int(page),
            "radix_cache": None if radix_off is None else not bool(radix_off),
            "cuda_graphs": None if decode is None else decode != "disabled",
            "cuda_graph_backends": None if decode is None else {"decode": decode, "prefill": prefill}}


def graph_backends(args: Any) -> tuple[str | None, str | None]:
    """(decode, prefill) CUDA graph backends the server resolved ("full", "breakable", "tc_piecewise", "disabled";
    None: not said). 0.5.17 keeps them in ``server_args.cuda_graph_config`` (its per-phase flags, JSON config and
    start-up resolution all fold into it); ``disable_cuda_graph`` is only its legacy input, read where the release has
    no config."""
    cfg = getattr(args, "cuda_graph_config", None)
    decode, prefill = (getattr(getattr(cfg, phase, None), "backend", None) for phase in ("decode", "prefill"))
    if decode is not None:
        return str(decode), None if prefill is None else str(prefill)
    off = getattr(args, "disable_cuda_graph", None)
    return (None, None) if off is None else ("disabled" if off else "full", None)


#: ServerArgs fields a capture's status keeps (SGLang 0.5.17 names): what a reader needs to judge a capture of a run
#: refcheck did not start (:mod:`refcheck.sglang.served`)
SERVER_FIELDS = ("model_path", "dtype", "kv_cache_dtype", "speculative_algorithm", "speculative_draft_model_path",
                 "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                 "speculative_ngram_max_bfs_breadth", "speculative_dflash_block_size", "tp_size", "dp_size", "page_size",
                 "disable_cuda_graph", "disable_overlap_schedule", "disable_radix_cache", "attention_backend",
                 "linear_attn_backend", "sampling_backend", "random_seed", "enable_dp_attention", "lora_paths",
                 "enable_custom_logit_processor", "mamba_radix_cache_strategy", "mamba_ssm_dtype")


def prefill_end(req: Any) -> int | None:
    """Where the prefill chunk a batch runs for ``req`` ends, in context tokens (prompt, then output): 0.5.17 keeps
    the chunk as ``req.extend_range`` (``end``), older releases as ``req.fill_ids`` (the tokens filled through this
    chunk). None when the request has neither (a release this module does not know): whether the chunk finishes the
    prompt cannot be told. A long prompt runs in several chunks (``--chunked-prefill-size``); only the last one's
    next token is the request's first."""
    rng = getattr(req, "extend_range", None)
    if rng is not None:
        return int(rng.end)
    fill = getattr(req, "fill_ids", None)
    return None if fill is None else len(fill)


def server_of(scheduler: Any) -> dict[str, Any]:
    """The scheduler's server arguments of :data:`SERVER_FIELDS` it has, as plain values (others as text)."""
    args = getattr(scheduler, "server_args", None)
    out: dict[str, Any] = {}
    for name in SERVER_FIELDS:
        value = getattr(args, name, None)
        out[name] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return out


def kv_replicas(scheduler: Any, tp_size: int) -> int:
    """How many consecutive tensor-parallel ranks hold each KV head: 1 unless the target has fewer KV heads than
    ranks (SGLang then gives each rank one head, ``tp_size // heads`` ranks the same one). The head count is the
    model config's (``get_total_num_kv_heads``); a scheduler that does not say is taken as 1."""
    config = getattr(getattr(getattr(scheduler, "tp_worker", None), "model_runner", None), "model_config", None)
    total = getattr(config, "get_total_num_kv_heads", None)
    heads = total() if callable(total) else None
    if not isinstance(heads, int) or heads < 1 or tp_size <= heads:
        return 1
    return tp_size // heads


def server_topk(scheduler: Any) -> int | None:
    args = getattr(scheduler, "server_args", None)
    topk = getattr(args, "speculative_eagle_topk", None) if args is not None else None
    context = runtime_context() if topk is None else None
    if context is not None:
        try:
            topk = getattr(context.get_spec(), "speculative_eagle_topk", None)
        except Exception:  # noqa: BLE001 - a context without a spec: no top-k to read
            topk = None
    return None if topk is None else int(topk)


@functools.cache
def runtime_context() -> Any | None:
    """SGLang's process-wide runtime context module (``sglang.srt.runtime_context``, 0.5.23), or None in releases
    without one: looked up once per process, as the hooks ask at every recorded batch and a failed import searches
    the package's directory each time."""
    try:
        return importlib.import_module("sglang.srt.runtime_context")
    except Exception:  # noqa: BLE001 - older releases (or no SGLang): no runtime context
        return None


def _int_attr(holder: Any, name: str) -> int | None:
    """``holder.name`` when it is an int; None when it is not, or when reading it raises (a runtime context reads
    its process groups, which a process that set none up does not have)."""
    try:
        value = getattr(holder, name, None)
    except Exception:  # noqa: BLE001 - the capture asks; it must not break the engine's step
        return None
    return value if isinstance(value, int) else None


def tp_of(scheduler: Any) -> tuple[int, int]:
    """(tensor-parallel rank, size) of a scheduler process.

    Where releases keep them: older ones on the scheduler (``tp_rank``, ``tp_size``); 0.5.17 on its
    ``ParallelState`` (``scheduler.ps``); 0.5.23 in the process-wide runtime context
    (``sglang.srt.runtime_context.get_parallel()``). The server arguments' ``tp_size`` is the last word on
    the size. (Reading only the first of these made every 0.5.17 rank call itself rank 0.)
    """
    holders = [scheduler, getattr(scheduler, "ps", None)]
    context = runtime_context()
    if context is not None:
        try:
            holders.append(context.get_parallel())
        except Exception:  # noqa: BLE001 - a context without parallel state: the other holders say
            pass
    rank = size = None
    for h in holders:
        if h is None:
            continue
        rank = rank if rank is not None else _int_attr(h, "tp_rank")
        size = size if size is not None else _int_attr(h, "tp_size")
    args = getattr(scheduler, "server_args", None)
    size = size or getattr(args, "tp_size", None) or 1
    return int(rank or 0), int(size)
