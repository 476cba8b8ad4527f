"""The ``refcheck`` command line, one module per command (``app`` holds the group and the entry).

Importing this package registers every command on :data:`main`; ``entry`` is the console script.
"""

from refcheck.cli import (  # noqa: F401 - registers the commands
    baseline,
    calibrate,
    capture,
    diff,
    explain,
    goldens,
    matrix,
    report,
    run,
    selftest,
    sweep,
    trace,
)
from refcheck.cli.app import entry, main

__all__ = ["entry", "main"]
