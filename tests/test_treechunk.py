"""Tests for ddtree_reference/treechunk.py: the one-chunk (UT/WY) tree gated delta rule against the
level-by-level recurrence, against transformers' chain chunk kernel, the tree mask's effect,
the tree algebra helpers and input validation."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_reference.treechunk import (
    TreeChunk,
    ancestor_matrix,
    gated_delta_tree_chunk,
    gated_delta_tree_levels,
    path_cumsum,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# ---------------------------------------------------------------- helpers
def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max(1, max |ref|)."""
    return (got - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def make_inputs(
    parents: list[int],
    hv: int,
    dk: int,
    dv: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    g_low: float = -3.0,
) -> dict[str, torch.Tensor]:
    """Realistic inputs: k, q l2-normalised (q scaled by 1/sqrt(Dk)), g in [g_low, 0], beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    q = F.normalize(torch.randn(n, hv, dk, generator=gen, dtype=torch.float64), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(n, hv, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(n, hv, dv, generator=gen, dtype=torch.float64)
    g = g_low * torch.rand(n, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(n, hv, generator=gen, dtype=torch.float64).clamp(1e-3, 1 - 1e-3)
    s0 = torch.randn(hv, dk, dv, generator=gen, dtype=torch.float64)
    out = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0}
    out = {name: x.to(dtype) for name, x in out.items()}
    out["parents"] = torch.tensor(parents, dtype=torch.int64)
    return out


def check_chunk_vs_levels(inputs: dict[str, torch.Tensor]) -> None:
    tol = TOL[inputs["q"].dtype]
    res = gated_delta_tree_chunk(**inputs)
    ref_out, ref_states = gated_delta_tree_levels(**inputs)
    n, hv, dk = inputs["q"].shape
    dv = inputs["v"].shape[-1]
    assert isinstance(res, TreeChunk)
    assert res.out.shape == (n, hv, dv) and res.out.dtype == inputs["q"].dtype
    assert rel_err(res.out, ref_out) < tol
    states = res.states()
    assert states.shape == (n, hv, dk, dv)
    assert rel_err(states, ref_states) < tol
    for t in range(n):
        assert rel_err(res.state(t), ref_states[t]) < tol


def ref_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


# ---------------------------------------------------------------- trees
def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def roots(n: int) -> list[int]:
    return [-1] * n


def random_tree(n: int, rng: random.Random, p_root: float = 0.1) -> list[int]:
    return [-1 if t == 0 or rng.random() < p_root else rng.randrange(-1, t) for t in range(n)]


def deep_bushy(n: int, rng: random.Random) -> list[int]:
    """Mostly extends one of the last few nodes: long paths with many short side branches."""
    return [-1 if t == 0 else rng.randrange(max(0, t - 3), t) for t in range(n)]


def two_spines(n: int) -> list[int]:
    """Two interleaved chains, each hanging from its own root at -1 (nodes 0, 2, 4, ... and 1, 3, 5, ...)."""
    return [-1, -1] + [t - 2 for t in range(2, n)]


def tree_cases() -> list[tuple[str, list[int]]]:
    rng = random.Random(1234)
    cases: list[tuple[str, list[int]]] = []
    for n in (1, 2, 7, 16, 33, 64, 65):
        cases += [
            (f"chain{n}", chain(n)),
            (f"star{n}", star(n)),
            (f"roots{n}", roots(n)),
            (f"random{n}", random_tree(n, rng)),
            (f"forest{n}", random_tree(n, rng, p_root=0.3)),
            (f"deepbushy{n}", deep_bushy(n, rng)),
            (f"spines{n}", two_spines(n)),
        ]
    return cases


CASES = tree_cases()


# ---------------------------------------------------------------- chunk == levels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,parents", CASES, ids=[c[0] for c in CASES])
def test_chunk_matches_levels(name: str, parents: list[int], dtype: torch.dtype) -> None:
    seed = len(parents) * 31 + len(name)
    check_chunk_vs_levels(make_inputs(parents, hv=3, dk=8, dv=6, seed=seed, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("g_low", [-3.0, -0.02, 0.0], ids=["g3", "slowdecay", "nodecay"])
def test_chunk_matches_levels_stress(dtype: torch.dtype, g_low: float) -> None:
    """Long paths with little or no decay and beta near 1 (the hardest case for the UT solve)."""
    rng = random.Random(7)
    for parents in (chain(65), deep_bushy(65, rng), random_tree(65, rng)):
        inputs = make_inputs(parents, hv=4, dk=16, dv=16, seed=11, dtype=dtype, g_low=g_low)
        inputs["beta"] = (0.9 + 0.1 * inputs["beta"]).clamp(max=1 - 1e-4)
        check_chunk_vs_levels(inputs)


def test_realistic_head_sizes() -> None:
    """Larger head dims (keys nearly orthogonal, as in a real model) in float32."""
    rng = random.Random(3)
    inputs = make_inputs(random_tree(40, rng), hv=4, dk=64, dv=32, seed=5, dtype=torch.float32)
    check_chunk_vs_levels(inputs)


@st.composite
def trees(draw: st.DrawFn, max_n: int = 65) -> list[int]:
    n = draw(st.integers(1, max_n))
    kind = draw(st.sampled_from(["any", "local", "chainish"]))
    parents = []
    for t in range(n):
        if kind == "any" or t == 0:
            parents.append(draw(st.integers(-1, t - 1)))
        elif kind == "local":
            parents.append(draw(st.integers(max(-1, t - 4), t - 1)))
        else:
            parents.append(t - 1 if draw(st.booleans()) or t < 2 else draw(st.integers(-1, t - 1)))
    return parents


@settings(max_examples=40, deadline=None)
@given(
    parents=trees(),
    hv=st.integers(1, 3),
    dk=st.integers(1, 8),
    dv=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_chunk_matches_levels(parents: list[int], hv: int, dk: int, dv: int, seed: int) -> None:
    inputs = make_inputs(parents, hv, dk, dv, seed, dtype=torch.float64)
    check_chunk_vs_levels(inputs)
    # The same example in float32 (the production dtype).
    check_chunk_vs_levels({name: x.float() if x.is_floating_point() else x for name, x in inputs.items()})


def test_no_overflow_on_deep_siblings() -> None:
    """Non-ancestor pairs with a huge positive log-decay difference must not produce inf/nan."""
    n = 65
    parents = [-1] + list(range(0, n - 2)) + [-1]  # a 64-deep chain plus a lone root at the end
    inputs = make_inputs(parents, hv=2, dk=4, dv=4, seed=0, dtype=torch.float32)
    inputs["g"] = torch.full_like(inputs["g"], -20.0)  # cum reaches -1280: exp(+1260) would overflow
    res = gated_delta_tree_chunk(**inputs)
    assert torch.isfinite(res.out).all() and torch.isfinite(res.states()).all()
    check_chunk_vs_levels(inputs)


# ---------------------------------------------------------------- chain == transformers
def _transformers_chunk():
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    fn = mod.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("n", [1, 5, 64, 65])
def test_chain_matches_transformers_chunk(n: int) -> None:
    fn = _transformers_chunk()
    hv, dk, dv = 4, 16, 8
    inputs = make_inputs(chain(n), hv, dk, dv, seed=n, dtype=torch.float32)
    res = gated_delta_tree_chunk(**inputs)
    q_unscaled = inputs["q"] * dk**0.5  # normalised, not scaled: the kernel scales by 1/sqrt(Dk) itself
    out, final = fn(
        q_unscaled.unsqueeze(0),  # [1, T, H, Dk]
        inputs["k"].unsqueeze(0),  # [1, T, H, Dk]
        inputs["v"].unsqueeze(0),  # [1, T, H, Dv]
        g=inputs["g"].unsqueeze(0),  # [1, T, H]
        beta=inputs["beta"].unsqueeze(0),  # [1, T, H]
        initial_state=inputs["initial_state"].unsqueeze(0),  # [1, HV, Dk, Dv]
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    assert rel_err(res.out, out[0]) < 1e-5
    assert rel_err(res.state(n - 1), final[0]) < 1e-5


# ---------------------------------------------------------------- the mask matters
def test_flat_chain_differs_on_branching_tree() -> None:
    """Running a branching tree as a flat chain (the classic leak) changes the outputs."""
    parents = [-1, 0, 1, 0, 3, -1, 5]  # node 3 branches off node 0, node 5 is a second root
    inputs = make_inputs(parents, hv=2, dk=8, dv=8, seed=42)
    tree = gated_delta_tree_chunk(**inputs)
    flat_inputs = dict(inputs, parents=torch.tensor(chain(len(parents))))
    flat = gated_delta_tree_chunk(**flat_inputs)
    flat_ref, _ = gated_delta_tree_levels(**flat_inputs)
    assert rel_err(flat.out, flat_ref) < 1e-10  # the flat evaluation itself is correct
    # Nodes 0..2 lie on one path starting at the root, so the two evaluations agree there...
    assert rel_err(tree.out[:3], flat.out[:3]) < 1e-10
    # ...and every node off that path sees a different history.
    for t in (3, 4, 5, 6):
        assert (tree.out[t] - flat.out[t]).abs().max().item() > 1e-3, t


# ---------------------------------------------------------------- tree algebra
@pytest.mark.parametrize("name,parents", CASES, ids=[c[0] for c in CASES])
def test_ancestor_matrix(name: str, parents: list[int]) -> None:
    anc = ancestor_matrix(torch.tensor(parents))
    assert anc.dtype == torch.bool
    assert torch.equal(anc, ref_ancestors(parents))


def test_ancestor_matrix_empty() -> None:
    assert ancestor_matrix(torch.zeros(0, dtype=torch.int64)).shape == (0, 0)


@pytest.mark.parametrize("name,parents", CASES[::3], ids=[c[0] for c in CASES[::3]])
def test_path_cumsum(name: str, parents: list[int]) -> None:
    g = -3 * torch.rand(len(parents), 3, dtype=torch.float64)
    cum = path_cumsum(g, torch.tensor(parents))
    ref = torch.empty_like(g)
    for t, p in enumerate(parents):
        ref[t] = g[t] + (ref[p] if p >= 0 else 0)
    assert rel_err(cum, ref) < 1e-12


# ---------------------------------------------------------------- validation
def _good() -> dict[str, torch.Tensor]:
    return make_inputs([-1, 0, 0], hv=2, dk=4, dv=3, seed=0, dtype=torch.float32)


@pytest.mark.parametrize(
    "name,bad",
    [
        ("q", torch.zeros(3, 2)),
        ("q", torch.zeros(3, 2, 5)),
        ("k", torch.zeros(3, 2, 5)),
        ("k", torch.zeros(2, 2, 4)),
        ("v", torch.zeros(3, 3, 3)),
        ("v", torch.zeros(3, 2)),
        ("g", torch.zeros(3)),
        ("g", torch.zeros(3, 3)),
        ("beta", torch.zeros(4, 2)),
        ("initial_state", torch.zeros(2, 4, 4)),
        ("initial_state", torch.zeros(1, 2, 4, 3)),
        ("parents", torch.tensor([-1, 0])),
        ("parents", torch.tensor([[-1, 0, 0]])),
        ("parents", torch.tensor([-1, 1, 0])),  # parents[1] == 1 is not < 1
        ("parents", torch.tensor([-1, 0, 5])),
        ("parents", torch.tensor([-2, 0, 0])),
        ("parents", torch.tensor([-1.0, 0.0, 0.0])),
        ("g", torch.zeros(3, 2, dtype=torch.float64)),  # dtype mismatch
        ("q", torch.zeros(3, 2, 4, dtype=torch.float16)),
    ],
)
@pytest.mark.parametrize("fn", [gated_delta_tree_chunk, gated_delta_tree_levels], ids=["chunk", "levels"])
def test_bad_inputs_raise(name: str, bad: torch.Tensor, fn) -> None:
    inputs = _good()
    inputs[name] = bad
    with pytest.raises(ValueError):
        fn(**inputs)


def test_helpers_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        ancestor_matrix(torch.tensor([0]))
    with pytest.raises(ValueError):
        ancestor_matrix(torch.tensor([[-1]]))
    with pytest.raises(ValueError):
        path_cumsum(torch.zeros(3, 2), torch.tensor([-1, 0]))
    with pytest.raises(ValueError):
        path_cumsum(torch.zeros(3), torch.tensor([-1, 0, 1]))


def test_state_index_out_of_range() -> None:
    res = gated_delta_tree_chunk(**_good())
    with pytest.raises(IndexError):
        res.state(3)
    with pytest.raises(IndexError):
        res.state(-1)


# ---------------------------------------------------------------- device
@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    rng = random.Random(9)
    inputs = make_inputs(random_tree(65, rng), hv=8, dk=64, dv=64, seed=9, dtype=torch.float32)
    cpu = gated_delta_tree_chunk(**inputs)
    cuda_inputs = {name: x.cuda() for name, x in inputs.items()}
    gpu = gated_delta_tree_chunk(**cuda_inputs)
    ref_out, ref_states = gated_delta_tree_levels(**cuda_inputs)
    assert gpu.out.is_cuda
    assert rel_err(gpu.out.cpu(), cpu.out) < 1e-5
    assert rel_err(gpu.out, ref_out) < 1e-5
    assert rel_err(gpu.states(), ref_states) < 1e-5
