"""A probe inside SGLang's Gated DeltaNet layers: the exact tensors each tree-verify forward hands the kernels.

Contract: with ``REFCHECK_GDN_PROBE=DIR`` in the environment of a refcheck SGLang run (the runner then
adds :data:`SPEC` to SGLang's ``forward_hooks``), every TARGET_VERIFY forward of each probed GDN layer
(``REFCHECK_GDN_PROBE_LAYERS``, comma-separated layer ids, default ``0``) writes one record
``DIR/gdn-<pid>-<n>.pt``: what SGLang's ``RadixLinearAttention`` of that layer received and returned,
on the CPU, in the engine's dtypes —

* ``layer``, ``seq_lens`` [bs] (committed lengths), ``input_ids`` [bs*N] (the flattened trees),
  ``draft_token_num`` N;
* ``next_token`` / ``next_sibling`` [bs, N] (the links handed to the conv kernel) and ``parent`` [bs, N]
  (the parent links the conv kernel wrote back);
* ``mixed_qkv`` [bs*N, C], ``a`` / ``b`` [bs*N, HV] (the kernels' inputs);
* ``conv_state`` [bs, C, K-1] and ``ssm_state`` [bs, HV, V, K] of the requests' pool slots, read
  *before* the kernels ran (the committed state the step started from), and ``cache_indices`` [bs];
* ``core`` [bs*N, HV, V] (the core output, before the gated norm).

The hook SGLang registers (a plain forward hook: it cannot see the keyword inputs) installs, on its
first call, a keyword-aware pre-hook on the same module; the first forward (a prefill) is therefore
not probed, which is fine since only verify forwards are. :mod:`refcheck.sglang.capture.gdn_probe_check`
compares the records with the reference. A diagnostic: it copies every probed forward to the host.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch

ENV_DIR = "REFCHECK_GDN_PROBE"
ENV_LAYERS = "REFCHECK_GDN_PROBE_LAYERS"


def probe_layers() -> list[int]:
    raw = os.environ.get(ENV_LAYERS, "0")
    return [int(x) for x in raw.split(",") if x.strip()]


def spec() -> dict[str, Any]:
    """The ``forward_hooks`` entry for the probed layers (SGLang's module names, Qwen3.5 layout)."""
    return {"name": "refcheck-gdn-probe",
            "target_modules": [f"model.layers.{i}.linear_attn.attn" for i in probe_layers()],
            "hook_factory": "refcheck.sglang.capture.gdn_probe:hook_factory", "config": {}}


_counter = itertools.count()


def _cpu(x: Any) -> Any:
    return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x


def _backend(fb: Any) -> Any:
    """The linear-attention backend serving this forward (0.5.17: the forward context's; older: the batch's)."""
    try:
        from sglang.srt.model_executor.forward_context import get_attn_backend

        backend = get_attn_backend()
    except ImportError:
        backend = fb.attn_backend
    return getattr(backend, "linear_attn_backend", backend)


def _failed(module: Any, where: str, exc: BaseException) -> None:
    """A probe failure never breaks the engine: it is written to DIR/errors.txt and that module's probe stops."""
    module._refcheck_probe_off = True
    module._refcheck_probe = None
    d = Path(os.environ.get(ENV_DIR, "."))
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "errors.txt", "a") as f:
        f.write(f"layer {getattr(module, 'layer_id', '?')} {where}: {type(exc).__name__}: {exc}\n")


def _pre(module: Any, args: tuple, kwargs: dict) -> None:
    if getattr(module, "_refcheck_probe_off", False):
        return
    try:
        _record_inputs(module, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not take the engine down
        _failed(module, "inputs", exc)


def _record_inputs(module: Any, args: tuple, kwargs: dict) -> None:
    fb = args[0] if args else kwargs.get("forward_batch")
    module._refcheck_probe = None
    if fb is None or not fb.forward_mode.is_target_verify():
        return
    backend = _backend(fb)
    layer = int(module.layer_id)
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer)
    idx = backend.forward_metadata.mamba_cache_indices
    bs = int(fb.batch_size)
    idx = idx[:bs].long()
    spec_info = fb.spec_info
    module._refcheck_probe = {
        "layer": layer,
        "seq_lens": _cpu(fb.seq_lens[:bs]),
        "input_ids": _cpu(fb.input_ids),
        "draft_token_num": int(spec_info.draft_token_num),
        "next_token": _cpu(spec_info.retrieve_next_token),
        "next_sibling": _cpu(spec_info.retrieve_next_sibling),
        "mixed_qkv": _cpu(kwargs["mixed_qkv"]),
        "a": _cpu(kwargs["a"]),
        "b": _cpu(kwargs["b"]),
        "conv_state": _cpu(cache.conv[0][idx]),  # [bs, C, K-1] before the conv kernel rolls it
        "ssm_state": _cpu(cache.temporal[idx]),  # [bs, HV, V, K]
        "cache_indices": _cpu(idx),
        "intermediate_steps": int(cache.intermediate_ssm.shape[1]) if getattr(cache, "intermediate_ssm", None) is not None else None,
    }


def hook_factory(config: dict) -> Any:
    out_dir = Path(os.environ.get(ENV_DIR, "."))

    def hook(module, inputs, output) -> None:
        if not getattr(module, "_refcheck_probe_installed", False):
            module.register_forward_pre_hook(_pre, with_kwargs=True)
            module._refcheck_probe_installed = True
            return
        rec = getattr(module, "_refcheck_probe", None)
        if rec is None:
            return
        try:
            _record_outputs(module, inputs, output, rec)
        except Exception as exc:  # noqa: BLE001
            _failed(module, "outputs", exc)

    def _record_outputs(module, inputs, output, rec) -> None:
        backend = _backend(inputs[0] if inputs else None)
        parent = getattr(getattr(backend, "forward_metadata", None), "retrieve_parent_token", None)
        rec["parent"] = _cpu(parent)
        rec["core"] = _cpu(output.reshape(-1, *output.shape[-2:]))  # [bs*N, HV, V]
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".gdn-{os.getpid()}-{next(_counter):05d}.tmp"
        torch.save(rec, tmp)
        tmp.rename(tmp.with_name(tmp.name[1:].replace(".tmp", ".pt")))
        module._refcheck_probe = None

    return hook
