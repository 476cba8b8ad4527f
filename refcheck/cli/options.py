"""Options shared by the commands that run models, and the engine spec built from them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from refcheck.errors import UsageError
from refcheck.models import BUILTIN_PAIRS, DEFAULT_PAIR
from refcheck.spec import DRAFTERS, DTYPE_NAMES, EngineSpec

if TYPE_CHECKING:  # reference.sampling imports torch: --help must not
    from reference.sampling import Sampling


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


def model_options(f):
    """Options shared by every command that runs models."""
    opts = [
        click.option("--model", "model_dir", type=click.Path(path_type=Path), help="Target checkpoint directory (default: built-in)."),
        click.option("--draft", "draft_dir", type=click.Path(path_type=Path), help="DFlash draft checkpoint directory."),
        click.option("--pair", type=click.Choice(BUILTIN_PAIRS), default=DEFAULT_PAIR, show_default=True, help="Built-in model pair."),
        click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), help="Prompts JSONL, one object a line with \"prompt_ids\" (token ids), \"prompt\" (text) or "
                     "\"messages\" (chat); text is tokenized with the --model directory's own tokenizer (default: the "
                     "built-in prompts)."),
        click.option("--budget", type=BudgetType(), default="15", show_default=True, help="Node budget B, or 'chain'."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True),
        click.option("--dtype", type=click.Choice(list(DTYPE_NAMES)), default="float32", show_default=True),
        click.option("--device", type=DeviceType(), default="cpu", show_default=True),
        click.option("--drafter", type=click.Choice(DRAFTERS), default="dflash", show_default=True,
                     help="'scripted' = the target's own continuation with decoys (testing)."),
        click.option("--stop", "stop_ids", default=None, help="Comma-separated stop token ids."),
        click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f

def sampling_options(f):
    """--temperature / --top-k / --top-p / --seed (temperature 0, the default, is greedy decoding)."""
    opts = [
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="Sampling temperature; 0 = greedy. > 0: every tree node draws from the tempered target."),
        click.option("--top-k", type=int, default=0, show_default=True, help="Top-k filter at T > 0 (0 = off)."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Top-p filter at T > 0, in (0, 1]."),
        click.option("--seed", "sample_seed", type=int, default=0, show_default=True,
                     help="Seed of the keyed sampling generator (Philox keyed by seed, request, position)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def sampling_from_options(temperature: float, top_k: int, top_p: float, sample_seed: int) -> Sampling | None:
    """The sampling parameters, or None for greedy; out-of-range values are a SamplingError (exit 2)."""
    from reference.sampling import Sampling

    s = Sampling(temperature, top_k, top_p, sample_seed)
    return None if s.greedy else s


def spec_from_options(model_dir, draft_dir, pair, budget, max_new_tokens, dtype, device, drafter, stop_ids,
                      sampling: Sampling | None = None) -> EngineSpec:
    return EngineSpec(
        model_dir=model_dir, draft_dir=draft_dir, pair=pair, dtype=dtype, device=device, drafter=drafter,
        budget=budget, max_new_tokens=max_new_tokens, stop_token_ids=parse_ids(stop_ids), sampling=sampling,
    )


def unless_given(name: str, value, fallback):
    """``value`` if the user passed option ``name``, else ``fallback`` (SGLang runs bf16 on CUDA, while the
    options' defaults suit the CPU reference)."""
    given = click.get_current_context().get_parameter_source(name) != click.core.ParameterSource.DEFAULT
    return value if given else fallback
