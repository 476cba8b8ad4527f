"""Seeded random-projection sketches of KV, conv and recurrent state, and of layer outputs.

Contract: ``sketch_rows(x)`` maps ``[rows, F]`` to ``[rows, SKETCH_DIM]`` float32 with a fixed
Gaussian matrix that depends only on (F, SKETCH_DIM, SEED). It is linear, so
``sketch(a) - sketch(b) == sketch(a - b)``: a relative L2 error measured on sketches estimates the
error of the full tensors (Johnson–Lindenstrauss), and tolerances carry over. Sketches of the same
tensor are bit-identical across runs on the same device; across devices they agree to rounding.

``state_sketch(x)`` maps a whole state entry ``[rows, F]`` to one ``[1, SKETCH_DIM]`` row: row ``w`` is
projected by its own seeded matrix (:func:`row_projections`; row 0's is :func:`projection`'s, so a one-row
entry's state sketch equals its row sketch) and the rows' sketches are summed. That is a Gaussian projection
of the flattened entry, so its relative L2 estimates the whole entry's with the spread of a chi-square with
``SKETCH_DIM`` degrees of freedom (0.50-1.57x of the true value at 99.9 % for r = 16; ``tests/test_sketch.py``)
whatever the rows' correlation; engines record this form (:func:`stored_sketch`), and :func:`as_recorded` puts reference
rows in whichever form a trace holds (row sketches in traces that hold one per row).

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


def _gaussian(features: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + features)
    return torch.randn(features, dim, generator=gen) / dim**0.5  # [F, r] on the CPU


@lru_cache(maxsize=64)
def _projection(features: int, dim: int, seed: int, device: str) -> torch.Tensor:
    return _gaussian(features, dim, seed).to(device)


def projection(features: int, dim: int = SKETCH_DIM, device: str = "cpu") -> torch.Tensor:
    """The seeded Gaussian projection of ``features``-wide rows, [F, dim] float32 on ``device`` (cached)."""
    return _projection(features, dim, SEED, device)


@lru_cache(maxsize=64)
def _row_stack(features: int, rows: int, dim: int, seed: int, device: str) -> torch.Tensor:
    stack = [_gaussian(features, dim, seed + 7919 * w) for w in range(rows)]  # row 0: projection()'s seed
    return torch.stack(stack).to(device)  # rows x [F, r] -> [rows, F, r]


def row_projections(features: int, rows: int, dim: int = SKETCH_DIM, device: str = "cpu",
                    seed: int = SEED) -> torch.Tensor:
    """Row ``w``'s seeded projection for ``w < rows``, [rows, F, dim] float32 on ``device`` (cached); row 0's is
    :func:`projection`'s, and row ``w``'s does not depend on ``rows``."""
    return _row_stack(features, rows, dim, seed, device)


def state_sketch(x: torch.Tensor, dim: int = SKETCH_DIM, seed: int = SEED) -> torch.Tensor:
    """[rows, F] -> [1, dim] float32 on ``x``'s device: each row by its own projection, summed over rows (upcast:
    bf16 accumulation would swamp the signal)."""
    proj = row_projections(x.shape[-1], x.shape[0], dim, str(x.device), seed)  # [rows, F, r]
    return torch.einsum("wf,wfr->r", x.float(), proj)[None]  # [1, r]


def stored_sketch(sketch: torch.Tensor, engine_dtype: str) -> torch.Tensor:
    """A state sketch as a trace stores it: bfloat16 for bfloat16 engines (half the bytes; its rounding is one
    rounding at the engine's own unit roundoff, where the state it summarises carries many, and bfloat16 keeps
    float32's range), float32 for every other (a float16 engine's state deviates by less than bfloat16's
    rounding of the sketch would, and float16 could overflow on large KV)."""
    return sketch.to(torch.bfloat16) if engine_dtype == "bfloat16" else sketch


def as_recorded(rows: torch.Tensor, recorded: torch.Tensor, full: torch.Tensor | None = None) -> torch.Tensor:
    """Reference rows [R, F] in the form an engine recorded them (float32, CPU): the rows themselves when it
    kept its ``full`` rows, the state sketch [1, r] when its ``recorded`` sketch is one row for R > 1, else row
    sketches [R, r]."""
    if full is not None:
        return rows.float().cpu()
    if recorded.shape[0] == 1 and rows.shape[0] > 1:
        return state_sketch(rows).cpu()
    return sketch_rows(rows)


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
