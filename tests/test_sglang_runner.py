"""The SGLang runner's CPU-testable parts: engine arguments and target-only results -> trace.

The conversion is checked end to end with real numbers: SGLang-format results are built from the
reference's own budget-0 decoding, converted, and diffed against the reference (replay + free run).
The live engine runs on the GPU machine only (marker ``sglang``).
"""

from __future__ import annotations

import pytest
import torch

from refcheck.diff.session import DiffSession
from refcheck.errors import UsageError
from refcheck.prompts import load_prompts
from refcheck.runners.reference import EngineSpec, ReferenceRunner
from refcheck.runners.sglang import engine_kwargs, target_only_trace


def test_engine_kwargs_for_clean_diffs():
    kw = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m")
    assert kw["skip_tokenizer_init"] and kw["attention_backend"] == "triton" and kw["disable_radix_cache"]
    assert kw["disable_overlap_schedule"] and kw["disable_cuda_graph"] and kw["page_size"] == 1
    assert "speculative_algorithm" not in kw
    assert engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "DFLASH", cuda_graphs=True)["disable_cuda_graph"] is False
    with pytest.raises(UsageError):
        engine_kwargs(EngineSpec(dtype="int8"), "/m")


def _sglang_like_results(runner: ReferenceRunner, prompts, max_new: int, k: int = 5, corrupt: bool = False):
    """What sglang.Engine.generate returns (ids, meta_info), produced by the reference at budget 0."""
    results = []
    for p in prompts:
        res = runner.decoder(max_new).generate(list(p.prompt_ids))
        _, fwd = runner.target.prefill(torch.tensor(p.prompt_ids))
        first = torch.log_softmax(fwd.logits[-1], -1).topk(k)
        tops = [list(zip(first.values.tolist(), first.indices.tolist(), [None] * k))]
        tops += [list(zip(s.topk_logprobs[0].tolist(), s.topk_ids[0].tolist(), [None] * k)) for s in res.steps]
        chosen = [(lp, t, None) for lp, t in zip(res.output_logprobs, res.output_ids)]
        if corrupt:  # an engine whose logits are off by 0.5 at one position
            lp, t, _ = chosen[3]
            chosen[3] = (lp + 0.5, t, None)
            tops[3] = [(v + 0.5, i, None) for v, i, _ in tops[3]]
        results.append({"output_ids": res.output_ids, "meta_info": {"output_token_logprobs": chosen,
                                                                    "output_top_logprobs": tops}})
    return results


@pytest.fixture(scope="module")
def setup():
    spec = EngineSpec(pair="hybrid", budget=0, drafter="scripted", max_new_tokens=10)
    runner = ReferenceRunner(spec)
    prompts = load_prompts()[:3]
    prov = runner.provenance(prompts, engine="sglang")
    prov["drafter"] = "none"
    return runner, prompts, prov


def test_target_only_trace_diffs_clean(setup):
    runner, prompts, prov = setup
    trace = target_only_trace(prompts, _sglang_like_results(runner, prompts, 10), prov)
    assert len(trace.steps) == 3 * 9 and all(s.accept_length == 1 for s in trace.steps)
    rep = DiffSession().diff(trace, "sglang-none", mode="both", strict_acceptance=True)
    assert rep.failures == []
    assert rep.checks["logits"] == 27 and rep.checks["ar_tokens"] == 3
    assert {f.category for f in rep.findings} <= {"draft", "kv", "conv", "recurrent"}  # unsupported, counted


def test_target_only_trace_catches_wrong_logprobs(setup):
    runner, prompts, prov = setup
    trace = target_only_trace(prompts, _sglang_like_results(runner, prompts, 10, corrupt=True), prov)
    rep = DiffSession().diff(trace, "sglang-bad", mode="replay")
    first = rep.first_divergence()
    assert first and all(f.step == 2 and f.category == "logits" for f in first.values())


def test_target_only_trace_rejects_inconsistent_results(setup):
    runner, prompts, prov = setup
    results = _sglang_like_results(runner, prompts[:1], 6)
    results[0]["meta_info"]["output_top_logprobs"] = results[0]["meta_info"]["output_top_logprobs"][:-1]
    with pytest.raises(UsageError, match="top-k rows"):
        target_only_trace(prompts[:1], results, prov)


def test_speculative_algorithms_are_refused_clearly(cli):
    code, _, err = cli("diff", "--engine", "sglang:DFLASH", "--budget", "15")
    assert code == 2 and ("not implemented yet" in err or "needs SGLang installed" in err)
