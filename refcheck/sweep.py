"""Budget sweeps: acceptance and speed of the reference DDTree decoder against node budget.

Contract: :func:`run_sweep` decodes a prompt set at every budget (``None`` = chain mode), ``repeats``
times, and target-only (autoregressive) in the same run as the speed baseline. Per budget it reports
mean τ (bonus counted) with its spread over requests, the acceptance histogram (fraction of verify
steps per τ = 1..block size, the DDTree paper's axes), draft / tree / verify / commit time per step
(median over steps, then median and min–max over repeats), tokens per second and the speedup over
target-only decoding. Every output is checked against the target-only output (lossless; at
temperature > 0 target-only sampling with the same keys, token for token). τ does not
change between repeats (greedy, deterministic); the repeats measure timing spread.
:func:`plot_sweep` writes the PNGs (matplotlib, an optional dependency).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ddtree_reference.decode import autoregressive_decode
from ddtree_reference.sampling import request_key
from refcheck.budget import budget_label, parse_budget
from refcheck.errors import UsageError
from refcheck.progress import Progress, tell
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec, ReferenceRunner

PHASES = ("draft", "tree", "verify", "commit")


def parse_budgets(text: str) -> list[int | None]:
    """``--budgets``: comma-separated budgets (:func:`refcheck.budget.parse_budget` each)."""
    if not text.strip():
        raise UsageError("--budgets is empty")
    return [parse_budget(part, f"--budgets {text!r}") for part in text.split(",")]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def span(values: list[float]) -> dict:
    """Median and min–max ({} for no values)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _autoregressive_pass(runner: ReferenceRunner, spec: EngineSpec, prompts: list[Prompt],
                         ar_out: dict[str, list[int]]) -> float:
    """Target-only decoding of every prompt (its outputs into ``ar_out``): tokens per second."""
    dev = runner.target.device
    _sync(dev)
    t0, n = time.perf_counter(), 0
    for p in prompts:
        out = autoregressive_decode(runner.target, list(p.prompt_ids), p.max_new_tokens or spec.max_new_tokens,
                                    spec.stop_token_ids, spec.sampling if spec.sampled else None,
                                    request_key(p.id))
        ar_out[p.id] = out
        n += len(out)
    _sync(dev)
    return n / (time.perf_counter() - t0)


def _budget_pass(runner: ReferenceRunner, spec: EngineSpec, prompts: list[Prompt], b: int | None,
                 ar_out: dict[str, list[int]], timing: dict) -> dict:
    """One budget's DDTree decode of every prompt: its row (τ, histogram, lossless); its tokens per
    second and per-phase median step times are appended to ``timing`` (``{"tps": [], "phase": {}}``)."""
    dev = runner.target.device
    runner.spec.budget = b
    taus_by_req: list[list[int]] = []
    phase_steps: dict[str, list[float]] = {ph: [] for ph in PHASES}
    lossless = True
    _sync(dev)
    t0, n = time.perf_counter(), 0
    for p in prompts:
        res = runner.generate(runner.decoder(p.max_new_tokens or spec.max_new_tokens), p)
        n += len(res.output_ids)
        taus_by_req.append(res.accept_lengths)
        lossless &= res.output_ids == ar_out[p.id]
        for s in res.steps:
            for ph in PHASES:
                phase_steps[ph].append(s.timings[ph])
    _sync(dev)
    timing["tps"].append(n / (time.perf_counter() - t0))
    for ph in PHASES:
        timing["phase"][ph].append(statistics.median(phase_steps[ph]) if phase_steps[ph] else 0.0)
    taus = [t for r in taus_by_req for t in r]
    bs = runner.drafter.block_size
    req_means = [statistics.fmean(r) for r in taus_by_req if r]
    return {
        "budget": budget_label(b),
        "mean_tau": statistics.fmean(taus) if taus else None,
        "tau_spread_over_requests": {"min": min(req_means), "max": max(req_means),
                                     "stdev": statistics.pstdev(req_means)} if req_means else None,
        "steps": len(taus),
        "histogram": [taus.count(t) / len(taus) for t in range(1, bs + 1)] if taus else [],
        "lossless": lossless,
    }


def run_sweep(spec: EngineSpec, prompts: list[Prompt], budgets: list[int | None], repeats: int = 1,
              progress: Progress | None = None) -> dict:
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {repeats}")
    runner = ReferenceRunner(spec)
    ar_tps: list[float] = []
    ar_out: dict[str, list[int]] = {}
    rows: dict[str, dict] = {}
    per_budget: dict[str, dict] = {budget_label(b): {"tps": [], "phase": {p: [] for p in PHASES}}
                                   for b in budgets}
    for rep in range(repeats):
        ar_tps.append(_autoregressive_pass(runner, spec, prompts, ar_out))
        for b in budgets:
            key = budget_label(b)
            tell(progress, f"repeat {rep} budget {key}")
            rows[key] = _budget_pass(runner, spec, prompts, b, ar_out, per_budget[key])
    ar_med = statistics.median(ar_tps)
    for key, row in rows.items():
        pb = per_budget[key]
        row["tokens_per_s"] = span(pb["tps"])
        row["speedup_vs_autoregressive"] = statistics.median(pb["tps"]) / ar_med
        row["ms_per_step"] = {ph: {k: 1e3 * v for k, v in span(pb["phase"][ph]).items()} for ph in PHASES}
    return {
        "engine": "reference",
        "model": spec.model_label,
        "dtype": spec.dtype,
        "device": spec.device,
        "drafter": spec.drafter,
        **({"sampling": spec.sampling.to_json()} if spec.sampled else {}),
        "repeats": repeats,
        "prompts": len(prompts),
        "max_new_tokens": spec.max_new_tokens,
        "autoregressive_tokens_per_s": span(ar_tps),
        "tau_convention": "accepted drafted tokens + 1 (bonus counted)",
        "budgets": list(rows.values()),
    }


def plot_sweep(result: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UsageError("plotting backend missing: pip install matplotlib (or pass --no-plots)") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result["budgets"]
    labels = [r["budget"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(x, [r["mean_tau"] for r in rows], "o-")
    ax[0].set_xticks(list(x), labels)
    ax[0].set_xlabel("node budget")
    ax[0].set_ylabel("mean acceptance length τ (bonus counted)")
    ax[0].grid(alpha=0.3)
    ax[1].plot(x, [r["tokens_per_s"]["median"] for r in rows], "o-", label="DDTree")
    ax[1].axhline(result["autoregressive_tokens_per_s"]["median"], color="gray", ls="--", label="target only")
    ax[1].set_xticks(list(x), labels)
    ax[1].set_xlabel("node budget")
    ax[1].set_ylabel("tokens / s")
    ax[1].legend()
    ax[1].grid(alpha=0.3)
    fig.suptitle(f"{result['model']} · {result['dtype']} · {result['device']} · {result['drafter']} drafter")
    fig.tight_layout()
    p1 = out_dir / "sweep_tau_speed.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    bs = len(rows[0]["histogram"])
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([t + 1 + (i - len(rows) / 2) * width for t in range(bs)], [100 * f for f in r["histogram"]],
               width=width, label=f"B={r['budget']}")
    ax.set_xlabel("acceptance length τ")
    ax.set_ylabel("% of verify steps")
    ax.set_xticks(range(1, bs + 1))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    p2 = out_dir / "sweep_acceptance_histogram.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
