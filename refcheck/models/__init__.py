"""The built-in model pairs (target + DFlash drafter) shipped with refcheck.

Contract: ``builtin_pair(name)`` returns the local directories of a built-in target and its
drafter. ``hybrid`` is a tiny Qwen3.5-architecture target (Gated DeltaNet + full attention,
``model_type: qwen3_5_text``); ``attention`` is a tiny pure-attention Qwen3 target. Both are built
deterministically from a seed by ``scripts/build_builtin_models.py`` (see :mod:`.build`) and
stored in the repository, so nothing is downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
BUILTIN_PAIRS = ("hybrid", "attention")
DEFAULT_PAIR = "hybrid"


def builtin_pair(name: str = DEFAULT_PAIR) -> tuple[Path, Path]:
    if name not in BUILTIN_PAIRS:
        raise KeyError(f"unknown built-in model pair {name!r} (have: {', '.join(BUILTIN_PAIRS)})")
    return MODELS_DIR / name / "target", MODELS_DIR / name / "draft"
