"""Which verify steps a sampled capture records: one step in ``every`` per request, at a seeded phase.

Contract: :class:`SampleRule` (``every`` >= 1, ``seed`` >= 0) takes step ``k`` of request ``rid`` (its k-th
decode or verify step, counted from 0 in the scheduler process) when ``(k + phase(rid)) % every == 0``, where
``phase(rid)`` = the first 8 bytes of BLAKE2b of ``f"{seed}:{rid}"``, little-endian, modulo ``every``: each request is recorded once every ``every`` steps, and the
phases spread the recorded steps of a batch's requests over different batches, so no batch carries all of
them. ``every == 1`` records every step (full capture). The rule travels to SGLang's scheduler processes as
``REFCHECK_CAPTURE_SAMPLE=every:seed`` and is written into the trace's capture provenance, so the diff and a
reader know which steps exist by design. :func:`parse` refuses anything else with :class:`CaptureSampleError`.
A request whose rid starts with ``refcheck-sample-N-SEED-`` (:func:`sampled_rid`) follows that rule instead of
the process's (:func:`rule_for`): refcheck's runner uses it to time a sampled pass on the same warm engine as
the full and the untraced ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

ENV_SAMPLE = "REFCHECK_CAPTURE_SAMPLE"
SAMPLED_RID_PREFIX = "refcheck-sample-"
MAX_EVERY = 1_000_000


class CaptureSampleError(ValueError):
    """A capture sampling rule outside its range."""


@lru_cache(maxsize=65536)
def _phase(seed: int, rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{rid}".encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class SampleRule:
    every: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.every <= MAX_EVERY:
            raise CaptureSampleError(f"capture sampling takes 1 step in N for N in 1..{MAX_EVERY}, got {self.every}")
        if self.seed < 0:
            raise CaptureSampleError(f"capture sampling seed must be >= 0, got {self.seed}")

    @property
    def full(self) -> bool:
        return self.every == 1

    def phase(self, rid: str) -> int:
        return _phase(self.seed, rid) % self.every

    def takes(self, rid: str, step: int) -> bool:
        return (step + self.phase(rid)) % self.every == 0

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
    """The rule a request's steps are recorded by: its rid's mark (:func:`sampled_rid`), else ``default``."""
    if not rid.startswith(SAMPLED_RID_PREFIX):
        return default
    parts = rid[len(SAMPLED_RID_PREFIX):].split("-", 2)
    if len(parts) < 3:
        return default
    every, seed = parts[0], parts[1]
    try:
        return SampleRule(int(every), int(seed))
    except (ValueError, CaptureSampleError):
        return default
