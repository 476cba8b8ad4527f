"""Option types and helpers of the commands that run models: budgets, devices, stop ids, and which options the user
gave (the option groups themselves: :mod:`refcheck.cli.groups`)."""

from __future__ import annotations

from collections.abc import Iterable

import click

from refcheck.errors import UsageError


class BudgetType(click.ParamType):
    """A node budget: a non-negative integer, or ``chain`` for vanilla DFlash (top-1 per depth)."""

    name = "budget"

    def convert(self, value, param, ctx):  # type: ignore[override]
        from refcheck.budget import parse_budget
        from refcheck.errors import UsageError

        try:
            return parse_budget(value, f"--{self.name}")
        except UsageError as exc:
            self.fail(str(exc), param, ctx)

class DeviceType(click.ParamType):
    """A torch device refcheck runs on: ``cpu``, ``cuda`` or ``cuda:N``."""

    name = "device"

    def convert(self, value, param, ctx):  # type: ignore[override]
        text = str(value)
        if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
            return text
        self.fail(f"unknown device {text!r} (choose cpu, cuda or cuda:N)", param, ctx)


def parse_ids(text: str | None) -> frozenset[int]:
    """``--stop``'s token ids: comma-separated integers in [0, 2**31); anything else is a usage error."""
    from refcheck.provenance import TOKEN_ID_LIMIT

    if not text:
        return frozenset()
    try:
        ids = frozenset(int(t) for t in text.split(","))
    except ValueError as exc:
        raise UsageError(f"--stop must be comma-separated token ids, got {text!r}") from exc
    bad = sorted(t for t in ids if not 0 <= t < TOKEN_ID_LIMIT)
    if bad:
        raise UsageError(f"--stop {text}: {bad[0]} is not a token id (token ids are integers in [0, 2**31))")
    return ids


def given_options(names: Iterable[str]) -> list[str]:
    """The options among parameter ``names`` that the user gave (command line or environment), each as its
    first flag (``--model``), in the command's order."""
    ctx = click.get_current_context()
    wanted = set(names)
    return [p.opts[0] for p in ctx.command.params if p.name in wanted and p.opts
            and ctx.get_parameter_source(p.name) not in (None, click.core.ParameterSource.DEFAULT)]


def unless_given(name: str, value, fallback):
    """``value`` if the user passed option ``name``, else ``fallback`` (SGLang runs bf16 on CUDA, while the
    options' defaults suit the CPU reference)."""
    given = click.get_current_context().get_parameter_source(name) != click.core.ParameterSource.DEFAULT
    return value if given else fallback
