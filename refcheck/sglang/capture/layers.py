"""Per-layer sketches of SGLang's target forwards, for layer bisection of a failing node.

Contract: :func:`hook_factory` is what SGLang's ``forward_hooks`` server argument names
(``refcheck.sglang.capture.layers:hook_factory``); the hook it returns sits on every decoder layer
(:data:`TARGET_PATTERNS`, SGLang's ``model.layers.<i>`` names) and sketches the layer's output (the
residual stream after the layer: SGLang returns ``(hidden, residual)``, whose sum is it, computed at
once because the next layer's fused add-norm rewrites ``residual`` in place) with refcheck's seeded
projection, ``[tokens, H] -> [tokens, r]`` float32, kept on the device (the plugin ships them with the step's
record). The sketches of one forward are collected by
layer id in :data:`FORWARDS` (the last few forwards); :func:`take` returns the latest forward whose
every layer saw ``tokens`` rows, as ``[layers, tokens, r]``. Hooks fire only on eager forwards (SGLang
registers them after CUDA-graph capture).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from refcheck.sketch import sketch_on_device

TARGET_PATTERNS = ["model.layers.[0-9]", "model.layers.[0-9][0-9]", "model.layers.[0-9][0-9][0-9]"]
SPEC = {"name": "refcheck-layer-sketches", "target_modules": TARGET_PATTERNS,
        "hook_factory": "refcheck.sglang.capture.layers:hook_factory", "config": {}}

#: recent forwards: each a dict layer id -> [tokens, r] sketch
FORWARDS: deque[dict[int, torch.Tensor]] = deque(maxlen=4)


def layer_output(output: Any) -> torch.Tensor:
    """A decoder layer's return value -> the residual stream after it ([tokens, H])."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


def hook_factory(config: dict) -> Any:
    def hook(module, inputs, output) -> None:
        layer = getattr(module, "layer_id", None)
        if layer is None:
            return
        try:
            with torch.no_grad():
                out = layer_output(output)  # [tokens, H]
                sketch = sketch_on_device(out)  # [tokens, r]
        except Exception:  # noqa: BLE001 - inside SGLang's forward: this forward keeps no layer sketches
            FORWARDS.append({})  # an incomplete forward, which take() never returns
            return
        if layer == 0 or not FORWARDS or layer in FORWARDS[-1]:
            FORWARDS.append({})
        FORWARDS[-1][int(layer)] = sketch

    return hook


def take(tokens: int, num_layers: int) -> torch.Tensor | None:
    """[layers, tokens, r] of the latest complete forward over ``tokens`` rows, else None."""
    for fwd in reversed(FORWARDS):
        if len(fwd) == num_layers and all(t.shape[0] == tokens for t in fwd.values()):
            return torch.stack([fwd[i] for i in sorted(fwd)])
    return None
