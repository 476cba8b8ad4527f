"""Names read from files (prompt ids, request ids, file names) are printed escaped (refcheck/log.py: one_line;
refcheck/cli/app.py; refcheck/cli/reports.py: name_cell): a newline or NUL in a name cannot start a line of
its own (a forged ``refcheck: error:`` line), and rich markup in a name is shown as text, never parsed."""

from __future__ import annotations

import io
import json
from pathlib import Path

from bad_input_kit import FAST

from refcheck.errors import EXIT_MISMATCH, EXIT_PASS
from refcheck.log import one_line

FORGED = "x\nrefcheck: error: forged\x00"
MARKUP = "b[/]c[red]"


def _prompts(path: Path, *ids: str) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt_ids": [30 + n, 31, 32, 33, 34, 35]}) + "\n"
                            for n, i in enumerate(ids)))
    return path


def _forged_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("refcheck: error: forged")]


def test_one_line_escapes_what_does_not_print() -> None:
    assert one_line("plain τ → name") == "plain τ → name"
    assert one_line(FORGED) == "x\\nrefcheck: error: forged\\x00"
    assert one_line("a\r\tb\x1b[2J\u200b") == "a\\r\\tb\\x1b[2J\\u200b"


def test_the_cli_console_prints_a_string_on_one_line() -> None:
    from refcheck.cli.app import LineConsole

    console = LineConsole(file=io.StringIO(), width=200)
    console.print(f"note: {FORGED}", markup=False)
    assert console.file.getvalue() == "note: x\\nrefcheck: error: forged\\x00\n"  # type: ignore[attr-defined]


def test_run_shows_prompt_ids_escaped(cli, tmp_path: Path) -> None:
    code, _, err = cli("run", "--prompts", str(_prompts(tmp_path / "p.jsonl", FORGED, MARKUP)), *FAST)
    assert code == EXIT_PASS, err
    assert "Traceback" not in err and not _forged_lines(err)
    assert "x\\nrefcheck: error: forged\\x00" in err  # the progress line and the table
    assert MARKUP in err  # shown as written, not parsed as markup


def test_a_failing_diff_shows_request_ids_escaped(cli, tmp_path: Path) -> None:
    """A live fault run with such ids: the progress, the table, its notes, the per-step table and the explain
    hint all name them, escaped; the one command to paste quotes the id."""
    p = _prompts(tmp_path / "p.jsonl", FORGED, MARKUP)
    code, out, err = cli("diff", "--engine", "fault:sibling-leak", "--drafter", "scripted", "--prompts", str(p),
                         "--max-new-tokens", "16", "--steps", "--json")
    assert code == EXIT_MISMATCH, err
    assert "Traceback" not in err and not _forged_lines(err)
    assert "x\\nrefcheck: error: forged\\x00" in err and MARKUP in err
    assert {r["request_id"] for r in json.loads(out)["reports"][0]["findings"]} <= {FORGED, MARKUP}  # JSON: exact


def test_an_error_naming_a_file_is_one_line(cli, tmp_path: Path) -> None:
    """A path holds no NUL (the command line cannot pass one), but a newline it can."""
    code, _, err = cli("trace", "show", str(tmp_path / "x\nrefcheck: error: forged.arrow"))
    assert code != EXIT_PASS and "Traceback" not in err and not _forged_lines(err)
    assert [line for line in err.splitlines() if line.startswith("refcheck: error:")] == [
        f"refcheck: error: no trace at {tmp_path}/x\\nrefcheck: error: forged.arrow"]
