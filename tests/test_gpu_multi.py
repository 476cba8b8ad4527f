"""Two GPUs of one host (marker ``gpu``; skipped with fewer than 2 CUDA devices): the layer-sharded
reference over NCCL against the one-GPU reference, fp32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from refcheck.sharding import free_port

from test_sharded import _decode, _summary  # noqa: E402 (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.gpu


def _load_cuda(device: str):
    from ddtree_reference.drafter import DFlashDrafter
    from ddtree_reference.target import Target
    from refcheck.models import builtin_pair

    tdir, ddir = builtin_pair("hybrid")
    target = Target.load(tdir, device=device)
    return target, DFlashDrafter.load(ddir, target)


def _rank_main(rank: int, world: int, port: int, prompt: list[int], out_dir: str) -> None:
    import torch.distributed as dist

    from ddtree_reference.sharded import PipelineTarget

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on the lent machines
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"))
    try:
        target, drafter = _load_cuda(f"cuda:{rank}")
        sharded = PipelineTarget(target)
        res = _decode(sharded, drafter, prompt, 15, 24)
        s = _summary(res, sharded.local_layers())
        torch.save({"summary": {**s, "steps": [{k: (v.cpu() if torch.is_tensor(v) else
                                                    {i: [t.cpu() for t in ts] for i, ts in v.items()} if k == "state" else v)
                                                for k, v in st.items()} for st in s["steps"]]},
                    "layers": list(sharded.local_layers())}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_sharded_reference_on_two_gpus_equals_one_gpu(tmp_path):
    from refcheck.prompts import load_prompts

    prompt = list(load_prompts()[1].prompt_ids)
    target, drafter = _load_cuda("cuda:0")
    one = _decode(target, drafter, prompt, 15, 24)
    mp.start_processes(_rank_main, args=(2, free_port(), prompt, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["summary"]
        assert got["output"] == one.output_ids
        for a, b in zip(got["steps"], one.steps):
            assert a["accepted"] == b.accepted
            assert torch.allclose(a["topk"], b.topk_logprobs.cpu(), atol=1e-5, rtol=1e-5)
            for i, tensors in a["state"].items():
                want = [t for t in (b.state.keys[i], b.state.values[i], b.state.conv[i], b.state.recurrent[i]) if t is not None]
                assert all(torch.allclose(x, y.cpu(), atol=1e-5, rtol=1e-5) for x, y in zip(tensors, want)), (rank, i)
