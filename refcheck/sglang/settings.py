"""How SGLang is served while refcheck captures it: the production settings, parsed once, typed.

Contract: :class:`ServingSettings` is the part of an SGLang run that changes *how* the engine
schedules and stores a request, not *what* it computes: CUDA graphs, the overlap scheduler, the
radix (prefix) cache, the KV page size, the chunked-prefill size, a cap on running requests and the
arrival of requests (all at once, or one every ``stagger_ms``). :func:`parse_settings` reads the
comma list a user writes (``--sglang-settings graphs,overlap,radix,page=16,chunk=1024,stagger=20``;
``default`` or empty: refcheck's safest corner) and refuses unknown or malformed items with the list
of known ones (exit 2). :meth:`ServingSettings.engine_kwargs` is the only place these turn into
``sglang.Engine`` arguments; :meth:`ServingSettings.label` is the canonical text back (the matrix's
row name, the trace's provenance). :func:`capture_refusal` names a setting the capture cannot observe
correctly, for the runner to refuse before any engine starts.

What the capture does under each setting (docs/sglang-capture.md, "Production settings"): it
synchronises the device around every scheduler step, so under ``overlap`` it checks the overlap
scheduler's bookkeeping (deferred result processing, tokens carried on the device between steps)
but cannot see races between the schedule and forward streams that only a truly concurrent step
would expose; committed lengths and roots are read from the forward batch on the device, which
stays right when the scheduler's per-request lists lag one step behind.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from refcheck.errors import UsageError

#: user-facing item -> (field, kind): kind "flag" takes no value, "int" an integer >= its minimum
_ITEMS: dict[str, tuple[str, str, int]] = {
    "graphs": ("cuda_graphs", "flag", 0),
    "overlap": ("overlap", "flag", 0),
    "radix": ("radix_cache", "flag", 0),
    "page": ("page_size", "int", 1),
    "chunk": ("chunked_prefill", "int", 16),
    "running": ("max_running", "int", 1),
    "stagger": ("stagger_ms", "int", 0),
}
#: SGLang's page sizes the capture was read against (its allocators take powers of two)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class ServingSettings:
    cuda_graphs: bool = False
    overlap: bool = False
    radix_cache: bool = False
    page_size: int = 1
    chunked_prefill: int | None = None  # SGLang's chunked_prefill_size; None: SGLang's default
    max_running: int | None = None  # max_running_requests; None: SGLang's default (48 with speculation)
    stagger_ms: int = 0  # requests arrive one every stagger_ms (0: all in one generate call)

    def engine_kwargs(self) -> dict[str, Any]:
        """The ``sglang.Engine`` arguments of these settings (the rest come from the runner)."""
        kw: dict[str, Any] = dict(disable_overlap_schedule=not self.overlap, disable_radix_cache=not self.radix_cache,
                                  disable_cuda_graph=not self.cuda_graphs, page_size=self.page_size)
        if self.chunked_prefill is not None:
            kw["chunked_prefill_size"] = self.chunked_prefill
        if self.max_running is not None:
            kw["max_running_requests"] = self.max_running
        return kw

    def label(self) -> str:
        """The canonical comma list (``default`` for the safest corner), parseable by :func:`parse_settings`."""
        items = []
        for name, (attr, kind, _) in _ITEMS.items():
            value = getattr(self, attr)
            if kind == "flag" and value:
                items.append(name)
            elif kind == "int" and value != getattr(DEFAULT, attr) and value is not None:
                items.append(f"{name}={value}")
        return ",".join(items) or "default"

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT = ServingSettings()


def parse_settings(text: str | None, base: ServingSettings = DEFAULT) -> ServingSettings:
    """``graphs,overlap,radix,page=16,chunk=1024,running=8,stagger=20`` -> settings over ``base``."""
    out = base
    for raw in (text or "").split(","):
        item = raw.strip().lower()
        if not item or item == "default":
            continue
        name, _, value = item.partition("=")
        known = ", ".join(f"{k}=N" if v[1] == "int" else k for k, v in _ITEMS.items())
        if name not in _ITEMS:
            raise UsageError(f"unknown SGLang setting {raw.strip()!r} (known: {known}, or default)")
        attr, kind, minimum = _ITEMS[name]
        if kind == "flag":
            if value:
                raise UsageError(f"SGLang setting {name!r} takes no value (got {raw.strip()!r})")
            out = replace(out, **{attr: True})
            continue
        try:
            number = int(value)
        except ValueError:
            raise UsageError(f"SGLang setting {name!r} needs an integer: {name}=N (got {raw.strip()!r})") from None
        if number < minimum:
            raise UsageError(f"SGLang setting {name}={number}: must be >= {minimum}")
        if name == "page" and number not in PAGE_SIZES:
            raise UsageError(f"SGLang setting page={number}: SGLang's page sizes are powers of two "
                             f"({', '.join(map(str, PAGE_SIZES))})")
        out = replace(out, **{attr: number})
    return out


#: SGLang 0.5.17's architectures whose hybrid radix cache can keep the mamba state in an extra buffer
#: (sglang/srt/arg_groups/overrides.py, ``_MAMBA_EXTRA_BUFFER_ARCHS``; with the triton linear-attention backend)
MAMBA_EXTRA_BUFFER_ARCHS = frozenset({
    "KimiLinearForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM", "InternS2PreviewForConditionalGeneration", "MiniCPMV4_6ForConditionalGeneration",
    "BailingMoeV2_5ForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM"})


def radix_refusal(settings: ServingSettings, architecture: str, hybrid: bool) -> str | None:
    """Why the radix cache cannot be captured as asked on a hybrid target, or None.

    SGLang 0.5.17 resolves a hybrid target's radix cache at start-up: with overlap or pages > 1 it keeps the
    mamba state in an extra buffer where the architecture allows it, and otherwise uses no buffer, which
    asserts page size 1 and turns the overlap scheduler off without a word. Neither run is the one asked for
    under the capture: the first keeps the committed state in ping-pong track slots the capture does not read,
    the second is not overlapped (or does not start)."""
    if not (hybrid and settings.radix_cache and (settings.overlap or settings.page_size > 1)):
        return None
    asked = " and ".join(x for x in ("overlap" if settings.overlap else "",
                                     f"page={settings.page_size}" if settings.page_size > 1 else "") if x)
    if architecture in MAMBA_EXTRA_BUFFER_ARCHS:
        return (f"radix with {asked} on this hybrid target ({architecture}): SGLang keeps the mamba state in its "
                "extra buffer (ping-pong track slots), which refcheck's capture does not read; run the radix cache "
                "with page=1 and without overlap, or the other settings without radix")
    return (f"radix with {asked} on this hybrid target ({architecture}): SGLang 0.5.17 has no mamba extra buffer "
            "for this architecture, so its radix cache needs page size 1 (it refuses to start otherwise) and turns "
            "the overlap scheduler off (the run would not be overlapped); run the radix cache with page=1 and "
            "without overlap, or the other settings without radix")


def capture_refusal(settings: ServingSettings, algorithm: str, layer_sketches: bool, tp: int) -> str | None:
    """Why the capture cannot observe this run correctly, or None. Checked before any engine starts."""
    if layer_sketches and settings.cuda_graphs:
        # the sketches come from module hooks, which a CUDA graph replay does not run: a graphed step would
        # carry no sketch, or a stale one of an eager forward of the same shape
        return ("--layer-sketches cannot be captured under --cuda-graphs (a graph replay runs no module hooks, so its "
                "per-layer outputs are not observable); drop one of the two")
    return None
