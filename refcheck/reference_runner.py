"""The reference, loaded and run: the pure-PyTorch DDTree decoder on a target + drafter pair.

Not one of ``refcheck/runners/`` (the engines under test): the diff runs it as the reference side of
every comparison, and the engine table runs it as the ``reference`` and ``fault:NAME`` engines.

Contract: :class:`EngineSpec` says what to run (model and draft directories, dtype, device,
drafter kind, budget, token limits); :func:`load_pair` turns it into a
:class:`~ddtree_reference.target.Target` and a drafter, with refcheck's typed errors for bad input;
:class:`ReferenceRunner` decodes a prompt set and, with ``check_ar``, also the target-only greedy
oracle for each prompt.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig, DecodeResult
from ddtree_reference.drafter import DFlashDrafter, Drafter
from ddtree_reference.oracle import GreedyMemo, greedy_decode, sample_decode
from ddtree_reference.sampling import request_key
from ddtree_reference.scripted import ScriptedDrafter
from ddtree_reference.target import Target
from ddtree_reference.tree import TreeError
from refcheck import model_checks
from refcheck.errors import NonFiniteError, UsageError
from refcheck.progress import Progress, tell
from refcheck.prompts import Prompt, prompt_set_hash
from refcheck.provenance import build_provenance
from refcheck.spec import DRAFTERS, DTYPE_NAMES, EngineSpec  # noqa: F401 - re-exported: runners take a spec
from refcheck.trace.io import Trace
from refcheck.trace.record import request_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_pair(spec: EngineSpec) -> tuple[Target, Drafter]:
    _quiet_transformers()
    if spec.dtype not in DTYPES:
        raise UsageError(f"unknown dtype {spec.dtype!r} (choose from {', '.join(DTYPES)})")
    model_checks.check_device(spec.device)
    if spec.drafter not in DRAFTERS:
        raise UsageError(f"unknown drafter {spec.drafter!r} (choose from {', '.join(DRAFTERS)})")
    tdir, ddir = spec.resolved_dirs()
    model_checks.check_safetensors(tdir, "target")
    target = Target.load(tdir, dtype=DTYPES[spec.dtype], device=spec.device)
    model_checks.check_finite_weights(target.model, f"target model {tdir}")
    model_checks.check_budget(spec.budget, target.max_positions, target.hidden_size, target.vocab_size,
                              len(target.layers), target.dtype.itemsize, spec.device)
    if spec.drafter == "scripted":
        mask = target.vocab_size - 1
        # The scripted drafter's truth is the target's greedy continuation; a memo of it on the same
        # weights gives the same tokens with each distinct prefix's forward run once (the drafter is
        # never called while the rounding ensemble's hooks are on the model).
        return target, ScriptedDrafter(target.model, target.vocab_size, mask, seed=spec.seed,
                                       oracle=GreedyMemo(target.model))
    if ddir is None:
        raise UsageError("--model given without --draft: a DFlash drafter needs its checkpoint directory")
    model_checks.check_draft_for_target(ddir, len(target.layers), target.hidden_size, target.vocab_size)
    model_checks.check_safetensors(ddir, "draft")
    drafter = DFlashDrafter.load(ddir, target)
    model_checks.check_finite_weights(drafter, f"draft model {ddir}")
    return target, drafter


@dataclass(slots=True)
class PromptRun:
    prompt: Prompt
    result: DecodeResult
    greedy: list[int] | None = None  # target-only greedy output, when checked

    @property
    def ar_match(self) -> bool | None:
        return None if self.greedy is None else self.result.output_ids == self.greedy

    @property
    def first_ar_mismatch(self) -> int | None:
        if self.greedy is None or self.ar_match:
            return None
        out = self.result.output_ids
        return next((i for i, (a, b) in enumerate(zip(out, self.greedy)) if a != b), min(len(out), len(self.greedy)))


@contextlib.contextmanager
def _non_finite_named(prompt_id: str):
    """A tree builder refusing NaN / +inf draft scores mid-decode -> NonFiniteError naming the prompt."""
    try:
        yield
    except TreeError as exc:
        if "NaN" not in str(exc) and "inf" not in str(exc):
            raise
        raise NonFiniteError(f"prompt {prompt_id}: non-finite log-probs while decoding ({exc})") from None


class ReferenceRunner:
    name = "reference"

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.target, self.drafter = load_pair(spec)

    def decoder(self, max_new_tokens: int, cls: type[DDTreeDecoder] = DDTreeDecoder, record: bool = False,
                record_layers: bool = False) -> DDTreeDecoder:
        cfg = DecodeConfig(budget=self.spec.budget, max_new_tokens=max_new_tokens, stop_token_ids=self.spec.stop_token_ids,
                           keep_states=record, keep_layers=record_layers,
                           sampling=self.spec.sampling if self.spec.sampled else None)
        return cls(self.target, self.drafter, cfg)

    def generate(self, decoder: DDTreeDecoder, prompt: Prompt) -> DecodeResult:
        """Decode one prompt; when sampling, its draws are keyed by the prompt id (``request_key``)."""
        if self.spec.sampled:
            return decoder.generate(list(prompt.prompt_ids), request=request_key(prompt.id))
        return decoder.generate(list(prompt.prompt_ids))

    def provenance(self, prompts: list[Prompt], engine: str = "reference", settings: dict | None = None) -> dict:
        tdir, ddir = self.spec.resolved_dirs()
        return build_provenance(
            engine=engine, engine_version=__import__("refcheck").__version__,
            settings={"pair": self.spec.pair, "seed": self.spec.seed, "stop_token_ids": sorted(self.spec.stop_token_ids),
                      # your own pair: the draft as given, so a diff or the gate can load it again (like SGLang's)
                      **({"draft_dir": str(ddir)} if self.spec.model_dir is not None and ddir is not None else {}),
                      **({"sampling": self.spec.sampling.to_json()} if self.spec.sampled else {}), **(settings or {})},
            model_dir=tdir, draft_dir=ddir if self.spec.drafter == "dflash" else None, dtype=self.spec.dtype,
            device=self.spec.device, budget=self.spec.budget, block_size=self.drafter.block_size,
            max_new_tokens=self.spec.max_new_tokens, drafter=self.spec.drafter, prompt_set_sha256=prompt_set_hash(prompts),
            model_label=self.spec.model_label,
        )

    def trace(self, prompts: list[Prompt], cls: type[DDTreeDecoder] = DDTreeDecoder, engine: str = "reference",
              record_layers: bool = False, full_state: bool = False) -> tuple[Trace, dict[str, DecodeResult]]:
        """Decode every prompt and record a trace (state sketches always; layer sketches on request)."""
        requests, steps, results = [], [], {}
        for prompt in prompts:
            max_new = prompt.max_new_tokens or self.spec.max_new_tokens
            with _non_finite_named(prompt.id):
                result = self.generate(self.decoder(max_new, cls, record=True, record_layers=record_layers), prompt)
            req, rows = request_rows(prompt.id, prompt.kind, result, full_state,
                                     self.spec.sampling if self.spec.sampled else None, self.spec.dtype,
                                     prompt.max_new_tokens)
            requests.append(req)
            steps += rows
            results[prompt.id] = result
        return Trace(provenance=self.provenance(prompts, engine), requests=requests, steps=steps), results

    def run(
        self,
        prompts: list[Prompt],
        check_ar: bool = False,
        progress: Progress | None = None,
    ) -> list[PromptRun]:
        runs = []
        for i, prompt in enumerate(prompts):
            tell(progress, f"[{i + 1}/{len(prompts)}] {prompt.id}")
            max_new = prompt.max_new_tokens or self.spec.max_new_tokens
            with _non_finite_named(prompt.id):
                result = self.generate(self.decoder(max_new), prompt)
            greedy = None
            if check_ar and self.spec.sampled:  # the lossless oracle at T > 0: target-only sampling, same keys
                greedy = sample_decode(self.target.model, list(prompt.prompt_ids), max_new, self.spec.sampling,
                                       request_key(prompt.id), self.spec.stop_token_ids)[0]
            elif check_ar:
                greedy = greedy_decode(self.target.model, list(prompt.prompt_ids), max_new, self.spec.stop_token_ids)
            runs.append(PromptRun(prompt, result, greedy))
        return runs
