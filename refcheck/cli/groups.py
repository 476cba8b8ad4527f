"""Typed option groups: one decorator adds a group's click options to a command and hands the command one frozen
dataclass of their values.

Contract: :func:`option_group` makes such a decorator from the group's ``click.option`` decorators. The options
keep their flags, defaults, help texts and parameter names (:func:`refcheck.cli.options.given_options` and
:func:`refcheck.cli.options.unless_given` read those names); the command's callback receives, in place of the
group's parameters, one keyword argument holding the group built from them. A group's fields are its options'
parameter names (a group's builder may map a name, as :meth:`SGLangOptions.from_params` does). A command declares
the options of a group it takes; fields it does not declare keep the dataclass's defaults.

The shared groups: :class:`ModelOptions` and :class:`SamplingOptions` (``diff``, ``sweep``, ``run``, declared here
once), :class:`SGLangOptions` and :class:`ReferenceOptions` (``diff``, ``sweep``), :class:`OutputOptions` (``diff``,
``sweep``, ``calibrate``, ``run``); a command declares its own subset where the commands' options differ. Nothing
here imports a model library: ``--help`` stays light.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from refcheck.cli.options import BudgetType, DeviceType, parse_ids
from refcheck.models import BUILTIN_PAIRS, DEFAULT_PAIR
from refcheck.spec import DRAFTERS, DTYPE_NAMES, EngineSpec

if TYPE_CHECKING:  # ddtree_reference.sampling imports torch: --help must not
    from ddtree_reference.sampling import Sampling

G = TypeVar("G")
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def option_group(dest: str, build: Callable[..., G], *options: Decorator) -> Decorator:
    """A decorator adding ``options`` (``click.option`` decorators, in help order) to a command; its callback gets
    their values as one keyword argument ``dest``: ``build(**values)``, the values keyed by parameter name."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        names: list[str] = []

        @functools.wraps(f)
        def callback(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            return f(*args, **kwargs, **{dest: build(**values)})

        params: list[click.Parameter] = list(getattr(f, "__click_params__", []))  # the options declared below
        callback.__click_params__ = params  # type: ignore[attr-defined]
        known = len(params)
        decorated: Callable[..., Any] = callback
        for option in reversed(options):
            decorated = option(decorated)
        names.extend(str(p.name) for p in params[known:])
        return decorated

    return decorate


@dataclass(frozen=True)
class ModelOptions:
    """The models a command runs and how (``--model`` ... ``--stop``): the settings of its engine spec."""

    model_dir: Path | None = None
    draft_dir: Path | None = None
    pair: str = DEFAULT_PAIR
    prompts_file: Path | None = None
    budget: int | None = 15  # None: chain
    max_new_tokens: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    drafter: str = "dflash"
    stop_ids: str | None = None

    def spec(self, sampling: Sampling | None = None, **changes: Any) -> EngineSpec:
        """The engine spec of these options, ``changes`` (fields of this group) replacing the options' values;
        a malformed ``--stop`` is a usage error."""
        o = replace(self, **changes)
        return EngineSpec(
            model_dir=o.model_dir, draft_dir=o.draft_dir, pair=o.pair, dtype=o.dtype, device=o.device,
            drafter=o.drafter, budget=o.budget, max_new_tokens=o.max_new_tokens, stop_token_ids=parse_ids(o.stop_ids),
            sampling=sampling,
        )

    @property
    def model_label(self) -> str:
        """The target as provenance names it: ``builtin:PAIR`` or the ``--model`` directory."""
        return f"builtin:{self.pair}" if self.model_dir is None else str(self.model_dir)


model_options = option_group(
    "model", ModelOptions,
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
)


@dataclass(frozen=True)
class SamplingOptions:
    """``--temperature`` / ``--top-k`` / ``--top-p`` / ``--seed`` (temperature 0, the default, is greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    sample_seed: int = 0

    def sampling(self) -> Sampling | None:
        """The sampling parameters, or None for greedy; out-of-range values are a SamplingError (exit 2)."""
        from ddtree_reference.sampling import Sampling

        s = Sampling(self.temperature, self.top_k, self.top_p, self.sample_seed)
        return None if s.greedy else s


sampling_options = option_group(
    "sampling", SamplingOptions,
    click.option("--temperature", type=float, default=0.0, show_default=True,
                 help="Sampling temperature; 0 = greedy. > 0: every tree node draws from the tempered target."),
    click.option("--top-k", type=int, default=0, show_default=True, help="Top-k filter at T > 0 (0 = off)."),
    click.option("--top-p", type=float, default=1.0, show_default=True, help="Top-p filter at T > 0, in (0, 1]."),
    click.option("--seed", "sample_seed", type=int, default=0, show_default=True,
                 help="Seed of the keyed sampling generator (Philox keyed by seed, request, position)."),
)


@dataclass(frozen=True)
class SGLangOptions:
    """How a command runs SGLang (``--engine sglang``): the algorithm(s) and the runner's settings."""

    algorithms: tuple[str, ...] = ()
    cuda_graphs: bool = False
    ngram_breadth: int = 10
    tp: int = 1
    max_running: int | None = None
    mem_fraction: float | None = None
    serving: str | None = None
    layer_sketches: bool = False
    capture_sample: str | None = None
    capture_max_mb: int | None = None
    capture_roll: bool = False

    @classmethod
    def from_params(cls, sglang_algorithm: str | None = None, sglang_algorithms: tuple[str, ...] = (),
                    **settings: Any) -> SGLangOptions:
        """The group from its parameters: ``diff``'s one ``--sglang-algorithm`` (``sglang_algorithm``) or
        ``sweep``'s repeatable one (``sglang_algorithms``) is :attr:`algorithms`."""
        return cls(algorithms=(sglang_algorithm,) if sglang_algorithm else tuple(sglang_algorithms), **settings)

    @property
    def algorithm(self) -> str | None:
        """The algorithm of a single run (``diff``); None: the engine name's own."""
        return self.algorithms[0] if self.algorithms else None

    def runner_options(self, settings: object = None) -> dict[str, Any]:
        """The runner options the user gave, keyed as the engine table names them (the others are left to the
        runner's defaults); ``settings``: ``serving`` parsed. ``ngram_breadth`` is the engine kind's to take."""
        given = {"cuda_graphs": self.cuda_graphs or None, "tp": self.tp if self.tp > 1 else None,
                 "mem_fraction": self.mem_fraction, "max_running": self.max_running,
                 "layer_sketches": self.layer_sketches or None, "settings": settings,
                 "capture_sample": self.capture_sample, "capture_max_mb": self.capture_max_mb,
                 "capture_roll": self.capture_roll or None}
        return {k: v for k, v in given.items() if v is not None}


@dataclass(frozen=True)
class ReferenceOptions:
    """The reference that judges an engine: its dtype and device, and the processes it is split over by layers."""

    ref_dtype: str = "float32"
    ref_device: str = "cpu"
    ref_shards: int = 1


@dataclass(frozen=True)
class OutputOptions:
    """What a command prints and writes besides its table: JSON on stdout, the fuller report (``-v``,
    ``--steps``), an HTML page, and the ``--out`` directory with what goes in it."""

    as_json: bool = False
    verbose: bool = False
    steps: bool = False
    html: Path | None = None
    out_dir: Path | None = None
    no_plots: bool = False
    save_traces: bool = False

    @property
    def out(self) -> Path:
        """``--out``, for a command that declares it (required, or with a default)."""
        if self.out_dir is None:
            raise TypeError("this command declares no --out option")
        return self.out_dir


#: ``--json`` of the commands whose stdout is their JSON report
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout.")
