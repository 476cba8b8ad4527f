"""Provenance of a trace: what produced it, on what, with which settings.

Contract: :func:`build_provenance` returns a JSON-able dict stored in every trace. Content hashes
(sha256 over each checkpoint directory's files, name + bytes) identify models independently of
their paths; :func:`stale_reasons` lists the differences between a stored trace's provenance and
the current setup that make a golden stale (model, draft, tokenizer, budget, block size, prompt
set, dtype).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import platform
from pathlib import Path

import refcheck
from refcheck.budget import budget_json

#: provenance keys whose change makes a golden trace stale
STALE_KEYS = ("model_sha256", "draft_sha256", "tokenizer_sha256", "budget", "block_size",
              "prompt_set_sha256", "dtype", "drafter", "max_new_tokens")


def dir_sha256(path: Path | None) -> str | None:
    """sha256 over a directory's regular files (sorted relative names and contents)."""
    if path is None or not Path(path).is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        h.update(file_sha256(f).digest())
    return h.hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 20) -> "hashlib._Hash":
    """sha256 of one file read in 1 MiB chunks (a 54 GB checkpoint shard never sits in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h


def library_versions() -> dict[str, str]:
    import pyarrow
    import torch
    import transformers

    return {
        "refcheck": refcheck.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }


def build_provenance(
    *,
    engine: str,
    engine_version: str,
    settings: dict,
    model_dir: Path,
    draft_dir: Path | None,
    dtype: str,
    device: str,
    budget: int | None,
    block_size: int,
    max_new_tokens: int,
    drafter: str,
    prompt_set_sha256: str,
    model_label: str | None = None,
) -> dict:
    tok = Path(model_dir) / "tokenizer.json"
    return {
        "engine": {"name": engine, "version": engine_version, "settings": settings},
        "model": model_label or str(model_dir),  # "builtin:<pair>" for the built-in models
        "model_sha256": dir_sha256(Path(model_dir)),
        "draft_sha256": dir_sha256(Path(draft_dir)) if draft_dir else None,
        "tokenizer_sha256": file_sha256(tok).hexdigest() if tok.is_file() else None,
        "dtype": dtype,
        "device": device,
        "budget": budget_json(budget),
        "block_size": block_size,
        "max_new_tokens": max_new_tokens,
        "drafter": drafter,
        "prompt_set_sha256": prompt_set_sha256,
        "versions": library_versions(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _short(v: object) -> str:
    """Hashes shortened to 12 hex digits for humans; everything else as repr."""
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12] + "…"
    return repr(v)


def stale_reasons(stored: dict, current: dict) -> list[str]:
    return [
        f"{k}: {_short(stored.get(k))} → {_short(current.get(k))}"
        for k in STALE_KEYS
        if stored.get(k) != current.get(k)
    ]
