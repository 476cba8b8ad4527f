"""Faults injected into SGLang's tree sampler (NGRAM at temperature > 0), for checking that refcheck catches them.

Contract: with ``REFCHECK_SAMPLER_FAULT`` set in the engine's environment to one of :data:`FAULTS`, the
plugin's hook on ``sgl_kernel.tree_speculative_sampling_target_only`` records the coins SGLang made,
then hands the kernel :func:`apply`'s altered inputs, so SGLang samples wrongly while the trace says
what a correct engine would have been given (as a bug inside the kernel would look from outside):

* ``coin-shared``: every node's coin is the root's: the walk's decisions are not independent (the
  "one random number reused for sibling nodes / depths" bug);
* ``target-sharpened``: the target probabilities are squared and renormalised before the walk and the
  bonus (temperature halved: a temperature applied twice at T = 2, a sharpening at any T).

No fault is active unless the variable is set; the runner records it in the trace's provenance
(``sampler_fault``). Never imports SGLang.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ENV_FAULT = "REFCHECK_SAMPLER_FAULT"
FAULTS = ("coin-shared", "target-sharpened")


def active() -> str | None:
    """The fault named in the environment (None: none); an unknown name is an error, not silently ignored."""
    name = os.environ.get(ENV_FAULT) or None
    if name is not None and name not in FAULTS:
        raise ValueError(f"{ENV_FAULT}={name!r}: not one of {FAULTS}")
    return name


def apply(name: str, call: dict[str, Any]) -> dict[str, Any]:
    """The kernel's arguments ``call`` (by name) with fault ``name`` applied (new tensors; the caller's are
    untouched)."""
    out = dict(call)
    if name == "coin-shared":
        coins = out["uniform_samples"]  # [bs, N]
        out["uniform_samples"] = coins[:, :1].expand_as(coins).contiguous()  # [bs, 1] -> [bs, N]
    elif name == "target-sharpened":
        p = out["target_probs"]  # [bs, N, V] float32
        sq = p * p
        out["target_probs"] = (sq / sq.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)).contiguous()
    return out
