"""The built-in golden cases and where the repository keeps their traces.

Contract: :data:`GOLDEN_CASES` maps each built-in reference case's name to its :class:`GoldenCase`: both
built-in pairs at budgets 1, 15, 64 and chain (fp32, CPU), plus the scripted drafter on the hybrid pair.
These are the cases ``refcheck golden regen`` re-runs; any other case in a golden directory holds an
engine's trace (``refcheck golden add``). :data:`REPO_GOLDEN` is the repository's ``golden/`` directory;
:func:`default_golden_dir` is it when present, else ``golden/`` under the working directory. Nothing
here loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refcheck.budget import budget_tag
from refcheck.spec import EngineSpec

REPO_GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def default_golden_dir() -> Path:
    return REPO_GOLDEN if REPO_GOLDEN.is_dir() else Path.cwd() / "golden"


@dataclass(frozen=True, slots=True)
class GoldenCase:
    name: str
    pair: str
    budget: int | None  # None = chain mode
    drafter: str = "dflash"
    max_new_tokens: int = 32

    def spec(self) -> EngineSpec:
        return EngineSpec(pair=self.pair, budget=self.budget, drafter=self.drafter, max_new_tokens=self.max_new_tokens)


#: the reference goldens: both built-in pairs at budgets 1, 15, 64 and chain (fp32, CPU), plus the
#: scripted drafter on the hybrid pair so the gate also covers deep accepted paths through siblings
GOLDEN_CASES: dict[str, GoldenCase] = {
    c.name: c
    for c in [GoldenCase(f"{pair}-{budget_tag(b)}", pair, b) for pair in ("hybrid", "attention") for b in (1, 15, 64, None)]
    + [GoldenCase("hybrid-b15-scripted", "hybrid", 15, drafter="scripted")]
}
