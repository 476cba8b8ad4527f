"""Seeded random-projection sketches of KV, conv and recurrent state, and of layer outputs.

Contract: ``sketch_rows(x)`` maps ``[rows, F]`` to ``[rows, SKETCH_DIM]`` float32 with a fixed
Gaussian matrix that depends only on (F, SKETCH_DIM, SEED). It is linear, so
``sketch(a) - sketch(b) == sketch(a - b)``: a relative L2 error measured on sketches estimates the
error of the full tensors (Johnson–Lindenstrauss), and tolerances carry over. Sketches of the same
tensor are bit-identical across runs on the same device; across devices they agree to rounding.

Per-kind row layouts (reference layouts, see ddtree_reference/state.py):
``kv_k``/``kv_v``: the rows appended by the step, [Hkv, a, D] -> [a, Hkv*D];
``conv``: [K-1, C]; ``rec``: [HV, Dk, Dv] -> [HV, Dk*Dv]; layer outputs [layers, N, H] -> [layers, N, r].
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ddtree_reference.state import TargetState

SKETCH_DIM = 16
SEED = 20261130


@lru_cache(maxsize=64)
def _projection(features: int, dim: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + features)
    return (torch.randn(features, dim, generator=gen) / dim**0.5).to(device)  # [F, r]


def projection(features: int, dim: int = SKETCH_DIM, device: str = "cpu") -> torch.Tensor:
    """The seeded Gaussian projection of ``features``-wide rows, [F, dim] float32 on ``device`` (cached)."""
    return _projection(features, dim, SEED, device)


def sketch_on_device(x: torch.Tensor, dim: int = SKETCH_DIM) -> torch.Tensor:
    """[..., F] -> [..., dim] float32 where ``x`` is (upcast first: bf16 accumulation would swamp the signal)."""
    return x.float() @ _projection(x.shape[-1], dim, SEED, str(x.device))


def sketch_rows(x: torch.Tensor, dim: int = SKETCH_DIM) -> torch.Tensor:
    """[rows, F] -> [rows, dim] float32 on the CPU."""
    return sketch_on_device(x, dim).cpu()


def state_rows(state: TargetState, new_from: int) -> dict[str, tuple[int, str, torch.Tensor]]:
    """name -> (layer, kind, rows [rows, F]) for the state a step committed (KV rows from new_from)."""
    rows: dict[str, tuple[int, str, torch.Tensor]] = {}
    for layer, (k, v, c, r) in enumerate(zip(state.keys, state.values, state.conv, state.recurrent)):
        if k is not None:
            for kind, t in (("kv_k", k), ("kv_v", v)):
                new = t[:, new_from:]  # [Hkv, a, D]
                rows[f"{kind}.{layer}"] = (layer, kind, new.transpose(0, 1).reshape(new.shape[1], -1))  # [a, Hkv*D]
        if c is not None:
            rows[f"conv.{layer}"] = (layer, "conv", c)  # [K-1, C]
            rows[f"rec.{layer}"] = (layer, "rec", r.reshape(r.shape[0], -1))  # [HV, Dk*Dv]
    return rows


def layer_sketch(outputs: torch.Tensor) -> torch.Tensor:
    """[layers, N, H] -> [layers, N, SKETCH_DIM] float32."""
    n_layers, n, h = outputs.shape
    return sketch_rows(outputs.reshape(n_layers * n, h)).reshape(n_layers, n, -1)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0 when both are zero)."""
    diff = float((got.double() - ref.double()).norm())
    base = float(ref.double().norm())
    return diff / base if base > 0 else (0.0 if diff == 0 else float("inf"))


def rel_l2_rows(got: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """:func:`rel_l2` of ``got`` [r] against every row of ``refs`` [m, r] at once: [m] float64."""
    diff = (got.double()[None, :] - refs.double()).norm(dim=-1)  # [m]
    base = refs.double().norm(dim=-1)  # [m]
    same = torch.where(diff == 0, 0.0, float("inf")).to(torch.float64)  # a zero reference row
    return torch.where(base > 0, diff / base.clamp_min(torch.finfo(torch.float64).tiny), same)


def cosine(got: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = got.double().flatten(), ref.double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b) / (na * nb)
