"""scripts/bench_verify.py's fixed-shape step, run on CPU through the eager stand-in of its CUDA-graph
capture: the same plumbing (snapshot/undo, the bonus buffer, outputs read from fixed tensors) that the
graphed rows use on a GPU, checked against the eager drafter, forward and walk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from refcheck.prompts import load_prompts

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_verify.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_verify", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("budget", [15, 64])
def test_fixed_shape_step_equals_eager_and_times_every_phase(bench, hybrid, budget):
    target, drafter = hybrid
    prompt = torch.tensor(list(load_prompts()[4].prompt_ids))
    drafter.reset()
    state, pf = target.prefill(prompt, capture=tuple(drafter.target_layer_ids))
    drafter.extend(pf.context, torch.arange(len(prompt)), prompt)
    res = bench.fixed_shape_step(target, drafter, state, int(prompt[-1]), budget, bench.Timer(torch.device("cpu")),
                                 reps=3, use_graphs=False)
    assert "error" not in res, res
    assert res["equal"] and res["logit_err"] < 1e-4 and res["draft_err"] < 1e-4
    assert {k: len(v) for k, v in res["times"].items()} == {"draft": 3, "verify": 3, "step": 3}
    assert state.length == len(prompt) and drafter.ctx_len == len(prompt)  # the eager objects are untouched


def test_capture_stand_in_rewrites_the_same_outputs(bench):
    box = {"n": 0}

    def fn():
        box["n"] += 1
        return (torch.tensor([box["n"]]),)

    replay, (out,) = bench.capture(fn, undo=lambda: None, use_graphs=False)
    assert out.item() == 1
    replay()
    replay()
    assert out.item() == 3  # the caller's tensor, rewritten by each replay like a graph's output
