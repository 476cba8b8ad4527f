"""The layer-sharded reference (ddtree_reference/sharded.py) over 2 and 3 CPU processes with gloo.

Each rank runs the whole DDTree decoder SPMD over its PipelineTarget; rank results are compared with
a one-process decode: outputs, per-step trees and acceptance, node log-probs (bit-identical: the
same CPU operations on the same inputs) and every rank's committed state of its own layers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from ddtree_reference.sharded import split_layers
from refcheck.sharding import free_port


def _decode(target, drafter, prompt, budget, max_new):
    from ddtree_reference.decode import DDTreeDecoder, DecodeConfig

    cfg = DecodeConfig(budget=budget, max_new_tokens=max_new, keep_states=True, keep_layers=True)
    return DDTreeDecoder(target, drafter, cfg).generate(prompt)


def _load(pair: str = "hybrid"):
    from ddtree_reference.drafter import DFlashDrafter
    from ddtree_reference.target import Target
    from refcheck.models import builtin_pair

    torch.set_num_threads(1)
    tdir, ddir = builtin_pair(pair)
    target = Target.load(tdir)
    return target, DFlashDrafter.load(ddir, target)


def _summary(res, layers: range | None = None) -> dict:
    out = {"output": res.output_ids, "lps": res.output_logprobs, "steps": []}
    for s in res.steps:
        st = {"tokens": s.tree.tokens.tolist(), "accepted": s.accepted, "topk": s.topk_logprobs.clone(),
              "layers": s.layer_outputs.clone()}
        if layers is not None:
            st["state"] = {i: [t.clone() for t in (s.state.keys[i], s.state.values[i], s.state.conv[i], s.state.recurrent[i])
                               if t is not None] for i in layers}
        out["steps"].append(st)
    return out


def _rank_main(rank: int, world: int, port: int, prompt: list[int], budget, max_new: int, out_dir: str) -> None:
    import torch.distributed as dist

    from ddtree_reference.sharded import PipelineTarget

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        target, drafter = _load()
        sharded = PipelineTarget(target)
        res = _decode(sharded, drafter, prompt, budget, max_new)
        empty = [i for i, k in enumerate(res.steps[0].state.keys) if k is None and res.steps[0].state.conv[i] is None]
        torch.save({"summary": _summary(res, sharded.local_layers()), "layers": list(sharded.local_layers()),
                    "empty": empty}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_split_layers_is_contiguous_and_balanced():
    assert split_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError):
        split_layers(2, 3)


@pytest.mark.parametrize("world,budget", [(2, 15), (3, None)])
def test_sharded_reference_equals_one_process(tmp_path, world, budget):
    from refcheck.prompts import load_prompts

    prompt = list(load_prompts()[1].prompt_ids)
    max_new = 20
    target, drafter = _load()
    ref_res = _decode(target, drafter, prompt, budget, max_new)
    ref = _summary(ref_res)
    mp.start_processes(_rank_main, args=(world, free_port(), prompt, budget, max_new, str(tmp_path)), nprocs=world,
                       start_method="spawn")
    held = []
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        s = got["summary"]
        assert s["output"] == ref["output"] and s["lps"] == ref["lps"]
        assert len(s["steps"]) == len(ref["steps"])
        for a, b, full in zip(s["steps"], ref["steps"], ref_res.steps):
            assert a["tokens"] == b["tokens"] and a["accepted"] == b["accepted"]
            assert torch.equal(a["topk"], b["topk"])  # bit-identical node log-probs
            assert torch.equal(a["layers"], b["layers"])  # every layer's output, broadcast from its owner
            for i, tensors in a["state"].items():
                want = [t for t in (full.state.keys[i], full.state.values[i], full.state.conv[i], full.state.recurrent[i])
                        if t is not None]
                assert all(torch.equal(x, y) for x, y in zip(tensors, want)), (rank, i)
        assert set(got["empty"]).isdisjoint(got["layers"])  # a rank holds state only for its own layers
        held += got["layers"]
    assert sorted(held) == list(range(len(target.layers)))


def test_cli_replay_against_a_sharded_reference_equals_unsharded(cli, tmp_path):
    """`refcheck diff --against T --ref-shards 2 --mode replay` (gloo, CPU) reports what one process does."""
    import json

    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest
    from refcheck.trace.io import read_trace, write_trace

    cases = load_manifest(REPO_GOLDEN).cases
    # SGLang's bf16 DFLASH trace, labelled float32: judged by the fixed fp32 bounds (no rounding ensemble, which
    # layer sharding cannot run), so both replays see many failures to agree on
    trace = read_trace(REPO_GOLDEN / cases["sglang-hybrid-dflash-b15"].file)
    trace.provenance["dtype"] = "float32"
    path = tmp_path / "as-fp32.arrow"
    write_trace(trace, path)
    code1, out1, _ = cli("diff", "--against", str(path), "--mode", "replay", "--json")
    code2, out2, err2 = cli("diff", "--against", str(path), "--mode", "replay", "--ref-shards", "2", "--json")
    r1, r2 = json.loads(out1)["reports"][0], json.loads(out2)["reports"][0]
    assert code1 == code2 == 1 and r1["counts"]["fail"] > 10
    assert r1["counts"] == r2["counts"] and r1["fail_categories"] == r2["fail_categories"], err2
    assert r1["stats"]["steps"] == r2["stats"]["steps"]
    code, _, err = cli("diff", "--against", str(path), "--ref-shards", "2")
    assert code == 2 and "--mode replay" in err
    # a bf16 engine's trace is judged by the calibrated verdict, which needs the whole reference
    bf16 = REPO_GOLDEN / cases["sglang-hybrid-dflash-b15"].file
    code, _, err = cli("diff", "--against", str(bf16), "--mode", "replay", "--ref-shards", "2")
    assert code == 2 and "calibrated verdict" in err
