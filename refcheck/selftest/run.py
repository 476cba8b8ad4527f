"""The self-test: every known engine bug class, injected into the reference, must be caught.

Contract: :func:`selftest` decodes the built-in prompts on the built-in hybrid pair with the
scripted drafter (deep accepted paths through decoy siblings, the only trees on which several of
these bugs show) with the clean decoder and with each discrete fault of :data:`FAULTS` (or the
named faults, graded ones such as ``rec-scale:0.01`` included), records traces with
state and layer sketches, diffs each against the live reference (replay + free-run) and reports:
detected or not, the first divergence (request, step, node, category, layer) and whether the
expected category is among the failures. The clean decoder must give zero non-pass findings. The
drafter's MASK id is set to a token the target emits, so that dropping mask-id outputs shows.

With ``sampling`` (temperature > 0) it runs the sampling faults of
:data:`~refcheck.selftest.sampling_faults.SAMPLING_FAULTS` by default, sampled with the keyed
generator: each must be caught by the exact replay of its recorded draws (the expected category at
the step where it first acts). Each row also carries the distributional verdict on the same trace
with its randomness hidden (what an engine that exposes nothing would get at this sample size).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree_reference.decode import DDTreeDecoder
from ddtree_reference.sampling import Sampling
from refcheck.diff.findings import Verdict
from refcheck.diff.judge import judge
from refcheck.pool import ReferencePool
from refcheck.progress import Progress, tell
from refcheck.prompts import Prompt, load_prompts
from refcheck.reference_runner import EngineSpec
from refcheck.selftest.faults import FAULTS, fault
from refcheck.selftest.sampling_faults import SAMPLING_FAULTS, hide_randomness


@dataclass(slots=True)
class SelftestRow:
    fault: str
    expected: str
    detected: bool
    category_found: bool
    first: dict | None  # first divergence of the first failing request
    categories: list[str]
    findings: int
    hidden: dict | None = None  # sampled runs: the distributional verdict with the randomness hidden

    @property
    def ok(self) -> bool:
        if self.fault == "clean":
            return self.findings == 0
        return self.detected and self.category_found

    def to_json(self) -> dict:
        return {"fault": self.fault, "expected_category": self.expected, "detected": self.detected,
                "expected_category_found": self.category_found, "ok": self.ok, "first_divergence": self.first,
                "fail_categories": self.categories, "non_pass_findings": self.findings,
                **({"hidden_randomness": self.hidden} if self.hidden is not None else {})}


def selftest(faults: list[str] | None = None, prompts: list[Prompt] | None = None, budget: int = 15,
             max_new_tokens: int = 24, progress: Progress | None = None,
             sampling: Sampling | None = None) -> list[SelftestRow]:
    sampled = sampling is not None and not sampling.greedy
    names = list(SAMPLING_FAULTS if sampled else FAULTS) if faults is None else list(faults)
    chosen = {name: fault(name) for name in names}  # unknown names fail before anything runs
    prompts = prompts or load_prompts()[:3]
    pool = ReferencePool()
    spec = EngineSpec(pair="hybrid", drafter="scripted", budget=budget, max_new_tokens=max_new_tokens,
                      sampling=sampling if sampled else None)
    runner = pool.runner(spec)
    clean_trace, results = runner.trace(prompts, record_layers=True)
    first = results[prompts[0].id].output_ids
    runner.drafter.mask_token_id = first[min(3, len(first) - 1)]
    rows: list[SelftestRow] = []
    for name in ["clean", *names]:
        tell(progress, f"selftest: {name}")
        cls, expected = (DDTreeDecoder, "-") if name == "clean" else chosen[name]
        trace, _ = runner.trace(prompts, cls=cls, engine=name if name == "clean" else f"fault:{name}", record_layers=True)
        report = judge(trace, pool, name, mode="both", strict_acceptance=True)
        fd = report.first_divergence()
        per_request = [f for rid, f in fd.items() if rid is not None]  # before trace-level verdicts (distribution)
        first = (per_request or list(fd.values()))[0].to_json() if fd else None
        failures = report.failures
        step0 = min((f.step for f in failures if f.step is not None), default=None)
        first_step_cats = {f.category for f in failures if f.step == step0} if step0 is not None else set()
        cats = sorted({f.category for f in failures})
        non_pass = sum(1 for f in report.findings if f.verdict != Verdict.PASS)
        found = expected in (first_step_cats or set(cats))  # caught where it first shows
        hidden = None
        if sampled:
            d = judge(hide_randomness(trace), pool, name, mode="replay").stats.get("distribution", {})
            hidden = {k: d.get(k) for k in ("verdict", "p_value", "n_tokens", "n_required", "impossible")}
        rows.append(SelftestRow(name, expected, bool(failures), found, first, cats, non_pass, hidden))
    return rows
