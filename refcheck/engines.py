"""Engines: every name ``--engine`` accepts, and the one interface refcheck drives them through.

Contract: :data:`KINDS` is the table of engine kinds (the only place that knows them): its name
pattern, what it is, the options it takes, the numerics it runs in unless told, and how to open it.
:func:`open_engine` returns an :class:`Engine` — ``name`` and ``trace(prompts) -> Trace`` — whatever
the kind; :func:`check_engine` refuses an unknown name, or an option its kind does not take, with a
:class:`~refcheck.errors.UsageError` that lists what exists, before any process starts.

Kinds: ``reference`` (refcheck's own DDTree decoder), ``fault:NAME`` (the reference decoder with an
injected fault, ``refcheck selftest``'s list and the graded ``KIND:EPS`` faults), ``zlab`` (z-lab's
dflash package) and ``sglang[:ALGORITHM]`` (a real SGLang engine, refcheck's plugin capturing its
steps). Adding an engine (vLLM, say) is one :class:`EngineKind` row and its runner module (tests/stub_engine.py
and ``test_adding_an_engine_is_one_module_and_one_registry_entry`` show one end to end): the diff,
the parallel driver and the CLI take engines from here.

Runner modules are imported only when an engine of their kind is opened (SGLang and z-lab are
optional), never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from refcheck.errors import UsageError

if TYPE_CHECKING:
    from refcheck.pool import ReferencePool
    from refcheck.prompts import Prompt
    from refcheck.spec import EngineSpec
    from refcheck.trace.io import Trace


class Engine(Protocol):
    """What refcheck needs of an engine: a name, and a trace of its decoding of some prompts."""

    name: str

    def trace(self, prompts: list[Prompt]) -> Trace: ...


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: str  # as written in --engine (the part before any ":")
    pattern: str  # how a user writes it
    describe: str
    options: frozenset[str]  # engine options it takes (beyond the spec shared by all)
    dtype: str | None  # the dtype it runs in when --dtype is not given (None: the spec's default)
    device: str | None  # likewise for the device
    opener: Callable[[str, EngineSpec, ReferencePool | None, bool, dict[str, Any]], Engine]
    samples: bool = False  # records runs at temperature > 0 (its draws in the trace)

    def matches(self, engine: str) -> bool:
        return engine.split(":", 1)[0] == self.name


class _DecoderEngine:
    """The reference runner driving one decoder class (the reference's own, or a fault's)."""

    def __init__(self, name: str, cls: type, spec: EngineSpec, pool: ReferencePool | None, full_state: bool) -> None:
        from refcheck.reference_runner import ReferenceRunner

        self.name, self.cls, self.full_state = name, cls, full_state
        # the pool's runner: its models (and its memo of greedy continuations) shared with the judge
        self.runner = pool.runner(spec) if pool is not None else ReferenceRunner(spec)

    def trace(self, prompts: list[Prompt]) -> Trace:
        trace, _ = self.runner.trace(prompts, cls=self.cls, engine=self.name, record_layers=True,
                                     full_state=self.full_state)
        return trace


def fault_decoder(name: str) -> type:
    """The decoder class of ``fault:NAME``'s NAME; UsageError listing the faults when unknown."""
    from refcheck.selftest.faults import find_fault

    found = find_fault(name)
    if found is None:
        raise UsageError(f"unknown engine 'fault:{name}' ({_listing()})")
    return found[0]


def _open_reference(engine: str, spec: EngineSpec, pool: ReferencePool | None, full_state: bool,
                    options: dict[str, Any]) -> Engine:
    from ddtree_reference.decode import DDTreeDecoder

    return _DecoderEngine(engine, DDTreeDecoder, spec, pool, full_state)


def _open_fault(engine: str, spec: EngineSpec, pool: ReferencePool | None, full_state: bool,
                options: dict[str, Any]) -> Engine:
    return _DecoderEngine(engine, fault_decoder(engine.split(":", 1)[1]), spec, pool, full_state)


def _open_zlab(engine: str, spec: EngineSpec, pool: ReferencePool | None, full_state: bool,
               options: dict[str, Any]) -> Engine:
    from refcheck.runners.zlab import ZlabRunner

    return ZlabRunner(spec)


def _open_sglang(engine: str, spec: EngineSpec, pool: ReferencePool | None, full_state: bool,
                 options: dict[str, Any]) -> Engine:
    from refcheck.sglang.runner import SGLangRunner

    algorithm = engine.split(":", 1)[1] if ":" in engine else "NONE"
    return SGLangRunner(spec, algorithm, full_state=full_state, **options)


SGLANG_OPTIONS = frozenset({"cuda_graphs", "ngram_breadth", "tp", "mem_fraction", "max_running", "layer_sketches",
                            "settings", "capture_sample", "capture_max_mb", "capture_roll"})

KINDS: tuple[EngineKind, ...] = (
    EngineKind("reference", "reference", "refcheck's DDTree decoder (the reference itself, run as an engine)",
               frozenset(), None, None, _open_reference, samples=True),
    EngineKind("fault", "fault:NAME", "the reference decoder with an injected fault (refcheck selftest lists them)",
               frozenset(), None, None, _open_fault, samples=True),
    EngineKind("zlab", "zlab", "z-lab's dflash package (chain mode)", frozenset(), None, None, _open_zlab),
    EngineKind("sglang", "sglang[:ALGORITHM]", "a real SGLang engine, its verify steps captured by refcheck's plugin",
               SGLANG_OPTIONS, "bfloat16", "cuda", _open_sglang, samples=True),
)


def _listing() -> str:
    from refcheck.selftest.faults import fault_names

    return ("live engines: " + ", ".join(k.pattern for k in KINDS) + "; faults: "
            + ", ".join(f"fault:{f}" for f in fault_names()) + "; graded faults take any EPS in (0, 1]")


def kind_of(engine: str) -> EngineKind:
    """The kind of an engine name; UsageError (listing every engine) when there is none."""
    head, sep, rest = engine.partition(":")
    for kind in KINDS:
        takes_suffix = kind.pattern != kind.name  # "fault:NAME" must have one, "sglang[:ALGORITHM]" may
        if kind.name == head and (not sep or (takes_suffix and rest)) and (sep or not kind.pattern.startswith(f"{head}:")):
            return kind
    raise UsageError(f"unknown engine {engine!r} ({_listing()})")


def check_engine(engine: str, options: dict[str, Any] | None = None) -> EngineKind:
    """Refuse an unknown engine, an unknown fault, or an option the engine's kind does not take."""
    kind = kind_of(engine)
    if kind.name == "fault":
        fault_decoder(engine.split(":", 1)[1])
    extra = sorted(set(options or {}) - kind.options)
    if extra:
        takers = [k.pattern for k in KINDS if set(extra) <= k.options]
        raise UsageError(f"engine {engine} takes no {', '.join(extra)} option"
                         + (f" (only {' / '.join(takers)} does)" if takers else ""))
    return kind


def open_engine(engine: str, spec: EngineSpec, pool: ReferencePool | None = None, full_state: bool = False,
                options: dict[str, Any] | None = None) -> Engine:
    """An engine ready to trace prompts. ``pool``: a reference pool whose loaded runner the reference and
    fault engines share with the judge (None: a runner of their own); ``full_state``: whole KV / state tensors
    in the trace, not only sketches; ``options``: the kind's own (e.g. SGLang's ``cuda_graphs``)."""
    kind = check_engine(engine, options)
    return kind.opener(engine, spec, pool, full_state, dict(options or {}))
