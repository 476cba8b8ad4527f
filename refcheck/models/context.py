"""A copy of a model pair whose declared context holds longer prompts (same weights).

Contract: :func:`extend_context` copies a target and its draft into ``out_dir`` with
``max_position_embeddings`` raised to ``positions`` in both configs (and the original directory and
context recorded under ``refcheck_context``), weights byte-identical. The built-in pairs declare
2 048 positions; their rotary embeddings have no scaling, so positions beyond that are the same
function of the same weights: what a long prompt exercises is the engine's chunked prefill and the
state it carries, which is what the long-prompt settings check. The copy is a different model to
refcheck (its config differs, so its model hash does): traces of it are never golden-comparable with
the built-in pair's. Refuses to shrink a context (UsageError, exit 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from refcheck.errors import UsageError


def _copy(src: Path, dst: Path, positions: int) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copyfile(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)  # a multimodal checkpoint nests the language model's config
    old = int(text.get("max_position_embeddings") or 0)
    if positions < old:
        raise UsageError(f"{src} already holds {old} positions; extend_context does not shrink a context to {positions}")
    text["max_position_embeddings"] = positions
    cfg["refcheck_context"] = {"from": str(src), "max_position_embeddings": old}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def extend_context(target_dir: Path, draft_dir: Path | None, out_dir: Path, positions: int) -> tuple[Path, Path | None]:
    """``out_dir/target`` (and ``out_dir/draft``) with a context of ``positions``; returns their paths."""
    out = Path(out_dir)
    _copy(Path(target_dir), out / "target", positions)
    if draft_dir is None:
        return out / "target", None
    _copy(Path(draft_dir), out / "draft", positions)
    return out / "target", out / "draft"
