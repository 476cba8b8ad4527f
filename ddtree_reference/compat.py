"""Differences between transformers releases, isolated in one place.

Contract: the rest of the reference calls these helpers instead of touching version-specific
APIs. Supported: transformers 5.12.1 (what SGLang 0.5.17's offline bundle puts first on sys.path
on the GPU machine, so code running in-process with SGLang sees it) and 5.17 (the GPU machine's
own) through the newest release (5.23 here). 5.12.1 needs no code path of its own: the CPU
suite, ``refcheck diff`` and ``refcheck gate`` pass under it; only z-lab's ``dflash`` package (a
test dependency, not the reference) fails there, because it calls
``DynamicCache.activate_past_recording``, which 5.12.1 lacks. Known differences handled here:

* Qwen3.5's rotary embedding takes 3-axis mRoPE position ids ``(3, batch, n)``; 5.17 requires
  the three axes explicitly, 5.12.1 and newer releases also accept ``(batch, n)``. Passing the
  explicit 3-axis form works on all of them.
* :func:`hf_cache_state` reads ``DynamicCache.layers`` (``LinearAttentionLayer`` with
  ``conv_states`` / ``recurrent_states``, ``DynamicLayer`` with ``keys`` / ``values``); 5.12.1,
  5.17 and 5.23 use that layout (checked against 5.12.1 and 5.23 on the built-in models).
* The oracle never passes a cache (the cache keyword moved from ``past_key_values`` to ``cache``
  in 5.24 and passing the wrong one is silently ignored), so nothing else here is versioned.
"""

from __future__ import annotations

import torch

#: Model types whose rotary embedding is multimodal (3-axis) RoPE.
MROPE_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def rope_position_ids(model_type: str, positions: torch.Tensor) -> torch.Tensor:
    """Position ids in the layout the model's rotary embedding expects.

    positions: [n] int64 absolute positions. Returns [1, n] or, for mRoPE models, [3, 1, n]
    (text tokens use the same position on all three axes).
    """
    ids = positions.view(1, -1)  # [1, n]
    if model_type in MROPE_MODEL_TYPES:
        return ids.unsqueeze(0).expand(3, 1, -1)  # [3, 1, n]
    return ids


def full_forward_logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a plain, cache-free forward of ``token_ids`` ([n] int64) through the HF model.

    Returns [n, V] float32 (cast so that argmax and log-softmax compare across dtypes).
    """
    with torch.no_grad():
        out = model(input_ids=token_ids.view(1, -1), use_cache=False)
    return out.logits[0].float()  # [n, V]


def hf_cache_state(model: torch.nn.Module, token_ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Committed state after a plain transformers prefill of ``token_ids``, in the reference layout.

    Returns ``{"kv.L.k": [Hkv, P, D], "kv.L.v": ..., "conv.L": [K-1, C], "rec.L": [HV, Dk, Dv]}``
    or None when this transformers release keeps its cache in a layout not recognised here (the
    caller then falls back to the reference's own sequential replay).
    """
    with torch.no_grad():
        out = model(input_ids=token_ids.view(1, -1), use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    state: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if hasattr(layer, "recurrent_states"):
            conv, rec = layer.conv_states, layer.recurrent_states
            conv, rec = (conv[0], rec[0]) if isinstance(conv, dict) else (conv, rec)
            k_minus_1 = conv.shape[-1] - 1 if conv.shape[-1] > 1 else conv.shape[-1]
            # transformers keeps the last K conv inputs [1, C, K]; the reference keeps K-1 as [K-1, C].
            state[f"conv.{i}"] = conv[0].transpose(0, 1)[-k_minus_1:]
            state[f"rec.{i}"] = rec[0].float()
        elif getattr(layer, "keys", None) is not None:
            state[f"kv.{i}.k"], state[f"kv.{i}.v"] = layer.keys[0], layer.values[0]
        else:
            return None
    return state
