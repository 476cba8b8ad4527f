"""Token ids as text, when the trace's target directory has a tokenizer.

Contract: :meth:`TokenText.for_trace` loads the tokenizer of the trace's target (a built-in pair's
directory, or the model directory its provenance names) offline through
:class:`~refcheck.prompts.tokenizer.PromptTokenizer`; None when there is none or it cannot load
(the page then shows ids only). :meth:`TokenText.text` is one id's text with whitespace and control
characters made visible (``␣``, ``⏎``, ``\\t``), cut to :data:`MAX_CHARS` characters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_CHARS = 12
_VISIBLE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def target_dir(provenance: dict[str, Any]) -> Path | None:
    """The target's directory a trace's provenance names (a built-in pair's included), else None."""
    model = str(provenance.get("model") or "")
    if model.startswith("builtin:"):
        from refcheck.models import BUILTIN_PAIRS, builtin_pair

        pair = model.split(":", 1)[1]
        return builtin_pair(pair)[0] if pair in BUILTIN_PAIRS else None
    return Path(model) if model else None


class TokenText:
    """One tokenizer's text of token ids, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    @classmethod
    def for_trace(cls, provenance: dict[str, Any]) -> TokenText | None:
        from refcheck.prompts.tokenizer import PromptTokenizer

        directory = target_dir(provenance)
        if directory is None or not directory.is_dir():
            return None
        try:
            return cls(PromptTokenizer.from_model_dir(directory))
        except Exception:  # noqa: BLE001 - any tokenizer that does not load: the page shows ids only
            return None

    def text(self, token_id: int) -> str:
        if token_id not in self._cache:
            try:
                raw = self._tok.decode([token_id])
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode: shown as an id only
                raw = ""
            shown = raw.translate(_VISIBLE)
            shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)
            self._cache[token_id] = shown if len(shown) <= MAX_CHARS else shown[:MAX_CHARS - 1] + "…"
        return self._cache[token_id]
