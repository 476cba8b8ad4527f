"""What to run: the engine spec the commands build from their options.

Contract: :class:`EngineSpec` names a target and draft (directories, or a built-in pair), the dtype
and device, the drafter kind, the budget and token limits. This module imports no torch (the CLI
builds its options and prints ``--help`` from it without loading a model library);
:mod:`refcheck.reference_runner` maps :data:`DTYPE_NAMES` to torch dtypes and runs a spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from refcheck.models import DEFAULT_PAIR, builtin_pair

if TYPE_CHECKING:  # ddtree_reference.sampling imports torch; a spec only carries the value
    from ddtree_reference.sampling import Sampling

#: the dtypes a spec may name (``refcheck.reference_runner.DTYPES`` maps them to torch dtypes)
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: the drafter kinds: DFlash checkpoints, or the scripted test drafter
DRAFTERS: tuple[str, ...] = ("dflash", "scripted")


@dataclass(slots=True)
class EngineSpec:
    model_dir: Path | None = None  # None = the built-in pair's target
    draft_dir: Path | None = None
    pair: str = DEFAULT_PAIR
    dtype: str = "float32"
    device: str = "cpu"
    drafter: str = "dflash"
    budget: int | None = 15  # None = chain mode
    max_new_tokens: int = 64
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    seed: int = 0
    sampling: Sampling | None = None  # None or temperature 0 = greedy

    @property
    def sampled(self) -> bool:
        return self.sampling is not None and not self.sampling.greedy

    @property
    def model_label(self) -> str:
        return f"builtin:{self.pair}" if self.model_dir is None else str(self.model_dir)

    def resolved_dirs(self) -> tuple[Path, Path | None]:
        if self.model_dir is None:
            tdir, ddir = builtin_pair(self.pair)
            return tdir, self.draft_dir or ddir
        return Path(self.model_dir), (Path(self.draft_dir) if self.draft_dir else None)
