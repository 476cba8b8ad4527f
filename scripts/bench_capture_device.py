"""The capture hooks' device work per recorded DFLASH decode batch, part by part, at a model's widths.

Usage (no SGLang needed; on a GPU for device times)::

    python scripts/bench_capture_device.py [--widths real|builtin|tiny] [--batch 32] [--block 16]
        [--repeats 30] [--device cuda] [--json OUT]

Calls the hooks' own device functions on stand-in tensors of the shapes SGLang hands them for a DFLASH decode
batch of ``--batch`` requests and ``--block``-token blocks, at ``--widths``: ``real`` (Qwen3.6-27B's, as
``scripts/real_width.py build``: hidden 5120, vocabulary 248 320, 48 Gated DeltaNet value heads of 128x128, 8
layers of which 6 linear-attention and 2 attention, a 5-layer drafter fed 5 target layers), ``builtin`` (the
built-in hybrid pair's) or ``tiny`` (a test scale). The parts, each timed alone:

- ``verify``: :func:`refcheck.sglang.capture.steps.summarise_nodes` over the block's float32 logits ``[b*B, V]``;
  ``verify.log_softmax`` and ``verify.topk`` are its two largest steps alone;
- ``draft``: :func:`refcheck.sglang.capture.dflash_taps._draft`, the drafter's depths through the target's head
  ``[V, H]`` and their top ranks; ``draft.matmul`` is its product alone
  (:func:`refcheck.sglang.capture.dflash_taps.draft_logits`, one 2-D product), ``draft.matmul_strided`` the same
  product over the depths' strided 3-D view, for comparison (a batched product that reads the head per request);
  ``draft.top`` its top ranks alone (:func:`refcheck.sglang.draft_side.draft_top` of the product), and
  ``draft.top_scores`` the same ranks taken over the bf16 scores themselves, each log-prob the score less the
  row's log-sum-exp, for comparison;
- ``context``: :func:`refcheck.sglang.capture.dflash_taps._context`, the sketch of the drafter's fed features;
- ``state``: :func:`refcheck.sglang.capture.state.batch_state` over SGLang-laid pools (KV ``[slots, H_kv, D]``
  per attention layer; conv ``[L, slots, C, K-1]`` and float32 SSM ``[L, slots, HV, V, K]``);
  ``state.rec_split`` is the recurrent sketch's product ``[L*b, HV*V*K] @ [HV*V*K, r]`` alone, cut along K as the
  hooks run it (:func:`refcheck.sglang.capture.long_product.long_product`); ``state.rec_gemm`` the same as one
  product and ``state.rec_per_head`` as one product per head summed over heads, for comparison;
- ``verify.topk_logits`` is ``verify.topk`` over the raw logits instead of their log-probs, and
  ``verify.topk_split`` over the log-probs in two stages (each 2 048-wide slice of the vocabulary's top k, then the
  top k of those), for comparison.

Each part runs once to warm up (lazy projections, the allocator's blocks; on CUDA its peak device memory beyond
what was allocated before it is read then), then ``--repeats`` times; on CUDA each call is timed by events around it
(device time, the launches' gaps included), elsewhere by the wall clock. Prints one table row per part (median, min
and max ms, peak MiB) and, with ``--json``, writes them with the shapes and the device. The verify's node summary
and the drafter's top ranks reduce in row chunks (:mod:`refcheck.sglang.vocab_rows`); ``verify.log_softmax`` is
the whole block's log-softmax in one call, for comparison.
The figures are what the hooks' device work costs by itself, on an idle device; what it costs inside SGLang's
step (memory pressure, the engine's own kernels around it) is ``scripts/capture_cost.py``'s to measure.
Exit 0, or 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench_verify's timer beside this script

from bench_verify import Timer  # noqa: E402

from refcheck.models import builtin_pair  # noqa: E402
from refcheck.models.build import REAL_TINY, _target_fields, real_configs  # noqa: E402
from refcheck.sglang.capture.dflash_taps import _context, _draft, draft_logits  # noqa: E402
from refcheck.sglang.capture.long_product import long_product  # noqa: E402
from refcheck.sglang.capture.state import MambaPools, _ssm_projection, batch_state  # noqa: E402
from refcheck.sglang.capture.steps import node_logprobs, summarise_nodes  # noqa: E402
from refcheck.sglang.draft_side import DRAFT_MARGIN, DRAFT_TOPK, draft_top  # noqa: E402
from refcheck.sketch import SKETCH_DIM  # noqa: E402


def _widths(target: dict[str, Any], draft: dict[str, Any]) -> dict[str, int]:
    """A pair's widths as the bench uses them, from its target's config fields and its drafter's config: hidden,
    vocabulary, the drafter's fed target layers, linear-attention layers (their key and value heads, key and value
    head dims, conv kernel), attention layers (their KV heads and head dim)."""
    kinds = list(target["layer_types"])
    return dict(hidden=target["hidden_size"], vocab=target["vocab_size"],
                fed=len(draft["dflash_config"]["target_layer_ids"]), linear=kinds.count("linear_attention"),
                key_heads=target["linear_num_key_heads"], value_heads=target["linear_num_value_heads"],
                key_dim=target["linear_key_head_dim"], value_dim=target["linear_value_head_dim"],
                conv=target["linear_conv_kernel_dim"], attention=kinds.count("full_attention"),
                kv_heads=target["num_key_value_heads"], kv_dim=target["head_dim"])


def presets() -> dict[str, dict[str, int]]:
    """``real``: the real pair of ``scripts/real_width.py build`` (8 layers); ``builtin``: the built-in hybrid pair;
    ``tiny``: the real pair's layout at its test scale (:data:`refcheck.models.build.REAL_TINY`), all read from
    :mod:`refcheck.models.build` and the built-in drafter's shipped config."""
    builtin_draft = json.loads((builtin_pair("hybrid")[1] / "config.json").read_text())
    return {"real": _widths(*real_configs(8)), "builtin": _widths(_target_fields("hybrid")[1], builtin_draft),
            "tiny": _widths(*real_configs(8, REAL_TINY))}


WIDTHS = presets()


def _inputs(w: dict[str, int], bs: int, block: int, device: torch.device) -> dict[str, Any]:
    """Stand-in tensors of the shapes (and dtypes) SGLang hands the hooks, seeded."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # drawn in float32 on the CPU

    rows, slots = bs * block, 2 * bs
    conv_dim = 2 * w["key_heads"] * w["key_dim"] + w["value_heads"] * w["value_dim"]
    pools = MambaPools(layers=list(range(w["linear"])), rows=list(range(w["linear"])),
                       conv=randn(w["linear"], slots, conv_dim, w["conv"] - 1),
                       ssm=randn(w["linear"], slots, w["value_heads"], w["value_dim"], w["key_dim"],
                                 dtype=torch.float32))
    kv = {w["linear"] + i: (randn(slots * block, w["kv_heads"], w["kv_dim"]),
                            randn(slots * block, w["kv_heads"], w["kv_dim"])) for i in range(w["attention"])}
    return {"logits": randn(rows, w["vocab"], dtype=torch.float32),
            "picks": torch.randint(0, w["vocab"], (rows,), generator=g).to(device),
            "hidden": randn(rows, w["hidden"]), "head": randn(w["vocab"], w["hidden"]) * 0.02,
            "fed": randn(rows, w["fed"] * w["hidden"]),
            "positions": torch.arange(rows, device=device), "lens": torch.full((bs,), block, device=device),
            "kv": kv, "slots": torch.arange(bs * block, device=device).view(bs, block),
            "pools": pools, "mamba_slots": torch.arange(bs, device=device)}


def _rec_per_head(pools: MambaPools, ms: torch.Tensor) -> torch.Tensor:
    """The recurrent sketch as one product per head, summed over heads: [L, b, r]."""
    ssm = pools.ssm[:, ms]  # [L, b, HV, V, K]
    n, b, hv, v, k = ssm.shape
    proj = _ssm_projection(hv, k, v, str(ssm.device))  # [HV, V*K, r]
    per_head = torch.bmm(ssm.reshape(n * b, hv, v * k).transpose(0, 1), proj)  # [HV, L*b, V*K] @ [HV, V*K, r]
    return per_head.sum(0).view(n, b, -1)  # [HV, L*b, r] -> [L*b, r] -> [L, b, r]


def topk_split(x: torch.Tensor, k: int, width: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` of ``[M, V]`` in two stages: each ``width``-wide slice's top k (the vocabulary past the
    last whole slice as one more), then the top k of those candidates: (values, indices) ``[M, k]``."""
    m, v = x.shape
    s = v // width
    if s < 2:
        return x.topk(k, dim=-1)
    cut = s * width
    part = x[:, :cut].reshape(m, s, width).topk(min(k, width), dim=-1)  # [M, S, W] -> [M, S, k]
    offsets = torch.arange(s, device=x.device)[None, :, None] * width  # [1, S, 1]
    vals, ids = part.values.reshape(m, -1), (part.indices + offsets).reshape(m, -1)  # [M, S, k] -> [M, S*k]
    if cut < v:
        tail = x[:, cut:].topk(min(k, v - cut), dim=-1)
        vals, ids = torch.cat([vals, tail.values], -1), torch.cat([ids, tail.indices + cut], -1)
    top = vals.topk(k, dim=-1)
    return top.values, ids.gather(-1, top.indices)


def top_of_scores(scores: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """:func:`refcheck.sglang.draft_side.draft_top`'s ranks taken over the scores in their own dtype: the top k (and
    its margin) and the reach over ``[..., V]`` scores, each log-prob its score less the row's log-sum-exp (float32)."""
    flat = scores.reshape(-1, scores.shape[-1])  # [..., V] -> [R, V]
    top = flat.topk(min(k + DRAFT_MARGIN, flat.shape[-1]), dim=-1)
    lse = torch.logsumexp(flat.float(), dim=-1, keepdim=True)  # float32: as draft_top's log-softmax
    reach = (flat >= top.values[:, k - 1: k]).sum(dim=-1)
    return {"ids": top.indices, "logprobs": top.values.float() - lse, "reach": reach}


def parts(x: dict[str, Any], bs: int, block: int) -> dict[str, Callable[[], Any]]:
    """Each timed part as a no-argument call over the stand-in tensors."""
    pools, ms = x["pools"], x["mamba_slots"]
    n, hv, v, k = pools.ssm.shape[0], pools.ssm.shape[2], pools.ssm.shape[3], pools.ssm.shape[4]
    rec_proj = _ssm_projection(hv, k, v, str(pools.ssm.device)).reshape(hv * v * k, -1)  # [HV*V*K, r]
    hs = x["hidden"].view(bs, block, -1)[:, 1:, :]  # [b*B, H] -> [b, B-1, H]
    logp = node_logprobs(x["logits"])  # [b*B, V] float32
    scores = draft_logits(x["hidden"], x["head"], bs, block)  # [b, B-1, V] in the head's dtype
    return {
        "verify": lambda: summarise_nodes(x["logits"], x["picks"]).tensors(),
        "verify.log_softmax": lambda: node_logprobs(x["logits"]),
        "verify.topk": lambda: logp.topk(8, dim=-1),
        "verify.topk_logits": lambda: x["logits"].topk(8, dim=-1),
        "verify.topk_split": lambda: topk_split(logp, 8),
        "draft": lambda: _draft(x["hidden"], x["head"], bs, block),
        "draft.matmul": lambda: draft_logits(x["hidden"], x["head"], bs, block),
        "draft.matmul_strided": lambda: torch.matmul(hs, x["head"].T),
        "draft.top": lambda: draft_top(scores, DRAFT_TOPK),
        "draft.top_scores": lambda: top_of_scores(scores, DRAFT_TOPK),
        "context": lambda: _context(x["fed"], x["positions"], x["lens"], bs),
        "state": lambda: batch_state(x["kv"], x["slots"], pools, ms),
        "state.rec_split": lambda: long_product(pools.ssm[:, ms].reshape(n * bs, -1), rec_proj),
        "state.rec_gemm": lambda: pools.ssm[:, ms].reshape(n * bs, -1) @ rec_proj,
        "state.rec_per_head": lambda: _rec_per_head(pools, ms),
    }


def bench(widths: str, bs: int, block: int, repeats: int, device: torch.device) -> list[dict[str, Any]]:
    """One row per part: median, min and max ms over ``repeats`` calls after one warm-up call."""
    w = WIDTHS[widths]
    timed = Timer(device)  # CUDA events on a CUDA device, the wall clock elsewhere
    rows = []
    for name, fn in parts(_inputs(w, bs, block, device), bs, block).items():
        peak = _peak_mib(fn, device)  # the warm-up call
        ms = timed(fn, repeats, warmup=0)
        rows.append({"part": name, "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                     "peak_mib": peak})
    return rows


def _peak_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """The device memory one call of ``fn`` takes at its peak beyond what was allocated before it, MiB (None off
    CUDA)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _check(args: argparse.Namespace) -> str | None:
    if args.batch < 1 or args.block < 2 or args.repeats < 1:
        return "--batch and --repeats must be >= 1 and --block >= 2"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {args.device}: no CUDA device here"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", choices=sorted(WIDTHS), default="real")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    problem = _check(args)
    if problem is not None:
        print(f"bench_capture_device: {problem}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    rows = bench(args.widths, args.batch, args.block, args.repeats, device)
    print(f"{args.widths} widths, {args.batch} requests x {args.block}-token blocks, {args.repeats} calls each, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    print("| part | median ms | min | max | peak MiB |\n|---|---|---|---|---|")
    for r in rows:
        peak = "—" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(f"| {r['part']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | {r['max_ms']:.3f} | {peak} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"widths": WIDTHS[args.widths], "preset": args.widths, "batch": args.batch,
                                         "block": args.block, "device": str(device), "sketch_dim": SKETCH_DIM,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
