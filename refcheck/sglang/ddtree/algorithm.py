"""Registering ``REFCHECK_DDTREE`` with SGLang's speculative-algorithm registry.

Contract: :func:`register_algorithm` (called by refcheck's plugin in SGLang's main and scheduler
processes) registers the algorithm under refcheck's own name (and its leaky, shadow and fault-injected
twins: ``REFCHECK_DDTREE_LEAKY_CHAIN``, ``REFCHECK_DDTREE_SHADOW``, ``REFCHECK_DDTREE_FAULT_*``), so it never collides with a future
builtin DDTree, and returns whether it did (False where SGLang or its registry is missing, or the
name is taken). The algorithm presents itself to SGLang as NGRAM-like (``is_ngram``): tree verify
with no draft model of SGLang's, NGRAM's verify input and KV sizing. Its server-args check runs in
the main process: it requires a DFlash draft checkpoint and ``speculative_num_draft_tokens`` (budget
+ 1), forces ``speculative_eagle_topk >= 2`` (else the hybrid GDN backend would run the trees in its
chain layout, the leak), turns off mixed chunks, and raises the server's hidden-state ceiling to
``full`` (:data:`HIDDEN_STATES_CEILING`), which is what lets the verify run inside SGLang's CUDA graphs.

CUDA graphs (SGLang 0.5.17): the decode graph runner captures the target's ``TARGET_VERIFY`` graphs
once, at start-up, for ``speculative_num_draft_tokens`` tokens per request
(``decode_cuda_graph_runner.py:268``, via ``CustomSpecAlgo.get_num_tokens_per_req_for_target_verify``)
and with the hidden-state mode ``max(server ceiling, the capture spec input's mode)``
(``:266``, ``:752-756``; ceiling from ``base_runner.py:211-215``). For an ``is_ngram()`` algorithm the
capture spec input says ``NULL`` (``:1335-1347``; DFLASH's says ``FULL`` for its target, ``:1307-1333``),
so with the default ceiling the graphs return no hidden states, and the first verify, which asks
``FULL`` for the drafter, dies in ``load_batch`` (``_validate_capture_hidden_mode``, ``:1029-1034``,
``:1085``: "The runtime hidden-state mode exceeds the fixed CUDA graph capture mode (NULL)"). The
registry has no per-algorithm hook for that mode; the server's ceiling (``return_hidden_states_mode``,
read by ``get_server_return_hidden_states_mode``, ``forward_batch_info.py:234-240``) is the one
setting that raises it. Eager forwards are unchanged by it: the worker passes ``FULL`` explicitly to
every target forward, and SGLang copies hidden states to a request only when that request asks.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from refcheck.sglang.ddtree.faults import ALGORITHMS as FAULT_ALGORITHMS
from refcheck.sglang.ddtree.hidden_states import HIDDEN_STATES_CEILING
from refcheck.sglang.ddtree.shadow import SHADOW_NAME

NAME = "REFCHECK_DDTREE"
#: the same worker with the hybrid backend in its chain layout (topk 1): the tree flattened through the
#: recurrent layers, as the seeds' engine ran it; registered so refcheck can show it is caught
LEAKY_NAME = "REFCHECK_DDTREE_LEAKY_CHAIN"
#: the same worker with one engine fault injected into SGLang's tree verify, one algorithm per fault
#: (``REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX`` ...; refcheck/sglang/ddtree/faults.py says what each does)
FAULT_NAMES: tuple[str, ...] = tuple(FAULT_ALGORITHMS)

_done = False

def check_server_args(server_args, leaky: bool = False) -> None:
    """ValueError for settings the worker cannot honour; in-place fixes for the ones it needs."""
    draft = getattr(server_args, "speculative_draft_model_path", None)
    if not draft:
        raise ValueError(f"{NAME} needs --speculative-draft-model-path (a DFlash draft checkpoint)")
    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{NAME}: no config.json in the draft checkpoint {draft}")
    cfg = json.loads(cfg_path.read_text())
    if "dflash_config" not in cfg:
        raise ValueError(f"{NAME}: {draft} is not a DFlash draft (its config has no dflash_config)")
    n = getattr(server_args, "speculative_num_draft_tokens", None)
    if not n or int(n) < 2:
        raise ValueError(f"{NAME} needs --speculative-num-draft-tokens = budget + 1 >= 2, got {n}")
    if int(getattr(server_args, "tp_size", 1) or 1) > 1:
        raise ValueError(f"{NAME} runs with tensor parallelism 1")
    if not getattr(server_args, "disable_overlap_schedule", False):
        raise ValueError(f"{NAME} needs --disable-overlap-schedule")
    # per-node GDN state (parent-indexed) needs topk > 1 at backend construction; topk 1 = chain layout
    server_args.speculative_eagle_topk = 1 if leaky else max(2, int(getattr(server_args, "speculative_eagle_topk", 0) or 0))
    if getattr(server_args, "speculative_num_steps", None) is None:
        server_args.speculative_num_steps = int(n) - 1
    if getattr(server_args, "max_running_requests", None) is None:
        server_args.max_running_requests = 48
    server_args.enable_mixed_chunk = False
    # the target's TARGET_VERIFY (and prefill) CUDA graphs are captured at this ceiling; this hook runs
    # after SGLang's own _handle_return_hidden_states_mode (server_args.py:3465 vs 3592), so set both
    server_args.return_hidden_states_mode = HIDDEN_STATES_CEILING
    server_args.enable_return_hidden_states = True


#: the builtin's answers a tree-verify plugin without an SGLang draft model must give like NGRAM, even
#: where the registry's base class has a default of its own (``has_draft_kv``: True there, no draft KV here)
_NGRAM_ANSWERS = ("has_draft_kv",)


def ngram_like_spec_class(base: type, builtin: type) -> type:
    """A subclass of SGLang's ``CustomSpecAlgo`` that answers like the builtin NGRAM.

    ``is_ngram`` is True, so SGLang takes NGRAM's paths (verify input, KV sizing, no draft worker).
    Every public method of the builtin enum that ``base`` lacks is borrowed from the enum, where
    it is written in terms of the ``is_*()`` answers. SGLang 0.5.17's base class lacks
    ``carries_draft_hidden_states``, ``create_future_map``, ``build_disagg_draft_input`` and
    ``need_topk``, which its scheduler calls at start-up. The borrowed methods are real class
    attributes, so 0.5.23's conformance check (``dir(spec_class)``) sees them too.
    """
    attrs: dict[str, object] = {"is_ngram": lambda self: True, "__module__": __name__}
    for name, fn in vars(builtin).items():
        if isinstance(fn, types.FunctionType) and not name.startswith("_") and (
                not hasattr(base, name) or name in _NGRAM_ANSWERS):
            attrs[name] = fn
    return type("RefcheckDDTreeAlgo", (base,), attrs)


def faulty_worker(worker: type, fault: str) -> type:
    """The worker class with ``fault`` injected (one subclass per fault, so SGLang instantiates it as usual)."""
    return type(f"{worker.__name__}_{fault.replace('-', '_')}", (worker,), {"fault": fault, "__module__": worker.__module__})


def register_algorithm() -> bool:
    global _done
    if _done:
        return True
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import CustomSpecAlgo
    except ImportError:
        return False

    spec_class = ngram_like_spec_class(CustomSpecAlgo, SpeculativeAlgorithm)

    def factory_for(fault: str | None):
        def factory(server_args):
            from refcheck.sglang.ddtree.worker import DDTreeWorker

            if fault == "shadow":
                return type("DDTreeWorker_shadow", (DDTreeWorker,), {"shadow": True, "__module__": DDTreeWorker.__module__})
            return DDTreeWorker if fault is None else faulty_worker(DDTreeWorker, fault)
        return factory

    entries = [(NAME, check_server_args, None), (LEAKY_NAME, lambda a: check_server_args(a, leaky=True), None),
               (SHADOW_NAME, check_server_args, "shadow"),
               *((name, check_server_args, fault) for name, fault in FAULT_ALGORITHMS.items())]
    for name, validate, fault in entries:
        try:
            SpeculativeAlgorithm.register(name, supports_overlap=False, validate_server_args=validate,
                                          spec_class=spec_class)(factory_for(fault))
        except (ValueError, TypeError) as exc:  # already registered (another copy of the plugin) or refused
            if "already" not in str(exc).lower():
                raise
    _done = True
    return True
