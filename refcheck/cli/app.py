"""The ``refcheck`` command group, its console, and the console-script entry.

Contract: every command prints human output (rich tables, progress) on stderr and, with
``--json``, only JSON on stdout. User errors never show a traceback: they print
``refcheck: error: <message>`` and exit with the code documented in :mod:`refcheck.errors`.

Names read from files (prompt ids, request ids, case names, paths) are untrusted text: the error line and
every string printed on :data:`err` are one line each, their characters that do not print escaped
(:func:`refcheck.log.one_line`), so a name holding a newline cannot start a line of its own. Table cells
that show such names escape them where the table is built.
"""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.console import Console

from refcheck.errors import exit_code_for
from refcheck.log import LEVELS, configure, one_line
from refcheck.log import progress_line as progress_line  # the CLI's Progress: log records shown on ``err``


class LineConsole(Console):
    """A rich console on which each string printed is one line of text (:func:`refcheck.log.one_line`);
    other renderables (tables) print as they are."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*(one_line(o) if isinstance(o, str) else o for o in objects), **kwargs)


err = LineConsole(stderr=True)
if not err.is_terminal:  # logs and CI: wide enough that tables do not wrap every cell
    err = LineConsole(stderr=True, width=160)


@click.group()
@click.version_option(package_name="refcheck")
@click.option("--log-level", type=click.Choice(LEVELS), default="info", show_default=True,
              help="Progress and notes are 'info' (on stderr); 'warning' keeps only warnings and errors.")
def main(log_level: str) -> None:
    """refcheck: correctness verification and reference diffs for tree speculative decoding."""
    configure(err, log_level)

def quiet() -> None:
    from refcheck.reference_runner import _quiet_transformers

    _quiet_transformers()

def entry() -> None:
    """Console-script entry: run the group and turn user errors into exit codes (and, when another refcheck process
    started this one and asked, leave with it: :func:`refcheck.lifetime.end_with_parent_if_asked`)."""
    from refcheck.lifetime import end_with_parent_if_asked

    end_with_parent_if_asked()
    try:
        main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - mapped to a code below, re-raised if unknown
        code = exit_code_for(exc)
        if code is None:
            raise
        click.echo(f"refcheck: error: {one_line(str(exc))}", err=True)
        sys.exit(code)
