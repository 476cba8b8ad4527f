"""The SGLang runner, first part: target-only decoding (``--sglang-algorithm NONE``) as a trace.

Contract: :func:`engine_kwargs` is the one place that turns refcheck settings into
``sglang.Engine`` arguments for clean diffs (token ids in and out, greedy, triton attention,
overlap scheduling and radix cache off, page size 1, CUDA graphs off unless asked). For target-only
decoding SGLang's public API already returns what a diff needs, so no hook is involved:
:func:`target_only_trace` turns each request's ``output_ids`` and ``meta_info`` (chosen-token and
top-k log-probs) into trace steps: step t verifies a root-only tree (the previous token) and emits
token t, exactly what the reference decoder does at budget 0. KV and recurrent state are not
exposed by the public API (unsupported until the capture plugin exists); speculative algorithms
(DFLASH, NGRAM, DDTree) need per-step capture inside the scheduler and are refused with a clear
error for now.

SGLang's ``meta_info`` format: ``output_token_logprobs`` is a list of ``(logprob, token_id, text)``
and ``output_top_logprobs`` a list (per output token) of lists of ``(logprob, token_id, text)``.
"""

from __future__ import annotations

import math
import time
from typing import Any

from refcheck.errors import UsageError
from refcheck.prompts import Prompt
from refcheck.runners.reference import EngineSpec
from refcheck.trace.io import RequestRow, StepRow, Trace

TOPK = 5
SUPPORTED_ALGORITHMS = ("NONE",)


def engine_kwargs(spec: EngineSpec, model_path: str, algorithm: str = "NONE", cuda_graphs: bool = False,
                  mem_fraction_static: float = 0.3) -> dict[str, Any]:
    if spec.dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"SGLang runs bfloat16/float16/float32, got {spec.dtype!r}")
    kw: dict[str, Any] = dict(
        model_path=model_path,
        skip_tokenizer_init=True,  # token ids in and out: the reference compares ids, not text
        attention_backend="triton",
        sampling_backend="pytorch",
        disable_overlap_schedule=True,
        disable_radix_cache=True,
        disable_cuda_graph=not cuda_graphs,
        page_size=1,
        dtype=spec.dtype,
        mem_fraction_static=mem_fraction_static,
    )
    if algorithm != "NONE":
        kw["speculative_algorithm"] = algorithm
    return kw


def _pairs(entries: list | None) -> list[tuple[float, int]]:
    """[(logprob, token_id, text)] -> [(logprob, token_id)]; None entries (no logprob) kept as NaN."""
    out = []
    for e in entries or []:
        if e is None:
            continue
        lp, tok = e[0], e[1]
        out.append((float("nan") if lp is None else float(lp), int(tok)))
    return out


def target_only_trace(prompts: list[Prompt], results: list[dict], provenance: dict) -> Trace:
    """A trace from SGLang target-only generate results (one dict per prompt, in order)."""
    if len(prompts) != len(results):
        raise UsageError(f"{len(results)} SGLang results for {len(prompts)} prompts")
    requests, steps = [], []
    for p, res in zip(prompts, results):
        out = [int(t) for t in res["output_ids"]]
        meta = res.get("meta_info", {})
        chosen = _pairs(meta.get("output_token_logprobs"))
        tops = [_pairs(row) for row in (meta.get("output_top_logprobs") or [])]
        if len(chosen) != len(out) or len(tops) != len(out):
            raise UsageError(f"request {p.id}: {len(out)} output ids but {len(chosen)} token log-probs and "
                             f"{len(tops)} top-k rows (pass return_logprob=True, top_logprobs_num)")
        if any(tok != o for (_, tok), o in zip(chosen, out)):
            raise UsageError(f"request {p.id}: output_token_logprobs token ids differ from output_ids")
        lps = [lp for lp, _ in chosen]
        requests.append(RequestRow(p.id, p.kind, list(p.prompt_ids), out, lps))
        for t in range(1, len(out)):
            top = tops[t][:TOPK]
            argmax = top[0][1] if top else out[t]
            steps.append(StepRow(
                request_id=p.id, step=t - 1, committed_len=len(p.prompt_ids) + t - 1,
                tree_tokens=[out[t - 1]], tree_parents=[-1], tree_depths=[0], tree_ranks=[0],
                draft_topk_ids=[], draft_topk_logprobs=[],
                topk_ids=[[tok for _, tok in top]], topk_logprobs=[[lp for lp, _ in top]], target_argmax=[argmax],
                accepted=[0], accept_length=1, bonus=out[t], emitted=[out[t]], emitted_logprobs=[lps[t]], state=[],
                timings={"draft": 0.0, "tree": 0.0, "verify": math.nan, "commit": math.nan},
            ))
    return Trace(provenance=provenance, requests=requests, steps=steps)


class SGLangRunner:
    name = "sglang"

    def __init__(self, spec: EngineSpec, algorithm: str = "NONE", cuda_graphs: bool = False) -> None:
        if algorithm not in SUPPORTED_ALGORITHMS:
            raise UsageError(f"--sglang-algorithm {algorithm}: per-step capture of speculative algorithms inside "
                             f"SGLang's scheduler is not implemented yet (supported: {', '.join(SUPPORTED_ALGORITHMS)})")
        try:
            import sglang
        except ImportError as exc:
            raise UsageError("the sglang engine needs SGLang installed (on the GPU machine: the offline bundle of "
                             "shared/sglang-gpu, run through .bundle/run_with_bundle.sh)") from exc
        self.sgl, self.spec, self.algorithm, self.cuda_graphs = sglang, spec, algorithm, cuda_graphs

    def trace(self, prompts: list[Prompt]) -> Trace:
        from refcheck.prompts import prompt_set_hash
        from refcheck.provenance import build_provenance

        tdir, _ = self.spec.resolved_dirs()
        kw = engine_kwargs(self.spec, str(tdir), self.algorithm, self.cuda_graphs)
        t0 = time.time()
        engine = self.sgl.Engine(**kw)
        try:
            results = engine.generate(
                input_ids=[list(p.prompt_ids) for p in prompts],
                sampling_params=[{"temperature": 0.0, "max_new_tokens": p.max_new_tokens or self.spec.max_new_tokens,
                                  "stop_token_ids": sorted(self.spec.stop_token_ids)} for p in prompts],
                return_logprob=True, top_logprobs_num=TOPK,
            )
        finally:
            engine.shutdown()
        prov = build_provenance(
            engine="sglang", engine_version=self.sgl.__version__,
            settings={**{k: v for k, v in kw.items() if k != "model_path"}, "pair": self.spec.pair,
                      "stop_token_ids": sorted(self.spec.stop_token_ids), "wall_s": time.time() - t0},
            model_dir=tdir, draft_dir=None, dtype=self.spec.dtype, device="cuda", budget=0, block_size=1,
            max_new_tokens=self.spec.max_new_tokens, drafter="none", prompt_set_sha256=prompt_set_hash(prompts),
            model_label=self.spec.model_label,
        )
        return target_only_trace(prompts, results, prov)
