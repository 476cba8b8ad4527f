"""One request's findings: what its checks report, written to the trace's report under the request's id.

Contract: :class:`RequestFindings` holds the trace's :class:`~refcheck.diff.findings.Report`, the request's id and
the tolerance's tie margin (what decides a token flip). :meth:`RequestFindings.check` counts checks made,
:meth:`RequestFindings.fail` adds a failure, :meth:`RequestFindings.token_flip` an engine token where the
reference's argmax differs (a benign tie under the margin, else a failure, with the margin and the reference's top
5), :meth:`RequestFindings.track_max` raises a running maximum in the report's stats (a NaN deviation never: its
check reports it). Each finding is added to the report at once, in call order; nothing of a step is held here.
"""

from __future__ import annotations

from typing import Any

import torch

from refcheck.diff.findings import Finding, Report, Verdict


class RequestFindings:
    """The reporting side of one replayed request: its failures, token flips and running maxima."""

    def __init__(self, rep: Report, rid: str, tie_margin: float) -> None:
        self.rep, self.rid, self.tie_margin = rep, rid, tie_margin

    def check(self, category: str, n: int = 1) -> None:
        """Count ``n`` checks made of ``category`` (a check that passes adds no finding)."""
        self.rep.check(category, n)

    def fail(self, category: str, step: int | None, message: str, **kw: Any) -> None:
        """A failure of the request (``kw``: the finding's other fields: node, position, layer, details, ...)."""
        self.rep.add(Finding(Verdict.FAIL, category, self.rid, step, message=message, **kw))

    def track_max(self, key: str, value: float) -> None:
        """Raise the report's running maximum ``key`` to ``value`` (NaN-safe)."""
        if value == value:  # NaN-safe: a NaN deviation is reported by the check itself
            self.rep.stats[key] = max(self.rep.stats.get(key, 0.0), value)

    def token_flip(self, category: str, step: int, node: int | None, logp: torch.Tensor, engine_tok: int,
                   **kw: Any) -> bool:
        """Engine picked ``engine_tok`` where the reference's argmax of ``logp`` [V] differs. True if benign."""
        ref_tok = int(logp.argmax())
        margin = float(logp[ref_tok] - logp[engine_tok])
        top = logp.topk(min(5, logp.shape[-1]))
        details = {"engine_token": engine_tok, "reference_token": ref_tok, "margin": margin,
                   "reference_topk": list(zip(top.indices.tolist(), [round(v, 5) for v in top.values.tolist()]))}
        benign = margin < self.tie_margin
        verdict = Verdict.BENIGN_TIE if benign else Verdict.FAIL
        msg = (f"engine token {engine_tok} vs reference {ref_tok} "
               f"({'near-tie' if benign else 'not a near-tie'}: margin {margin:.4g}, threshold {self.tie_margin:g})")
        self.rep.add(Finding(verdict, category, self.rid, step, node=node, message=msg, details=details, **kw))
        return benign
