"""``python -m refcheck``: the console entry without an installed script (e.g. on an offline GPU box)."""

from refcheck.cli import entry

entry()
