"""Text and chat prompts: tokenized with the model directory's own tokenizer, offline, into the ids that run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from refcheck.errors import PromptsFileError, TokenizerError
from refcheck.models import builtin_pair
from refcheck.prompts import BUILTIN_PROMPTS, load_prompts, prompt_set_hash

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def builtin_texts(tmp_path: Path) -> Path:
    """The built-in prompts as text lines (their stored "text", not their ids)."""
    lines = []
    for line in BUILTIN_PROMPTS.read_text().splitlines():
        obj = json.loads(line)
        lines.append(json.dumps({"id": obj["id"], "kind": obj["kind"], "prompt": obj["text"]}))
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def chat_model_dir(tmp_path: Path) -> Path:
    """The built-in target's tokenizer with a tokenizer_config.json that carries a chat template."""
    d = tmp_path / "chatmodel"
    shutil.copytree(builtin_pair("hybrid")[0], d)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return d


def test_text_prompts_tokenize_to_the_builtin_ids_and_hash(tmp_path):
    target = builtin_pair("hybrid")[0]
    text = load_prompts(builtin_texts(tmp_path), target)
    ids = load_prompts()
    assert [p.prompt_ids for p in text] == [p.prompt_ids for p in ids]
    assert prompt_set_hash(text) == prompt_set_hash(ids)  # the same prompt set: goldens recorded from ids stay fresh


def test_text_through_transformers_tokenizer_equals_bare_tokenizer_json(tmp_path):
    d = chat_model_dir(tmp_path)
    via_config = load_prompts(builtin_texts(tmp_path), d)
    assert [p.prompt_ids for p in via_config] == [p.prompt_ids for p in load_prompts()]


def test_chat_messages_use_the_models_template(tmp_path):
    from tokenizers import Tokenizer

    d = chat_model_dir(tmp_path)
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"id": "c", "messages": [{"role": "user", "content": "3 + 4 = "}]}) + "\n")
    (p,) = load_prompts(f, d)
    bare = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert list(p.prompt_ids) == bare.encode("user: 3 + 4 = \nassistant: ").ids


def test_ids_only_files_never_need_a_tokenizer(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text('{"id": "a", "prompt_ids": [5, 6]}\n')
    assert load_prompts(f, tmp_path / "no-such-model")[0].prompt_ids == (5, 6)


def test_text_without_a_model_directory_is_a_typed_error(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"id": "a", "prompt": "hello"}\n')
    with pytest.raises(TokenizerError, match="no model directory"):
        load_prompts(f)
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        load_prompts(f, tmp_path)


def test_content_keys_are_exclusive(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"id": "a"}\n')
    with pytest.raises(PromptsFileError, match="got none"):
        load_prompts(f)
