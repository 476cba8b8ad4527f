"""Node budgets: the one place that reads, checks and writes them.

Contract: a budget is the number of drafted nodes one verify step may hold (the root not counted), a
non-negative int; ``None`` is chain mode (vanilla DFlash: top-1 per depth), written ``"chain"`` on the
command line, in provenance and in reports. :func:`parse_budget` turns what a user or a file wrote
into the value (a :class:`~refcheck.errors.UsageError` naming where it came from otherwise);
:func:`budget_label` and :func:`budget_json` write it back; :func:`budget_from_json` reads the
provenance form. Fit against a model (context, memory) is :func:`refcheck.model_checks.check_budget`.
"""

from __future__ import annotations

from refcheck.errors import UsageError

CHAIN = "chain"

Budget = int | None


def parse_budget(value: object, where: str = "--budget") -> Budget:
    """An int >= 0, or None for ``chain`` (any case); a UsageError naming ``where`` for anything else."""
    if value is None or (isinstance(value, str) and value.strip().lower() == CHAIN):
        return None
    if isinstance(value, bool):
        raise UsageError(f"{where}: budget must be a non-negative integer or 'chain', got {value!r}")
    text = str(value).strip()
    if not (isinstance(value, int) or (text.isascii() and text.isdigit())):  # no "1_000", "1e3", "+3" or "٣"
        raise UsageError(f"{where}: budget must be a non-negative integer or 'chain', got {value!r}")
    b = int(value) if isinstance(value, int) else int(text)
    if b < 0:
        raise UsageError(f"{where}: budget must be >= 0 or 'chain', got {b}")
    return b


def budget_label(b: Budget) -> str:
    """``"chain"`` or the number, as reports and file names show it."""
    return CHAIN if b is None else str(b)


def budget_tag(b: Budget) -> str:
    """``"chain"`` or ``"b15"``: a budget inside a case or run name."""
    return CHAIN if b is None else f"b{b}"


def budget_json(b: Budget) -> int | str:
    """The provenance form: ``"chain"`` or the int."""
    return CHAIN if b is None else int(b)


def budget_from_json(value: object) -> Budget:
    """The provenance form back to the value (``"chain"`` -> None)."""
    return parse_budget(value, "trace provenance budget")
