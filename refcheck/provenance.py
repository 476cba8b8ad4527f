"""Provenance of a trace: what produced it, on what, with which settings.

Contract: :func:`build_provenance` returns a JSON-able dict stored in every trace (the file format);
:meth:`Provenance.of` reads one back as a typed, validated value, and the diff, the gate and the
reports read provenance only through it: an engine's private settings are kept for people, and the
few of them that steer the diff (tree rules, draft directory, stop tokens, seed, the capture's own
report) are typed fields here, so a runner cannot steer the diff by an untyped key. Content hashes
(sha256 over each checkpoint directory's files, name + bytes) identify models independently of
their paths; :func:`stale_reasons` lists the differences between a stored trace's provenance and
the current setup that make a golden stale (model, draft, tokenizer, budget, block size, prompt
set, dtype).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import refcheck
from refcheck.budget import budget_from_json, budget_json
from refcheck.errors import CorruptTraceError

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


def file_sha256(path: Path, chunk: int = 1 << 20) -> hashlib._Hash:
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


class ProvenanceError(CorruptTraceError):
    """A trace's provenance is not what refcheck writes (a field of the wrong type)."""


@dataclass(frozen=True, slots=True)
class CaptureReport:
    """What an engine capture (SGLang's plugin) said about itself: a crash, requests without a result,
    hook errors, assembly statistics."""

    crash: str | None = None
    incomplete: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    partial_trace: str | None = None
    stats: Mapping[str, Any] = field(default_factory=dict)
    max_bytes: int | None = None  # each scheduler process's byte budget for records (None: unbounded)


def _typed(d: Mapping, key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    value = d.get(key, default)
    if value is None or isinstance(value, kind):
        return value
    raise ProvenanceError(f"{where}{key} is {type(value).__name__} {value!r}, expected {kind}")


def _positive_int(d: Mapping, key: str, default: int, where: str) -> int:
    value = _typed(d, key, int, default, where)
    if value is None:
        return default
    if isinstance(value, bool) or value < 1:
        raise ProvenanceError(f"{where}{key} is {value!r}, expected an integer >= 1")
    return int(value)


def _token_ids(d: Mapping, key: str, where: str) -> frozenset[int]:
    values = _typed(d, key, list, [], where) or []
    bad = next((v for v in values if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < TOKEN_ID_LIMIT), None)
    if bad is not None:
        raise ProvenanceError(f"{where}{key} holds {bad!r}, expected token ids (integers in [0, 2**31))")
    return frozenset(values)


#: token ids are below this (the trace stores them as int32)
TOKEN_ID_LIMIT = 2**31

#: the values of :attr:`Provenance.draft_rule`
DRAFT_RULES = ("ddtree", "chain", "none", "other")


@dataclass(frozen=True, slots=True)
class Provenance:
    """A trace's provenance, typed. Defaults are what an old trace that lacks a key meant."""

    engine: str
    engine_version: str | None
    model: str  # "builtin:<pair>" or the target's directory
    model_sha256: str | None
    draft_sha256: str | None
    tokenizer_sha256: str | None
    dtype: str
    device: str
    budget: int | None  # None: chain mode
    block_size: int | None
    max_new_tokens: int
    drafter: str  # "dflash" | "scripted" | "none" (an engine that drafts nothing)
    prompt_set_sha256: str | None
    created: str | None
    case: str | None  # the golden case it was recorded for
    # -- the engine settings the diff reads (everything else in settings is for people)
    tree_rules: str  # "exact" (the reference's own heap) | "structural" (any well-formed tree: other engines)
    draft_dir: Path | None  # a user's draft checkpoint (built-in pairs: None)
    stop_token_ids: frozenset[int]
    seed: int
    capture: CaptureReport | None  # None: not a captured engine
    settings: Mapping[str, Any] = field(default_factory=dict)  # the engine's own settings, as recorded

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Provenance:
        """Read and check a provenance dict (ProvenanceError on a field of the wrong type or out of range: a
        token limit below 1, a stop token id that is not an integer in [0, 2**31))."""
        if not isinstance(d, Mapping):
            raise ProvenanceError(f"provenance is {type(d).__name__}, expected a JSON object")
        eng = _typed(d, "engine", Mapping, {}, "provenance ") or {}
        st = _typed(eng, "settings", Mapping, {}, "provenance engine.") or {}
        cap = _typed(d, "capture", Mapping, None, "provenance ")
        rules = _typed(st, "tree_rules", str, "exact", "provenance engine.settings.") or "exact"
        if rules not in ("exact", "structural"):
            raise ProvenanceError(f"provenance engine.settings.tree_rules is {rules!r}, expected 'exact' or 'structural'")
        draft_dir = _typed(st, "draft_dir", str, None, "provenance engine.settings.")
        try:
            budget = budget_from_json(d.get("budget", 15))
        except Exception as exc:  # a UsageError from the parser: here it is the file that is wrong
            raise ProvenanceError(f"provenance budget: {exc}") from None
        return cls(
            engine=str(_typed(eng, "name", str, "?", "provenance engine.") or "?"),
            engine_version=_typed(eng, "version", str, None, "provenance engine."),
            model=str(_typed(d, "model", str, "", "provenance ") or ""),
            model_sha256=_typed(d, "model_sha256", str, None, "provenance "),
            draft_sha256=_typed(d, "draft_sha256", str, None, "provenance "),
            tokenizer_sha256=_typed(d, "tokenizer_sha256", str, None, "provenance "),
            dtype=str(_typed(d, "dtype", str, "float32", "provenance ") or "float32"),
            device=str(_typed(d, "device", str, "cpu", "provenance ") or "cpu"),
            budget=budget,
            block_size=_typed(d, "block_size", int, None, "provenance "),
            max_new_tokens=_positive_int(d, "max_new_tokens", 64, "provenance "),
            drafter=str(_typed(d, "drafter", str, "dflash", "provenance ") or "dflash"),
            prompt_set_sha256=_typed(d, "prompt_set_sha256", str, None, "provenance "),
            created=_typed(d, "created", str, None, "provenance "),
            case=_typed(d, "case", str, None, "provenance "),
            tree_rules=rules,
            draft_dir=Path(draft_dir) if draft_dir else None,
            stop_token_ids=_token_ids(st, "stop_token_ids", "provenance engine.settings."),
            seed=int(_typed(st, "seed", int, 0, "provenance engine.settings.") or 0),
            capture=None if not cap else CaptureReport(
                crash=_typed(cap, "crash", str, None, "provenance capture."),
                incomplete=tuple(cap.get("incomplete") or ()), errors=tuple(cap.get("errors") or ()),
                problems=tuple(cap.get("problems") or ()),
                partial_trace=_typed(cap, "partial_trace", str, None, "provenance capture."),
                stats=_typed(cap, "stats", Mapping, {}, "provenance capture.") or {},
                max_bytes=_typed(cap, "max_bytes", int, None, "provenance capture.")),
            settings=st,
        )

    @property
    def draft_rule(self) -> str:
        """How the engine turned its drafts into the tree it verified: ``ddtree`` (best-first at ``budget``),
        ``chain`` (the top-1 token at each depth), ``none`` (target-only decoding) or ``other`` (its own rule,
        e.g. SGLang's NGRAM: no reference algorithm to compare acceptance with). Read from
        ``engine.settings.draft_rule`` where the runner recorded it, else derived from the engine and algorithm."""
        rule = self.settings.get("draft_rule")
        if isinstance(rule, str) and rule in DRAFT_RULES:
            return rule
        if rule is not None:
            raise ProvenanceError(f"provenance engine.settings.draft_rule is {rule!r}, expected one of {DRAFT_RULES}")
        algorithm = str(self.settings.get("algorithm") or "")
        if algorithm == "NONE" or self.budget == 0:
            return "none"
        if algorithm == "DFLASH" or self.engine == "zlab" or self.budget is None:
            return "chain"
        if (self.engine == "sglang" and not algorithm.startswith("REFCHECK_DDTREE")) or self.drafter == "none":
            return "other"
        return "ddtree"

    @property
    def is_reference(self) -> bool:
        """Recorded by the reference decoder itself (its acceptance is held to the reference's exactly)."""
        return self.engine == "reference"
