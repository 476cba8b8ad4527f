"""The calibrated verdict's parameters, keyed by the engine's (dtype, device type).

Contract: :func:`calibration_for` returns the :class:`Calibration` a trace recorded in (dtype,
device) is judged by, falling back from ("bfloat16", "cuda") to ("bfloat16", "*"). A pair with no
measured calibration raises :class:`NoCalibration` naming the command that measures one (never a
silent fallback to some other dtype's bounds). A calibration has two parts:

* ``tolerance`` — the cheap fixed bounds. Tokens are always compared exactly; log-probs by absolute
  difference; tensors (KV, conv, recurrent state, layer outputs) by relative L2 *and* cosine; an
  argmax flip is benign only when the reference's log-prob margin between its top-1 and the
  engine's token is under ``tie_margin``. A quantity within its bound passes at once (a clean diff
  stays fast).
* ``rule`` — for engine dtypes coarser than the reference (bf16, fp16): a quantity over its bound is
  judged against what a *correct* engine in that dtype can produce at that node, measured by the
  rounding ensemble (:mod:`refcheck.diff.triage`); ``None`` for fp32, whose bounds are measured
  directly (CPU: reference vs transformers <= 1e-5 relative; the two exact Gated DeltaNet tree
  methods differ in node log-probs by up to 1.2e-4 on the budget-64 goldens; CUDA fp32 1e-5 relative
  on the H200).

bf16's bounds come from the three-way calibration on the H200 (the bf16 reference diffed by the fp32
reference on the built-in hybrid pair: max tensor rel L2 0.19 (KV), 0.14 (recurrent), 0.13 (conv);
node log-prob deviation up to 1.16; argmax flips at margins up to 0.52) and from the corpus that
``refcheck calibrate`` runs (docs/calibration.md has the argument and docs/results/calibration/ the
table). :data:`CANDIDATES` holds bounds under measurement: only ``refcheck calibrate`` uses them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from refcheck.diff.triage import Rule
from refcheck.errors import UsageError


class NoCalibration(UsageError):
    """No measured calibration covers this (dtype, device)."""


@dataclass(frozen=True, slots=True)
class Tolerance:
    logprob_abs: float  # node top-k and emitted log-probs, absolute
    draft_logprob_abs: float  # drafter top-k log-probs, absolute
    tensor_rel_l2: float  # KV / conv / recurrent / layer outputs: ||a-b|| / ||b||
    tensor_min_cos: float  # ... and cosine similarity at least this
    tie_margin: float  # reference log-prob margin under which an argmax flip is a benign near-tie


@dataclass(frozen=True, slots=True)
class Calibration:
    tolerance: Tolerance
    rule: Rule | None  # the rounding-ensemble judgement over the bounds (None: the bounds are final)
    source: str  # what measured it

    def to_json(self) -> dict[str, Any]:
        return {"tolerance": asdict(self.tolerance), "rule": self.rule.to_json() if self.rule else None,
                "source": self.source}


CALIBRATIONS: dict[tuple[str, str], Calibration] = {
    ("float32", "cpu"): Calibration(Tolerance(5e-4, 5e-4, 1e-4, 0.99999, 1e-4), None,
                                    "reference vs transformers and the two exact GDN tree methods, CPU"),
    ("float32", "cuda"): Calibration(Tolerance(5e-4, 5e-4, 5e-4, 0.9999, 1e-3), None,
                                     "reference fp32 on the H200 vs CPU"),
    # min cosine 0.965 ~ 1 - 0.25**2 / 2: consistent with the rel-L2 bound. Factor 3: over the H200 corpus's
    # clean runs (docs/results/calibration.md) the largest deviation / spread of a correct engine was 2.34
    # (p50 0.37, p99 2.34 over 158 judged deviations); with the factor 2 of the linear-output-only model 8 of
    # 30 clean runs had failed.
    ("bfloat16", "*"): Calibration(Tolerance(1.5, 0.4, 0.25, 0.965, 0.7), Rule(samples=8, factor=3.0, anchor_steps=1, escalate=32),
                                   "three-way bf16 calibration and the refcheck calibrate corpus, H200"),
    # fp16: bf16's bounds scaled by the 8x smaller unit roundoff; the H200 corpus's 10 clean fp16 runs (both
    # pairs, budgets 8-64 and chain) pass with 0 false alarms. Faults were run in bf16 only.
    ("float16", "*"): Calibration(Tolerance(0.4, 0.2, 0.05, 0.998, 0.2), Rule(samples=8, factor=3.0, anchor_steps=1, escalate=32),
                                  "refcheck calibrate corpus, H200: 10 clean fp16 runs"),
}

#: bounds under measurement, used only by ``refcheck calibrate`` (never by a verdict)
CANDIDATES: dict[tuple[str, str], Calibration] = {}


def _lookup(table: dict[tuple[str, str], Calibration], dtype: str, device: str) -> Calibration | None:
    kind = device.split(":")[0]
    return next((table[k] for k in ((dtype, kind), (dtype, "*")) if k in table), None)


def calibration_for(dtype: str, device: str, candidates: bool = False) -> Calibration:
    """The calibration for engines recorded in ``dtype`` on ``device`` (``candidates``: also bounds
    under measurement, for ``refcheck calibrate``)."""
    found = _lookup(CALIBRATIONS, dtype, device) or (_lookup(CANDIDATES, dtype, device) if candidates else None)
    if found is None:
        raise NoCalibration(
            f"no calibration for engines in {dtype} on {device.split(':')[0]} (calibrated: "
            f"{', '.join(f'{d}/{k}' for d, k in sorted(CALIBRATIONS))}); measure one on that device with "
            f"`refcheck calibrate --dtype {dtype} --device {device.split(':')[0]} --out DIR` and add it to "
            f"refcheck/diff/tolerance.py (docs/calibration.md)")
    return found


def tolerance_for(dtype: str, device: str) -> Tolerance:
    return calibration_for(dtype, device).tolerance


def engine_numerics(provenance: dict[str, Any]) -> tuple[str, str]:
    """(dtype, device) an engine trace was recorded in (fp32 on CPU where the provenance is silent)."""
    from refcheck.provenance import Provenance

    prov = Provenance.of(provenance)
    return prov.dtype, prov.device


def tolerance_of(provenance: dict[str, Any]) -> Tolerance:
    """The cheap bounds an engine trace is judged by: its own recording numerics'."""
    return tolerance_for(*engine_numerics(provenance))
