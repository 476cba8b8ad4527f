"""Prompt sets: the built-in one and user files (JSONL), as token ids or as text.

Contract: a prompts file is JSONL, one object per line, with exactly one of

* ``"prompt_ids": [int, ...]`` — token ids in [0, 2**31) (the trace's int32), used as they are;
* ``"prompt": "text"`` — tokenized with the target directory's own tokenizer
  (:mod:`refcheck.prompts.tokenizer`, offline);
* ``"messages": [{"role": ..., "content": ...}, ...]`` — rendered with the model's chat template
  (generation prompt appended), then tokenized;

and optional ``"id"``, ``"kind"`` (e.g. code / arithmetic / prose) and ``"max_new_tokens"``. Blank
lines are skipped. Anything else raises :class:`PromptsFileError` naming the line; text without a
tokenizer raises :class:`refcheck.errors.TokenizerError`. Ids are names from a file: printed, they are
escaped (:func:`refcheck.log.one_line`), whatever characters they hold. A :class:`Prompt` always holds ids (what
runs and what the trace records). The prompt-set hash (sha256 of the canonical JSON of every
prompt's id, ids, kind and token limit) identifies a set in trace provenance: a text prompt hashes
like the ids it tokenizes to.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from refcheck.errors import PromptsFileError
from refcheck.provenance import TOKEN_ID_LIMIT

BUILTIN_PROMPTS = Path(__file__).resolve().parent / "builtin.jsonl"
#: the keys that give a prompt's content (exactly one per line)
CONTENT_KEYS = ("prompt_ids", "prompt", "messages")


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    prompt_ids: tuple[int, ...]
    kind: str = "unspecified"
    max_new_tokens: int | None = None


def load_prompts(path: str | Path | None = None, tokenizer_dir: str | Path | None = None) -> list[Prompt]:
    """The prompts of ``path`` (default: the built-in set). ``tokenizer_dir``: the target's
    checkpoint directory, whose tokenizer turns ``prompt`` / ``messages`` lines into ids."""
    path = Path(path) if path is not None else BUILTIN_PROMPTS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError as exc:
        raise PromptsFileError(f"prompts file not found: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptsFileError(f"cannot read prompts file {path}: {exc}") from exc
    tokenizer = _LazyTokenizer(tokenizer_dir)
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
        ids = _prompt_ids(obj, f"{path}:{n}", tokenizer)
        mnt = obj.get("max_new_tokens")
        if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1):
            raise PromptsFileError(f"{path}:{n}: 'max_new_tokens' must be a positive integer")
        pid = str(obj.get("id", f"prompt-{len(prompts)}"))
        prompts.append(Prompt(pid, tuple(ids), str(obj.get("kind", "unspecified")), mnt))
    if not prompts:
        raise PromptsFileError(f"prompts file {path} holds no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise PromptsFileError(f"prompts file {path} repeats prompt ids")
    return prompts


def _prompt_ids(obj: dict, where: str, tokenizer: _LazyTokenizer) -> list[int]:
    given = [k for k in CONTENT_KEYS if k in obj]
    if len(given) != 1:
        raise PromptsFileError(f"{where}: give exactly one of 'prompt_ids' (token ids), 'prompt' (text) or 'messages' "
                               f"(chat), got {', '.join(repr(k) for k in given) or 'none'}")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise PromptsFileError(f"{where}: 'prompt_ids' must be a non-empty list of non-negative integers")
        big = next((t for t in ids if t >= TOKEN_ID_LIMIT), None)
        if big is not None:
            raise PromptsFileError(f"{where}: 'prompt_ids' holds {big}, not a token id (token ids are below 2**31)")
        return ids
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise PromptsFileError(f"{where}: 'prompt' must be non-empty text")
        ids = tokenizer.get(where).encode(text)
    else:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in msgs)):
            raise PromptsFileError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
        ids = tokenizer.get(where).encode_chat(msgs)
    if not ids:
        raise PromptsFileError(f"{where}: the text tokenizes to no tokens")
    return ids


class _LazyTokenizer:
    """The target directory's tokenizer, loaded on the first text prompt (an ids-only file never loads it)."""

    def __init__(self, model_dir: str | Path | None) -> None:
        self.model_dir = model_dir
        self._tok = None

    def get(self, where: str):
        from refcheck.errors import TokenizerError
        from refcheck.prompts.tokenizer import PromptTokenizer

        if self.model_dir is None:
            raise TokenizerError(f"{where}: a text prompt needs the target's tokenizer, and this command has no model "
                                 "directory to take it from: give \"prompt_ids\"")
        if self._tok is None:
            self._tok = PromptTokenizer.from_model_dir(self.model_dir)
        return self._tok


def prompt_set_hash(prompts: list[Prompt]) -> str:
    canon = json.dumps([{"id": p.id, "prompt_ids": list(p.prompt_ids), "kind": p.kind, "max_new_tokens": p.max_new_tokens}
                        for p in prompts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()
