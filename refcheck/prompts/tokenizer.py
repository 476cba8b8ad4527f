"""A model directory's own tokenizer, loaded offline, for text prompts.

Contract: :meth:`PromptTokenizer.from_model_dir` loads the tokenizer that lives in a target's
checkpoint directory and nothing else: with a ``tokenizer_config.json`` (or ``chat_template.jinja``)
through transformers' ``AutoTokenizer`` with ``local_files_only`` (chat templates need this), else a
bare ``tokenizer.json`` through the ``tokenizers`` library. Nothing is downloaded. A directory with
neither raises :class:`refcheck.errors.TokenizerError` (exit 2) naming the files looked for.
:meth:`encode` turns text into ids the way the model's tokenizer does by default (its special
tokens, e.g. a BOS, included) and :meth:`decode` ids back into text; :meth:`encode_chat` renders
``messages`` with the model's chat template (generation prompt appended) and encodes the result without
adding special tokens again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from refcheck.errors import TokenizerError

#: files that make a directory's tokenizer loadable (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class PromptTokenizer:
    """Text → token ids with one model directory's tokenizer."""

    def __init__(self, model_dir: Path, backend: Any, kind: str) -> None:
        self.model_dir = model_dir
        self._backend = backend
        self.kind = kind  # "transformers" | "tokenizers"

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptTokenizer:
        model_dir = Path(model_dir)
        has = {name: (model_dir / name).is_file() for name in (*TOKENIZER_FILES, "chat_template.jinja")}
        if has["tokenizer_config.json"] or (has["chat_template.jinja"] and has["tokenizer.json"]):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; all mean "not loadable here"
                raise TokenizerError(f"cannot load the tokenizer in {model_dir} offline: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
            return cls(model_dir, tok, "transformers")
        if has["tokenizer.json"]:
            from tokenizers import Tokenizer

            try:
                return cls(model_dir, Tokenizer.from_file(str(model_dir / "tokenizer.json")), "tokenizers")
            except Exception as exc:  # noqa: BLE001 - the Rust tokenizer raises plain Exceptions on bad files
                raise TokenizerError(f"{model_dir / 'tokenizer.json'} is not a tokenizer file: {exc}") from exc
        raise TokenizerError(f"the prompts give text, but {model_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): "
                             "put the model's tokenizer files there, or give token ids (\"prompt_ids\")")

    def encode(self, text: str) -> list[int]:
        if self.kind == "tokenizers":
            return list(self._backend.encode(text).ids)
        return list(self._backend(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens included (a report shows what the model saw)."""
        return str(self._backend.decode(list(ids), skip_special_tokens=False))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        template = getattr(self._backend, "chat_template", None) if self.kind == "transformers" else None
        if not template:
            raise TokenizerError(f"the prompts give chat \"messages\", but {self.model_dir} has no chat template "
                                 "(tokenizer_config.json's \"chat_template\" or chat_template.jinja): give \"prompt\" "
                                 "text or \"prompt_ids\"")
        try:
            text = self._backend.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error (jinja) is the user's template or messages
            raise TokenizerError(f"the chat template in {self.model_dir} failed on these messages: "
                                 f"{type(exc).__name__}: {exc}") from exc
        return list(self._backend(text, add_special_tokens=False)["input_ids"])
