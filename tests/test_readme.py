"""README.md is a front door whose commands work: every ``refcheck`` command in its bash blocks names a real
command with real options (parsed by the CLI itself, placeholders filled with real files), the cheap ones
run as written and end with the exit code the README gives them, and the page stays within ~200 lines.
The first command (``refcheck diff --budget 15``) runs in tests/test_golden_cli.py; the SGLang ones run on
the GPU machine (tests/test_gpu_sglang_*.py, scripts/gpu_tests.sh)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from refcheck.errors import EXIT_MISMATCH, EXIT_PASS
from refcheck.goldens import REPO_GOLDEN
from refcheck.goldens.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def commands() -> list[list[str]]:
    """Each refcheck command of the README's bash blocks as argv after ``refcheck`` (continuations joined,
    comments dropped; ``scripts/sglang_bundle.sh run python3 -m refcheck`` counts as ``refcheck``)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code = line.split(" #", 1)[0].strip()
            m = re.search(r"(?:^|python3 -m )refcheck (.*)", code)
            if m and not code.startswith("#"):
                out.append(shlex.split(m.group(1)))
    return out


def filled(argv: list[str]) -> list[str]:
    """Placeholders replaced by real inputs: a golden trace for TRACE / TRACE.arrow, a case name for NAME."""
    cases = load_manifest(REPO_GOLDEN).cases
    trace = str(REPO_GOLDEN / cases["attention-b15"].file)  # a correct engine's golden: its diff passes
    return [trace if a in ("TRACE", "TRACE.arrow") else "readme-case" if a == "NAME" else a for a in argv]


def _rest(ctx: click.Context) -> list[str]:
    """A group context's unparsed tokens: the subcommand and its arguments."""
    return [*getattr(ctx, "_protected_args", []), *ctx.args]


def parse(argv: list[str]) -> click.Context:
    """The CLI's own parse of ``argv`` (options, choices, types, required arguments), nothing run."""
    from refcheck.cli import main

    ctx = main.make_context("refcheck", list(argv), resilient_parsing=False)
    group: click.Group = main
    while isinstance(group, click.Group) and _rest(ctx):
        name, *rest = _rest(ctx)
        sub = group.get_command(ctx, name)
        assert sub is not None, f"README: no command {name!r} in {argv}"
        ctx = sub.make_context(name, rest, parent=ctx, resilient_parsing=False)
        group = sub  # type: ignore[assignment]
    return ctx


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    first = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first is not None
    lines = [line for line in first.group(1).splitlines() if line and not line.startswith("#")]
    assert lines == ["./scripts/setup.sh && . .venv/bin/activate && refcheck diff --budget 15",
                     ". .venv/bin/activate && python -m pytest -n auto -q"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -n auto -q" in ci  # CI runs the README's test command
    for page in re.findall(r"`(docs/[\w/.-]+)`", text):
        assert (ROOT / page).exists(), f"README names {page}, which does not exist"


@pytest.mark.parametrize("argv", commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_parses(argv):
    parse(filled(argv))


@pytest.mark.parametrize("argv", [["diff", "--bogus"], ["sweep", "--budgets"], ["golden", "add"], ["nope"]])
def test_the_parse_refuses_what_the_cli_refuses(argv):
    with pytest.raises((click.UsageError, AssertionError)):
        parse(argv)


#: the README commands cheap enough to run here, with the exit code the README gives them
RUN = {("trace", "show", "TRACE.arrow"): EXIT_PASS, ("diff", "--against", "TRACE.arrow"): EXIT_PASS,
       ("diff", "--engine", "fault:sibling-leak", "--budget", "15"): EXIT_MISMATCH}


@pytest.mark.parametrize("argv", sorted(RUN), ids=" ".join)
def test_the_cheap_readme_commands_run_as_written(cli, argv):
    assert list(argv) in commands(), f"README no longer has: refcheck {' '.join(argv)}"
    code, _, err = cli(*filled(list(argv)))
    assert code == RUN[argv] and "Traceback" not in err, err[-600:]
