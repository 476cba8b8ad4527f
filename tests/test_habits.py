"""The house rules, read from the source: functions fit on a screen, and nothing narrates history.

* No function in ``reference/``, ``refcheck/`` or ``scripts/`` is longer than :data:`MAX_LINES` lines, except
  those in :data:`LONG` at most at their listed length (each is a loop or a table whose parts read
  best together, or a script's ``main``); a new long function, or a listed one that grows, fails.
* Code, docstrings and the manual (``README.md``, ``docs/`` outside ``docs/results/``) say what is: phrases
  that narrate sessions or fixes (:data:`NARRATION`) fail wherever they appear.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
#: "path:function" -> its length in lines (may shrink, may not grow)
LONG = {"refcheck/sglang_capture/assemble.py:assemble_trace": 66, "refcheck/runners/sglang.py:trace": 65,
        "refcheck/sglang_capture/dflash_taps.py:dflash_taps": 64, "refcheck/diff/replay.py:replay_step": 61}
NARRATION = re.compile(r"\b(this|last|earlier|previous|next) session\b|\bfirst H200 (corpus|run)\b|\bbefore the fix\b|"
                       r"\bnow fixed\b|\bwe fixed\b|\bas before\b|\bused to (be|fail|pass)\b", re.I)


def function_lengths() -> dict[str, int]:
    out = {}
    for top in ("reference", "refcheck", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{path.relative_to(ROOT)}:{node.name}"] = max(
                        out.get(f"{path.relative_to(ROOT)}:{node.name}", 0), node.end_lineno - node.lineno + 1)
    return out


def test_functions_fit_on_a_screen():
    lengths = function_lengths()
    long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    grown = {name: (n, LONG.get(name)) for name, n in long.items() if n > LONG.get(name, MAX_LINES)}
    assert not grown, f"functions over {MAX_LINES} lines (now, allowed): {grown}"


def narrating_lines() -> list[str]:
    files = [*(ROOT / "reference").rglob("*.py"), *(ROOT / "refcheck").rglob("*.py"), *(ROOT / "scripts").rglob("*"),
             ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)]
    out = []
    for path in files:
        if not path.is_file() or path.suffix not in (".py", ".md", ".sh"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if NARRATION.search(line):
                out.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return out


def test_nothing_narrates_history():
    assert not narrating_lines()


#: phrases the check must find, and phrases of the same words that say what is, each written as its words
NARRATING = (("found", "this", "session"), ("on", "the", "first", "H200", "run"), ("it", "used", "to", "fail"),
             ("the", "gate,", "as", "before,", "runs"))
DESCRIBING = (("the", "session's", "cache"), ("the", "first", "H200", "of", "the", "pool"), ("used", "to", "build", "trees"))


def test_the_narration_check_finds_narration():
    for words in NARRATING:
        assert NARRATION.search(" ".join(words)), words
    for words in DESCRIBING:
        assert not NARRATION.search(" ".join(words)), words
