"""The "your model" guide (docs/models.md), run end to end as written, on a model directory that is not a built-in:
text and chat prompts, a run with the lossless check, a recorded trace, a golden started from it, the gate
over it, and a diff of the golden that names its manifest entry."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from refcheck.errors import EXIT_PASS
from refcheck.models import builtin_pair
from refcheck.prompts.tokenizer import PromptTokenizer
from refcheck.trace.io import read_trace

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- own-model-guide"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def guide_block() -> str:
    """The bash block that follows the guide's marker in docs/models.md."""
    text = (ROOT / "docs" / "models.md").read_text()
    at = text.index(MARK)
    block = re.search(r"```bash\n(.*?)```", text[at:], re.S)
    assert block, "docs/models.md: the own-model guide's bash block is missing"
    return block.group(1)


def steps(block: str) -> list[tuple[str, object]]:
    """("file", (name, content)) for each ``cat > NAME <<'EOF'`` heredoc, ("refcheck", argv) for each
    refcheck command (comments dropped, variables expanded); any other command fails the test, so the
    guide stays something this test runs."""
    out: list[tuple[str, object]] = []
    lines = iter(block.splitlines())
    for line in lines:
        code = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not code:
            continue
        heredoc = re.fullmatch(r"cat > (\S+) <<'EOF'", code)
        if heredoc:
            body = []
            for inner in lines:
                if inner == "EOF":
                    break
                body.append(inner)
            out.append(("file", (heredoc.group(1), "\n".join(body) + "\n")))
        elif code.startswith("refcheck "):
            out.append(("refcheck", shlex.split(os.path.expandvars(code))[1:]))
        else:
            raise AssertionError(f"the guide has a step this test cannot run: {code!r}")
    return out


def own_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A target + DFlash draft that is not a built-in (a copy elsewhere), its tokenizer with a chat template."""
    tdir, ddir = builtin_pair("hybrid")
    t, d = tmp_path / "models" / "my-target", tmp_path / "models" / "my-draft"
    shutil.copytree(tdir, t)
    shutil.copytree(ddir, d)
    (t / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return t, d


@pytest.mark.slow  # five refcheck commands, four of them full diffs of two 8-token prompts
def test_the_readme_own_model_guide_runs_end_to_end(cli, monkeypatch, tmp_path):
    t, d = own_pair(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("MODEL", str(t))
    monkeypatch.setenv("DRAFT", str(d))
    commands = []
    for kind, what in steps(guide_block()):
        if kind == "file":
            name, content = what
            Path(name).write_text(content)
            continue
        code, out, err = cli(*what)
        assert code == EXIT_PASS, (what, err[-2000:])
        commands.append((what, out, err))
    verbs = [c[0][0] if c[0][0] != "golden" else " ".join(c[0][:2]) for c in commands]
    assert verbs == ["run", "diff", "golden add", "gate", "diff"], verbs

    # the prompts ran as the model's own tokenizer's ids, and the trace records them
    prompts_file = next(Path(a[i + 1]) for a, _, _ in commands for i, x in enumerate(a) if x == "--prompts")
    lines = [json.loads(ln) for ln in prompts_file.read_text().splitlines() if ln.strip()]
    assert {"prompt", "messages"} <= {k for ln in lines for k in ln}, "the guide shows text and chat prompts"
    tok = PromptTokenizer.from_model_dir(t)
    want = {ln["id"]: tok.encode(ln["prompt"]) if "prompt" in ln else tok.encode_chat(ln["messages"]) for ln in lines}
    saved = next(Path(a[i + 1]) for a, _, _ in commands for i, x in enumerate(a) if x == "--save-trace")
    trace = read_trace(saved)
    assert {r.request_id: r.prompt_ids for r in trace.requests} == want
    assert trace.provenance["model"] == str(t) and trace.provenance["engine"]["settings"]["draft_dir"] == str(d)

    # the run checked losslessness; the gate passed the new golden; the diff of it named its manifest entry
    assert "AR" in commands[0][2] and "pass" in commands[0][2]
    assert "refcheck gate" in commands[3][2] and "1 cases" in commands[3][2]
    assert "judges it through its manifest entry" in commands[4][2] and "expect pass" in commands[4][2]
