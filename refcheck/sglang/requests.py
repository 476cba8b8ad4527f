"""What a request asks of SGLang at a temperature: its sampling params, how its draws are made, and the refusals.

Contract: :func:`request_sampling_params` is one request's SGLang sampling params (greedy, or refcheck's temperature,
top-k and top-p, with the keyed sampler's seed and request word for REFCHECK_DDTREE and its twins);
:func:`sampling_rng` and :func:`draft_rule` name, for the trace's provenance, how an algorithm's uniforms are made
and how it turns drafts into the tree it verifies; :func:`required_hooks` and :func:`missing_hooks` say which capture
hooks its run records through and which a scheduler's status says are not live; :func:`check_sampling` refuses, before any engine starts, a
sampled run or an injected sampler / drafter fault that the algorithm cannot take (:class:`~refcheck.errors.UsageError`).
"""

from __future__ import annotations

from typing import Any

from ddtree_reference.sampling import Sampling, request_key
from refcheck.errors import UsageError
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.capture import dflash_taps, sampler_faults
from refcheck.sglang.pair import DFLASH_DRAFTED, SHADOW


def sampling_rng(algorithm: str) -> str:
    """How an algorithm's uniforms are made and used at T > 0 (a trace's ``rng``): REFCHECK_DDTREE's are refcheck's
    keyed Philox; NGRAM's tree sampler takes SGLang's coins children first (the capture records them); NONE's
    sampler exposes nothing."""
    if algorithm in DFLASH_DRAFTED and algorithm != "DFLASH":
        return "refcheck-philox-position"
    return "engine-children-first" if algorithm == "NGRAM" else "engine"


def draft_rule(algorithm: str) -> str:
    """How an algorithm turns drafts into the tree it verifies (:attr:`refcheck.provenance.Provenance.draft_rule`)."""
    if algorithm == "NONE":
        return "none"
    if algorithm in ("DFLASH", SHADOW):  # the shadow worker verifies the chain; its tree is recorded beside it
        return "chain"
    return "ddtree" if algorithm in DFLASH_DRAFTED else "other"


def required_hooks(algorithm: str, sampled: bool) -> set[str]:
    """The capture hooks a run of ``algorithm`` records through (``sampled``: at temperature > 0), which every
    scheduler's status must say are live."""
    need = {"run_batch"} | ({"dflash"} if algorithm == "DFLASH" else {"eagle_sample"} if algorithm != "NONE" else set())
    if sampled:
        need.add("sample")
        if keyed(algorithm):
            need.add("ddtree_sample")
        elif algorithm == "NGRAM":
            need.add("verify_coins")
    return need


def missing_hooks(status: list[dict[str, Any]], need: set[str]) -> list[str]:
    """One line per scheduler whose status says a needed hook is not live; one line when no scheduler wrote a status."""
    if not status:
        return ["no scheduler process wrote a capture status: none loaded refcheck's SGLang plugin (entry point group "
                "sglang.srt.plugins), or none could record in the capture directory ('refcheck capture:' in the "
                "engine's log says why)"]
    return [f"scheduler rank {st.get('tp_rank')}: hook {name} not live ({st.get('hooks', {}).get(name)})"
            for st in status for name in sorted(need) if st.get("hooks", {}).get(name) is not True]


def keyed(algorithm: str) -> bool:
    """Whether the algorithm samples with refcheck's keyed generator (seed and request word sent to SGLang)."""
    return sampling_rng(algorithm).startswith("refcheck-philox")


def check_sampling(algorithm: str, sampling: Sampling | None) -> None:
    """Refusals for a sampled SGLang run (before any engine starts)."""
    try:
        fault = sampler_faults.active()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        dfault = dflash_taps.active()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if dfault is not None and algorithm != "DFLASH":
        raise UsageError(f"{dflash_taps.ENV_FAULT}={dfault} acts on SGLang's DFLASH drafter: --engine sglang:DFLASH "
                         f"only (REFCHECK_DDTREE's drafter faults are algorithms: REFCHECK_DDTREE_FAULT_DRAFT_*)")
    if fault is not None and (algorithm != "NGRAM" or sampling is None or sampling.greedy):
        raise UsageError(f"{sampler_faults.ENV_FAULT}={fault} acts on SGLang's tree sampler: NGRAM at --temperature > 0 "
                         f"only (this run: {algorithm}, temperature {0 if sampling is None else sampling.temperature})")
    if sampling is None or sampling.greedy:
        return
    if algorithm == "DFLASH":
        raise UsageError("SGLang's DFLASH cannot sample under refcheck (--temperature > 0): it falls back to greedy "
                         "verification where its sampling kernel is missing, and exposes no draws; sample with "
                         "REFCHECK_DDTREE (exact replay) or NGRAM / NONE (distributional test)")
    if keyed(algorithm) and sampling.keying != "position":
        raise UsageError(f"{algorithm} keys its draws by position only (refcheck's keying 'position'), "
                         f"not {sampling.keying!r}")


def request_sampling_params(prompt: Prompt, spec: EngineSpec, algorithm: str) -> dict[str, Any]:
    """One request's SGLang sampling params: greedy, or refcheck's temperature / top-k / top-p (and, for the
    keyed sampler, its seed and request word)."""
    # ignore_eos: refcheck stops only at the explicit --stop ids, exactly like the reference
    out: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": prompt.max_new_tokens or spec.max_new_tokens,
                           "stop_token_ids": sorted(spec.stop_token_ids), "ignore_eos": True}
    s = spec.sampling
    if s is None or s.greedy:
        return out
    out.update(temperature=float(s.temperature), top_p=float(s.top_p), top_k=int(s.top_k) if s.top_k > 0 else -1)
    if keyed(algorithm):
        from refcheck.sglang.ddtree.sampling import REQUEST_KEY, SEED_KEY

        out["custom_params"] = {SEED_KEY: int(s.seed), REQUEST_KEY: request_key(prompt.id)}
    return out
