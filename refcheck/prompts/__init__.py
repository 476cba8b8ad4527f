"""Prompt sets: the built-in one and user files (JSONL).

Contract: a prompts file is JSONL, one object per line: ``{"id": str, "prompt_ids": [int, ...]}``
with optional ``"kind"`` (e.g. code / arithmetic / prose) and ``"max_new_tokens"``. Blank lines
are skipped. Anything else raises :class:`PromptsFileError` naming the line. The prompt-set hash
(sha256 of the canonical JSON of all prompts) identifies a set in trace provenance.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from refcheck.errors import PromptsFileError

BUILTIN_PROMPTS = Path(__file__).resolve().parent / "builtin.jsonl"


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    prompt_ids: tuple[int, ...]
    kind: str = "unspecified"
    max_new_tokens: int | None = None


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    path = Path(path) if path is not None else BUILTIN_PROMPTS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError as exc:
        raise PromptsFileError(f"prompts file not found: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptsFileError(f"cannot read prompts file {path}: {exc}") from exc
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptsFileError(f"{path}:{n}: not JSON: {exc.msg}") from exc
        if not isinstance(obj, dict):
            raise PromptsFileError(f"{path}:{n}: expected an object, got {type(obj).__name__}")
        ids = obj.get("prompt_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise PromptsFileError(f"{path}:{n}: 'prompt_ids' must be a non-empty list of non-negative integers")
        mnt = obj.get("max_new_tokens")
        if mnt is not None and (not isinstance(mnt, int) or mnt < 1):
            raise PromptsFileError(f"{path}:{n}: 'max_new_tokens' must be a positive integer")
        pid = str(obj.get("id", f"prompt-{len(prompts)}"))
        prompts.append(Prompt(pid, tuple(ids), str(obj.get("kind", "unspecified")), mnt))
    if not prompts:
        raise PromptsFileError(f"prompts file {path} holds no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise PromptsFileError(f"prompts file {path} repeats prompt ids")
    return prompts


def prompt_set_hash(prompts: list[Prompt]) -> str:
    canon = json.dumps([asdict(p) for p in prompts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()
