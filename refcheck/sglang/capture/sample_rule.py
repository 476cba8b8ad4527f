"""Which steps a sampled capture records: one decode batch and one prefill batch in ``every``, at a seeded phase.

Contract: :class:`SampleRule` (``every`` >= 1, ``seed`` >= 0) takes a scheduler process's ``g``-th decode
batch (counted from 0 over the batches that hold a traced request), and its ``g``-th prefill batch (counted
apart), when ``(g + phase) % every == 0``, where
``phase`` = the first 8 bytes of BLAKE2b of ``f"{seed}:batch"``, little-endian, modulo ``every``; every request
of a taken batch is recorded at that step (its step number, the request's k-th decode or verify step in the
process, kept), so each request is recorded at about one step in ``every`` and a batch not taken runs as if no
capture were loaded: the capture's cost per recorded batch is paid once per ``every`` batches. ``every == 1``
records every step (full capture). The rule travels to SGLang's scheduler processes as
``REFCHECK_CAPTURE_SAMPLE=every:seed`` and is written into the trace's capture provenance, so the diff and a
reader know that steps are missing by design (which ones the trace's step numbers say). :func:`parse` refuses
anything else with :class:`CaptureSampleError`. A request whose rid starts with ``refcheck-sample-N-SEED-``
(:func:`sampled_rid`) follows that rule instead of the process's (:func:`rule_for`): refcheck's runner uses it
to time a sampled pass on the same warm engine as the full and the untraced ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property, lru_cache

ENV_SAMPLE = "REFCHECK_CAPTURE_SAMPLE"
SAMPLED_RID_PREFIX = "refcheck-sample-"
MAX_EVERY = 1_000_000


class CaptureSampleError(ValueError):
    """A capture sampling rule outside its range."""


@lru_cache(maxsize=4096)
def _phase(seed: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:batch".encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class SampleRule:
    every: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.every <= MAX_EVERY:
            raise CaptureSampleError(f"capture sampling takes 1 batch in N for N in 1..{MAX_EVERY}, got {self.every}")
        if self.seed < 0:
            raise CaptureSampleError(f"capture sampling seed must be >= 0, got {self.seed}")

    @property
    def full(self) -> bool:
        return self.every == 1

    @cached_property
    def phase(self) -> int:
        return _phase(self.seed) % self.every

    def takes(self, batch: int) -> bool:
        """Whether the process's ``batch``-th decode batch (holding traced requests) is recorded."""
        return (batch + self.phase) % self.every == 0

    def to_env(self) -> str:
        return f"{self.every}:{self.seed}"

    def to_json(self) -> dict[str, int]:
        return {"every": self.every, "seed": self.seed}


def parse(text: str | None) -> SampleRule:
    """``"every"`` or ``"every:seed"`` (None or empty: full capture)."""
    if not text:
        return SampleRule()
    head, _, seed = str(text).partition(":")
    try:
        every, seed_v = int(head), int(seed) if seed else 0
    except ValueError:
        raise CaptureSampleError(f"capture sampling is 'N' or 'N:SEED' with integers, got {text!r}") from None
    return SampleRule(every, seed_v)


def sampled_rid(rule: SampleRule, rid: str) -> str:
    """``rid`` marked to be recorded by ``rule`` whatever the process's rule is."""
    return f"{SAMPLED_RID_PREFIX}{rule.every}-{rule.seed}-{rid}"


def rule_for(rid: str, default: SampleRule) -> SampleRule:
    """The rule a request's steps are recorded by: its rid's mark (:func:`sampled_rid`), else ``default`` (a mark's
    rule is made once per distinct mark, not per request: the hooks ask at every request's first batch)."""
    if not rid.startswith(SAMPLED_RID_PREFIX):
        return default
    parts = rid[len(SAMPLED_RID_PREFIX):].split("-", 2)
    if len(parts) < 3:
        return default
    return _marked_rule(parts[0], parts[1], default)


@lru_cache(maxsize=1024)
def _marked_rule(every: str, seed: str, default: SampleRule) -> SampleRule:
    try:
        return SampleRule(int(every), int(seed))
    except (ValueError, CaptureSampleError):
        return default
