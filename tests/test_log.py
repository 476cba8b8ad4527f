"""refcheck's messages through stdlib logging (refcheck/log.py): the CLI shows progress records on stderr
as worded, ``--log-level warning`` silences them (tables and errors stay), and library code that logs is
heard by an application's own handler without the CLI."""

from __future__ import annotations

import logging

from refcheck.errors import EXIT_PASS


def test_progress_is_info_records_the_log_level_can_silence(cli):
    code, _, err = cli("gate", "--case", "attention-b15", "--workers", "1")
    assert code == EXIT_PASS and "gate: attention-b15\n" in err and "attention-b15" in err.split("gate: attention-b15")[1]
    code, _, quiet = cli("--log-level", "warning", "gate", "--case", "attention-b15", "--workers", "1")
    assert code == EXIT_PASS and "gate: attention-b15\n" not in quiet and "attention-b15" in quiet  # the table stays
    assert len(logging.getLogger("refcheck").handlers) == 1  # one handler, however many commands ran


def test_library_records_reach_the_applications_handler(caplog):
    from refcheck.log import progress_line

    with caplog.at_level(logging.INFO, logger="refcheck"):
        progress_line("[1/2] prose-1")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("refcheck.progress", "[1/2] prose-1")]


def test_a_progress_bar_on_a_terminal_and_records_elsewhere(caplog):
    """On a terminal the bar takes the lines (each also a DEBUG record); on a pipe, or with progress silenced,
    the lines stay INFO records (logs and CI keep them)."""
    import io

    from rich.console import Console

    from refcheck.log import progress_bar, progress_line

    with progress_bar(Console(file=io.StringIO()), 3, "gate") as prog:
        assert prog is progress_line
    term = io.StringIO()
    with caplog.at_level(logging.DEBUG, logger="refcheck"):
        with progress_bar(Console(file=term, force_terminal=True, width=80), 2, "gate") as prog:
            assert prog is not progress_line
            prog("gate: a")
            prog("gate: b")
    assert [r.getMessage() for r in caplog.records if r.name == "refcheck.progress"] == ["gate: a", "gate: b"]
    assert "gate" in term.getvalue()  # the bar was drawn on the terminal (the records went to the log only)
    with caplog.at_level(logging.WARNING, logger="refcheck"):
        with progress_bar(Console(file=io.StringIO(), force_terminal=True), 2, "gate") as prog:
            assert prog is progress_line
