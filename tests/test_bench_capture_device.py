"""scripts/bench_capture_device.py on the CPU: every part runs on stand-in tensors of the hooks' shapes, the per-head
recurrent sketch it compares against is the hooks' own sketch, and bad arguments are exit 2."""

from __future__ import annotations

import json

import torch
from script_loader import load_script

bench = load_script("bench_capture_device")


def test_every_part_is_timed_and_written_with_the_shapes(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["--widths", "tiny", "--batch", "2", "--block", "4", "--repeats", "2", "--device", "cpu",
                       "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["part"] for r in got["rows"]] == list(bench.parts(
        bench._inputs(bench.WIDTHS["tiny"], 2, 4, torch.device("cpu")), 2, 4))
    assert all(0 <= r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["peak_mib"] is None for r in got["rows"])
    assert got["widths"] == bench.WIDTHS["tiny"] and got["batch"] == 2 and got["device"] == "cpu"
    assert "| state.rec_per_head |" in capsys.readouterr().out


def test_the_per_head_recurrent_sketch_is_the_hooks_sketch():
    """state.rec_per_head computes what batch_state's ``rec`` does (another summation order, float32)."""
    x = bench._inputs(bench.WIDTHS["tiny"], 3, 4, torch.device("cpu"))
    hooks = bench.batch_state(x["kv"], x["slots"], x["pools"], x["mamba_slots"])["mamba"]["rec"]
    torch.testing.assert_close(bench._rec_per_head(x["pools"], x["mamba_slots"]), hooks, rtol=1e-4, atol=1e-3)


def test_bad_arguments_are_exit_2(capsys):
    for bad in (["--batch", "0"], ["--block", "1"], ["--repeats", "0"]):
        assert bench.main(["--widths", "tiny", "--device", "cpu", *bad]) == 2
        assert "must be >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--widths", "tiny", "--device", "cuda"]) == 2
        assert "no CUDA device here" in capsys.readouterr().err


def test_the_split_parts_compute_what_their_whole_forms_do():
    """topk_split's values are topk's (ties apart, the same ids), over slices with and without a remainder; the
    recurrent sketch's cut product is the one product to float32 rounding."""
    g = torch.Generator().manual_seed(2)
    for v, width in ((4096, 512), (4100, 512), (300, 512)):
        x = torch.randn(5, v, generator=g)
        vals, ids = bench.topk_split(x, 8, width)
        want = x.topk(8, dim=-1)
        assert torch.equal(vals, want.values) and torch.equal(ids, want.indices)
    x = bench._inputs(bench.WIDTHS["tiny"], 3, 4, torch.device("cpu"))
    got = bench.parts(x, 3, 4)
    torch.testing.assert_close(got["state.rec_split"](), got["state.rec_gemm"](), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got["draft.matmul"](), got["draft.matmul_strided"](), rtol=1e-2, atol=1e-2)


def test_the_draft_top_over_the_scores_is_draft_tops_ranks():
    """top_of_scores gives draft_top's ranks (ids up to the order of tied scores: bf16 rounds some apart to one),
    its reach, and its log-probs to float32 rounding."""
    from refcheck.sglang.draft_side import draft_top
    g = torch.Generator().manual_seed(4)
    scores = (torch.randperm(3 * 5 * 400, generator=g).float().view(3, 5, 400) / 97).to(torch.bfloat16)
    got, want = bench.top_of_scores(scores, 16), draft_top(scores, 16)
    flat = scores.reshape(15, 400).float()
    torch.testing.assert_close(got["logprobs"], want["logprobs"].reshape(15, -1), rtol=0, atol=1e-5)
    assert torch.equal(got["reach"], want["reach"].reshape(15))
    assert torch.equal(flat.gather(1, got["ids"]), flat.gather(1, want["ids"].reshape(15, -1)))  # ties: any order
