"""Where refcheck's messages go: stdlib logging, shown through rich on the CLI's stderr console.

Contract: library code logs through ``logging.getLogger("refcheck.<module>")`` and never prints; the
progress lines long work hands to its :data:`refcheck.progress.Progress` callable are, on the CLI, INFO
records of the ``refcheck.progress`` logger (:func:`progress_line`). :func:`configure` (the CLI group,
once per process) attaches one :class:`ConsoleHandler` to the ``refcheck`` logger, printing each message
through the CLI's rich console as it is worded (no time, level or path columns, no markup; rich's own
``RichHandler`` lays every record out as a table row padded to the console's width) at ``--log-level``
(default info; ``warning`` silences progress). :func:`progress_bar` shows long work of a known
number of units as a :mod:`rich.progress` bar on a terminal, and as the same records elsewhere. Used as a library without :func:`configure`, refcheck's records go
wherever the application's logging sends them (nowhere, by default, below WARNING).

Names read from files (prompt ids, request ids, case names, paths) are untrusted text: a record is shown as one
line, whatever it holds (:func:`one_line`: a newline or NUL in a name is written ``\\n``, ``\\x00``), so no name
can start a line of its own (a forged ``refcheck: error:`` line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LEVELS = ("debug", "info", "warning", "error")
_MARK = "_refcheck_cli_handler"


def one_line(text: str) -> str:
    """``text`` as one line of output: each character that does not print (newline, carriage return, tab, NUL,
    escape, other control and format characters) written as Python writes it in a string literal (``\\n``,
    ``\\x00``, ``\\u200b``); printable text unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ConsoleHandler(logging.Handler):
    """Each record's message printed on a rich console, as worded, on one line (:func:`one_line`)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(one_line(self.format(record)), markup=False, highlight=False, soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


def configure(console: Console, level: str = "info") -> None:
    """Show the ``refcheck`` loggers' records on ``console`` at ``level`` (idempotent: one handler per process)."""
    root = logging.getLogger("refcheck")
    root.setLevel(getattr(logging, level.upper()))
    if any(getattr(h, _MARK, False) for h in root.handlers):
        return
    handler = ConsoleHandler(console)
    handler.setFormatter(logging.Formatter("%(message)s"))
    setattr(handler, _MARK, True)
    root.addHandler(handler)


def progress_line(line: str) -> None:
    """A :data:`refcheck.progress.Progress`: each line an INFO record of ``refcheck.progress``."""
    logging.getLogger("refcheck.progress").info(line)


@contextmanager
def progress_bar(console: Console, total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A :data:`refcheck.progress.Progress` for ``total`` units of work: on a terminal (and at info), one
    ``rich.progress`` bar advanced by each line, the line its description, gone when done; elsewhere each
    line an INFO record (:func:`progress_line`), so logs and CI keep them."""
    if not console.is_terminal or not logging.getLogger("refcheck.progress").isEnabledFor(logging.INFO):
        yield progress_line
        return
    columns = (TextColumn(f"{what} "), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=total)

        def advance(line: str) -> None:
            bar.update(task, advance=1, description=escape(one_line(line)))  # the bar renders markup: a name is text
            logging.getLogger("refcheck.progress").debug(line)

        yield advance
