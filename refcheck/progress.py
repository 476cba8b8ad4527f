"""Progress lines: every long loop reports through one callable shape.

Contract: ``Progress = Callable[[str], None]`` receives one finished, human line per unit of work
("gate: hybrid-b15", "[2/6] prose-1", "repeat 1 budget 15"); the producer words it, the consumer
only shows it (the CLI: :func:`refcheck.log.progress_line`, INFO log records on stderr). ``None`` means silent;
:func:`tell` is the one way producers call it.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]


def tell(progress: Progress | None, line: str) -> None:
    """Hand ``line`` to ``progress`` (nothing when it is None)."""
    if progress is not None:
        progress(line)
