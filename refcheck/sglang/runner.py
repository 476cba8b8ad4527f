"""The SGLang runner: drive a real ``sglang.Engine`` in-process and capture its verify steps as a trace.

Contract: :class:`SGLangRunner` starts SGLang from local model directories with settings fit for
clean diffs (:func:`engine_kwargs`: token ids in and out, greedy, triton attention, overlap
scheduling and radix cache off, page size 1, CUDA graphs off unless asked), makes refcheck's plugin
(:mod:`refcheck.sglang.plugin`) discoverable by the spawned scheduler processes (an ``sglang.srt.plugins``
entry point in a throw-away ``.dist-info`` on ``sys.path``), points the plugin at a fresh capture directory,
runs the prompt set in one batched ``generate`` and assembles the captured records into a trace
(``refcheck.sglang.capture``); :meth:`SGLangRunner.traces` runs several workloads in turn on one engine (one
start-up), a trace each.

Algorithms: ``NONE`` (target-only; budget 0, root-only steps), ``DFLASH`` (chain verify of the
drafter's block: the budget must be the draft's ``block_size - 1``), ``NGRAM`` (tree verify with no
draft model: ``budget + 1`` draft tokens, BFS breadth ``ngram_breadth``) and any other name a
user's SGLang build registers (captured through the same hooks when it verifies with
``eagle_sample``).

Temperature > 0 (``spec.sampling``): REFCHECK_DDTREE and its twins sample with refcheck's keyed
sampler inside SGLang (the request's seed and request word go in ``custom_params``; the trace's
``rng`` is ``refcheck-philox-position`` and replays exactly); NONE and NGRAM sample with SGLang's own
generator (``rng`` ``engine``: judged by the distributional test). DFLASH at T > 0 is refused
(SGLang falls back to greedy verification where its sampling kernel is missing, and its draws are
not captured).

Errors: no GPU or no SGLang -> :class:`EngineUnavailableError` (exit 2); SGLang failing to start
on the model -> :class:`~refcheck.errors.ModelError` with SGLang's message summarised (exit 6); a
crash during ``generate`` keeps every step captured so far, marks the trace's provenance
``capture.incomplete`` (the diff reports it as a failure) and writes the partial trace next to the
capture records.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from refcheck.errors import ModelError, UsageError
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.capture import dflash_taps, sampler_faults
from refcheck.sglang.ddtree.shadow import SHADOW_BUDGET_ENV
from refcheck.sglang.env import ENV_DIR, ENV_FULL, UNTRACED_RID_PREFIX
from refcheck.sglang.pair import (
    DFLASH_DRAFTED,
    SHADOW,
    check_context,
    checkpoint_config,
    draft_block_size,
    hybrid_config,
    resolve_budget,
    text_config_of,
)
from refcheck.sglang.requests import (
    check_sampling,
    draft_rule,
    missing_hooks,
    request_sampling_params,
    required_hooks,
    sampling_rng,
)
from refcheck.sglang.settings import DEFAULT as DEFAULT_SETTINGS
from refcheck.sglang.settings import ServingSettings, capture_refusal, radix_refusal
from refcheck.trace.io import Trace

PLUGIN_ENTRY = "refcheck = refcheck.sglang.plugin:register"


class EngineUnavailableError(UsageError):
    """SGLang or a GPU is missing: the sglang engine cannot run here."""


def engine_kwargs(spec: EngineSpec, model_path: str, algorithm: str = "NONE", cuda_graphs: bool = False,
                  mem_fraction_static: float = 0.3, budget: int = 0, draft_path: str | None = None,
                  ngram_breadth: int = 10, tp: int = 1, max_running: int | None = None,
                  settings: ServingSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    """The one place that turns refcheck settings into ``sglang.Engine`` arguments (the serving settings'
    own through :meth:`ServingSettings.engine_kwargs`; ``cuda_graphs`` / ``max_running`` are shorthands)."""
    if spec.dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"SGLang runs bfloat16/float16/float32, got {spec.dtype!r}")
    settings = merged_settings(settings, cuda_graphs, max_running)
    kw: dict[str, Any] = dict(
        model_path=model_path,
        skip_tokenizer_init=True,  # token ids in and out: the reference compares ids, not text
        attention_backend="triton",
        sampling_backend="pytorch",
        dtype=spec.dtype,
        mem_fraction_static=mem_fraction_static,
        **settings.engine_kwargs(),  # overlap, radix cache, CUDA graphs, page size (refcheck's default: all off, 1)
    )
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if tp > 1:
        kw["tp_size"] = tp  # every rank's scheduler records its shards; the assembly combines them
    if spec.device.startswith("cuda:"):
        kw["base_gpu_id"] = int(spec.device.split(":", 1)[1]) * tp  # data-parallel workers: tp GPUs each
    if algorithm == "NONE":
        return kw
    kw.update(speculative_algorithm=algorithm, linear_attn_backend="triton")
    if algorithm == "DFLASH":
        kw.update(speculative_draft_model_path=draft_path, speculative_draft_attention_backend="triton")
    elif algorithm == "NGRAM":
        kw.update(speculative_num_draft_tokens=budget + 1, speculative_ngram_max_bfs_breadth=ngram_breadth,
                  speculative_ngram_min_bfs_breadth=1)
    elif algorithm == SHADOW:  # verifies the whole draft block as a chain; its tree's budget travels by environment
        block = draft_block_size(Path(draft_path)) if draft_path else None
        kw.update(speculative_num_draft_tokens=block or budget + 1, speculative_draft_model_path=draft_path)
    else:  # a registered plugin algorithm: it gets the draft model and the budget, reads what it needs
        kw.update(speculative_num_draft_tokens=budget + 1)
        if draft_path:
            kw["speculative_draft_model_path"] = draft_path
    return kw


def merged_settings(settings: ServingSettings, cuda_graphs: bool = False, max_running: int | None = None) -> ServingSettings:
    """``settings`` with the ``--cuda-graphs`` / ``--sglang-max-running`` shorthands folded in."""
    if max_running is not None and max_running < 1:
        raise UsageError(f"--sglang-max-running must be >= 1, got {max_running}")
    if cuda_graphs:
        settings = replace(settings, cuda_graphs=True)
    if max_running is not None:
        settings = replace(settings, max_running=max_running)  # 1: one request at a time (no batching)
    return settings


def install_entry_point(root: Path) -> Path:
    """A minimal distribution that declares refcheck's plugin entry point; its directory goes first
    on ``sys.path`` (spawned schedulers inherit the parent's ``sys.path``) and ``PYTHONPATH``. The distribution's
    name stays fixed, so that a capture directory used again (a matrix cell resumed) has its entry point rewritten,
    never a second one beside it."""
    info = Path(root) / "refcheck_sglang_capture-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: refcheck-sglang-capture\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PLUGIN_ENTRY}\n")
    repo = str(Path(__file__).resolve().parents[2])
    for p in (repo, str(root)):
        if p not in sys.path:
            sys.path.insert(0, p)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), repo] + [p for p in parts if p not in (str(root), repo)])
    return info


def settings_changed(asked: ServingSettings, status: dict[str, Any]) -> list[str]:
    """Where a scheduler serves otherwise than asked (SGLang resolves some settings at start-up, silently):
    the trace would be labelled with settings it was not run under."""
    got = status.get("serving") or {}
    want = {"overlap": asked.overlap, "page_size": asked.page_size, "radix_cache": asked.radix_cache,
            "cuda_graphs": asked.cuda_graphs}
    return [f"scheduler rank {status.get('tp_rank')}: SGLang serves with {name} = {got[name]} although {want[name]} "
            "was asked (changed at its start-up): the trace is not of the settings asked for"
            for name in want if got.get(name) is not None and got[name] != want[name]]


def _sample_rules(capture_sample: str | None, sampled_timing: str | None) -> tuple[Any, Any]:
    """The captured pass's rule and the sampled timing pass's (None: no such pass); a bad rule is a UsageError."""
    from refcheck.sglang.capture.sample_rule import CaptureSampleError, parse

    try:
        return parse(capture_sample), (parse(sampled_timing) if sampled_timing else None)
    except CaptureSampleError as exc:
        raise UsageError(f"--capture-sample: {exc}") from None


def _max_bytes(capture_max_mb: int | None, capture_roll: bool) -> int | None:
    """``--capture-max-mb`` in bytes (None: no bound); out of range, or a roll without it, is a UsageError."""
    from refcheck.sglang.capture.byte_budget import CaptureBudgetError, from_megabytes

    try:
        return from_megabytes(capture_max_mb, capture_roll)
    except CaptureBudgetError as exc:
        raise UsageError(str(exc)) from None


def timing_budget(seconds: float | None) -> float | None:
    """The timing rounds' budget in seconds (None: every round runs; the child starts no round past it once
    :data:`refcheck.sglang.child.MIN_TIMED_ROUNDS` have run); one that is not positive is a UsageError."""
    if seconds is not None and not seconds > 0:
        raise UsageError(f"the timing rounds' budget must be > 0 seconds, got {seconds}")
    return seconds


def timing_until(when: float | None) -> float | None:
    """The wall-clock time (``time.time()`` seconds) by which the timing rounds end (None: no such time; the child
    starts no round that would end past it); one that is not a finite positive number is a UsageError."""
    if when is not None and not (math.isfinite(when) and when > 0):
        raise UsageError(f"the timing rounds' end must be a finite time in seconds since the epoch, got {when}")
    return when


def _check_engine_available() -> None:
    """A CUDA GPU visible and SGLang importable, else an EngineUnavailableError saying what to do."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        raise EngineUnavailableError("the sglang engine needs a CUDA GPU and none is visible here "
                                     "(to diff SGLang on a CPU machine, replay its stored traces: refcheck gate)")
    if importlib.util.find_spec("sglang") is None:
        raise EngineUnavailableError(
            "the sglang engine needs SGLang importable by this Python: pip install sglang (releases 0.5.17 and "
            "0.5.23 are the ones refcheck's hooks were checked against), or your source tree (pip install -e "
            "SGLANG/python, or SGLANG/python on PYTHONPATH); on an offline GPU machine use the bundle: "
            "scripts/sglang_bundle.sh build (with network), then scripts/sglang_bundle.sh run python3 -m refcheck ...")


class SGLangRunner:
    name = "sglang"

    def __init__(self, spec: EngineSpec, algorithm: str = "NONE", cuda_graphs: bool = False, capture: bool = True,
                 ngram_breadth: int = 10, capture_dir: Path | None = None, full_state: bool = False,
                 timeout_s: float = 3600.0, tp: int = 1, layer_sketches: bool = False,
                 mem_fraction: float = 0.3, timing_repeats: int = 0, max_running: int | None = None,
                 settings: ServingSettings = DEFAULT_SETTINGS, warmup: bool = False, capture_sample: str | None = None,
                 sampled_timing: str | None = None, timing_budget_s: float | None = None,
                 full_timing: bool = True, capture_max_mb: int | None = None, capture_roll: bool = False,
                 timing_until_s: float | None = None) -> None:
        self.algorithm = algorithm.upper()
        self.settings = merged_settings(settings, cuda_graphs, max_running)
        self.spec, self.capture, self.ngram_breadth = spec, capture, ngram_breadth
        self.cuda_graphs = self.settings.cuda_graphs
        self.capture_dir, self.full_state, self.timeout_s, self.tp = capture_dir, full_state, timeout_s, tp
        self.layer_sketches = layer_sketches and capture
        why = capture_refusal(self.settings, self.algorithm, self.layer_sketches, tp) or self._engine_refusal(ngram_breadth)
        if why:
            raise UsageError(why)
        # warmup: one untraced generate of the same prompts before the captured one, and one captured whose records
        # are not read, so that the captured run and the timing repeats both find compiled kernels and grown buffers
        # (the capture's overhead is then warm against warm)
        self.warmup = warmup
        if not 0.0 < mem_fraction < 1.0:
            raise UsageError(f"--sglang-mem-fraction must be between 0 and 1, got {mem_fraction}")
        self.mem_fraction = mem_fraction  # SGLang's mem_fraction_static: lower it to run engines side by side
        if timing_repeats < 0:
            raise UsageError(f"timing repeats must be >= 0, got {timing_repeats}")
        self.timing_repeats = timing_repeats  # warm, untraced generates after the captured one (sweep tok/s)
        self.timing_budget_s = timing_budget(timing_budget_s)  # no timing round starts past it
        self.timing_until_s = timing_until(timing_until_s)  # no timing round ends past it (wall clock)
        # the captured pass records 1 batch in N, decode and prefill (full: every one); with a sampled timing rule
        # each timing round also runs a pass under that rule and, with full_timing, a full-capture pass (_cost_passes)
        self.sample, self.sampled_timing = _sample_rules(capture_sample, sampled_timing)
        self.full_timing = full_timing
        self.max_bytes = _max_bytes(capture_max_mb, capture_roll)  # per scheduler process; None: unbounded
        self.roll = capture_roll  # the budget deletes the oldest records to make room, instead of stopping
        tdir, ddir = spec.resolved_dirs()
        cfg = checkpoint_config(tdir)  # the refusals below ask the target's config, read once
        text_cfg = text_config_of(cfg)
        why = radix_refusal(self.settings, str((cfg.get("architectures") or [""])[0]), hybrid_config(text_cfg))
        if why:
            raise UsageError(why)
        self.budget = resolve_budget(self.algorithm, spec.budget, ddir, tdir)
        check_sampling(self.algorithm, spec.sampling)
        if spec.dtype == "float32":
            from refcheck.sglang.capture.versions import float32_refusal, installed_version

            why = float32_refusal(installed_version(), str(text_cfg.get("model_type", "")))
            if why:
                raise UsageError(f"SGLang {installed_version()} cannot run this target in float32: {why}; "
                                 "use --dtype bfloat16")
        _check_engine_available()
        self.last_assembly = None
        self.last_capture: Any = None  # the records the last traces() read, every workload's

    def _engine_refusal(self, ngram_breadth: int) -> str | None:
        """Settings SGLang (or refcheck's own algorithm inside it) refuses at start-up: said before an engine starts."""
        st = self.settings
        if st.overlap and self.algorithm in DFLASH_DRAFTED and self.algorithm != "DFLASH":
            return (f"{self.algorithm} runs synchronously: refcheck's DDTree worker does not implement SGLang's "
                    "overlap scheduler (its deferred results and on-device next inputs); drop 'overlap' from "
                    "--sglang-settings")
        if st.page_size > 1 and self.algorithm == "NGRAM" and ngram_breadth > 1:
            return (f"SGLang refuses NGRAM trees (BFS breadth {ngram_breadth}, i.e. topk > 1) with page size "
                    f"{st.page_size} on the triton attention backend (paged tree attention is only supported on "
                    "flashinfer); use page=1 or --ngram-breadth 1")
        return None

    def trace(self, prompts: list[Prompt]) -> Trace:
        """The prompts run on one engine, captured: :meth:`traces` of one workload."""
        return self.traces([prompts])[0]

    def traces(self, workloads: list[list[Prompt]], part_dirs: list[Path] | None = None) -> list[Trace]:
        """Each workload's trace, the workloads run in turn on one engine (one start-up for all; each with its own
        warm-ups, captured pass and timing rounds, the rounds' end shared among them): the first in the capture
        directory, workload k > 0 in ``part_dirs[k - 1]`` (default: the capture directory's ``part{k}``), each
        directory holding its job and result; the records of every workload lie in the capture directory's
        ``records``, each trace assembled from its own rids. The capture's errors and statistics (lost batches, the
        cost ledger) are the engine's, the same in each trace; a byte budget, being the engine's too, takes one
        workload (a UsageError for more)."""
        from refcheck.sglang.capture.records import Capture, read_capture

        tdir, ddir = self.spec.resolved_dirs()
        for prompts in workloads:
            check_context(prompts, self.spec, tdir)  # before any engine starts: exit 2, not SGLang's error mid-run
        cdir = Path(self.capture_dir or tempfile.mkdtemp(prefix="refcheck-sglang-"))
        if len(workloads) > 1 and self.max_bytes is not None:
            raise UsageError("--capture-max-mb bounds the records of one engine: run one workload on it, not "
                             f"{len(workloads)} (their records would share the budget)")
        dirs = [cdir, *(part_dirs if part_dirs is not None else [cdir / f"part{k}" for k in range(1, len(workloads))])]
        if len(dirs) != len(workloads):
            raise UsageError(f"{len(workloads)} workloads need {len(workloads) - 1} part directories, got {len(dirs) - 1}")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        install_entry_point(cdir / "site")
        records = cdir / "records"
        if records.exists():  # an earlier run's records (a matrix cell resumed): never read as this run's
            shutil.rmtree(records)
        env = self._engine_env(records)
        kw = engine_kwargs(self.spec, str(tdir), self.algorithm, mem_fraction_static=self.mem_fraction, budget=self.budget,
                           draft_path=str(ddir) if ddir else None, ngram_breadth=self.ngram_breadth, tp=self.tp,
                           settings=self.settings)
        self._add_forward_hooks(kw)
        rids = [{p.id: f"refcheck-{os.getpid()}-{f'{k}.' if k else ''}{i}-{p.id}" for i, p in enumerate(prompts)}
                for k, prompts in enumerate(workloads)]
        runs = self._run_engine(cdir, env, kw, list(zip(dirs, workloads, rids)))
        for run in runs:
            if run.get("failed_at") in ("import", "start"):
                raise ModelError(f"SGLang could not start on {tdir} ({self.algorithm}): {run.get('error')} "
                                 f"(full log: {cdir / 'engine.log'})")
        cap = read_capture(records) if self.capture else Capture()
        self.last_capture = cap
        return [self._assembled(prompts, part_rids, run, cap, kw, d, tdir, ddir)
                for d, prompts, part_rids, run in zip(dirs, workloads, rids, runs)]

    def _assembled(self, prompts: list[Prompt], rids: dict[str, str], run: dict[str, Any], cap: Any,
                   kw: dict[str, Any], part_dir: Path, tdir: Path, ddir: Path | None) -> Trace:
        """One workload's trace from the engine's records (its rids'), its provenance from its part's ``run`` and the
        pair's directories; a crash or an incomplete capture also writes the partial trace into ``part_dir``."""
        from refcheck.sglang.capture.assemble import assemble_trace
        from refcheck.trace.io import write_trace

        results = {p.id: {"output_ids": o} for p, o in zip(prompts, run.get("outputs") or [])}
        crash = None if run.get("stage") == "done" else (run.get("error") or "the engine process died mid-run")
        prov = self._provenance(prompts, kw, run, tdir, ddir)
        asm = assemble_trace(prompts, rids, results, cap, prov, self.spec.sampling if self.spec.sampled else None,
                             sampling_rng(self.algorithm), overlap=self.settings.overlap)
        prov["capture"] = self._capture_provenance(cap, asm, crash)
        self._warn_if_drafter_missing(asm)
        self.last_assembly = asm
        if crash or asm.incomplete:
            write_trace(asm.trace, part_dir / "partial.arrow")
            prov["capture"]["partial_trace"] = str(part_dir / "partial.arrow")
        return asm.trace

    def _engine_env(self, records: Path) -> dict[str, str]:
        """The engine process's environment: this one's, with the capture's variables set for this run only."""
        from refcheck.sglang.capture.byte_budget import ENV_MAX_BYTES, ENV_ROLL
        from refcheck.sglang.capture.sample_rule import ENV_SAMPLE

        env = dict(os.environ)
        for name in (ENV_DIR, ENV_FULL, ENV_SAMPLE, ENV_MAX_BYTES, ENV_ROLL):
            env.pop(name, None)
        if self.capture:
            env[ENV_DIR] = str(records)
            if not self.sample.full:
                env[ENV_SAMPLE] = self.sample.to_env()
            if self.max_bytes is not None:
                env[ENV_MAX_BYTES] = str(self.max_bytes)
            if self.roll:
                env[ENV_ROLL] = "1"
        if self.full_state:
            env[ENV_FULL] = "1"
        if self.algorithm == SHADOW:
            env[SHADOW_BUDGET_ENV] = str(self.budget)
        return env

    def _provenance(self, prompts: list[Prompt], kw: dict[str, Any], run: dict[str, Any], tdir: Path,
                    ddir: Path | None) -> dict[str, Any]:
        """The trace's provenance before the capture's part (models, settings, budget, block size, prompt set)."""
        from refcheck.prompts import prompt_set_hash
        from refcheck.provenance import build_provenance

        drafted = self.algorithm in DFLASH_DRAFTED
        return build_provenance(
            engine="sglang", engine_version=str(run.get("sglang", "unknown")), settings=self._settings(kw, run, ddir),
            model_dir=tdir, draft_dir=ddir if drafted else None, dtype=self.spec.dtype,
            device="cuda", budget=self.budget, max_new_tokens=self.spec.max_new_tokens,
            block_size=(draft_block_size(ddir) or self.budget + 1) if drafted else self.budget + 1,
            drafter="dflash" if drafted else "none", prompt_set_sha256=prompt_set_hash(prompts),
            model_label=self.spec.model_label)

    def _warn_if_drafter_missing(self, asm: Any) -> None:
        """A DFLASH-drafted run whose drafter side was not captured: its draft checks will be unsupported."""
        if asm.stats.get("draft_not_captured") or (self.algorithm in DFLASH_DRAFTED and not asm.stats.get("draft_steps")
                                                     and asm.stats.get("steps")):
            logging.getLogger("refcheck.progress").warning(
                "%s: the drafter inside SGLang was not captured (%s); its draft checks are reported unsupported",
                self.algorithm, asm.stats.get("draft_not_captured") or "no step carried its drafter's side")

    def _capture_provenance(self, cap: Any, asm: Any, crash: str | None) -> dict[str, Any]:
        """The trace's ``capture`` provenance (:func:`~refcheck.sglang.capture.assemble.capture_provenance`)."""
        from refcheck.sglang.capture.assemble import capture_provenance

        return capture_provenance(cap, asm, crash, self._hook_errors(cap), self.sample.to_json(), self.max_bytes,
                                  enabled=self.capture, roll=self.roll)

    def _add_forward_hooks(self, kw: dict[str, Any]) -> None:
        """SGLang ``forward_hooks``: per-layer sketches (layer bisection, slower) and the GDN probe (a diagnostic of
        the kernels' exact inputs and outputs per verify, when its directory is set)."""
        from refcheck.sglang.capture import gdn_probe

        if self.layer_sketches:
            from refcheck.sglang.capture.layers import SPEC

            kw["forward_hooks"] = [SPEC]
        if os.environ.get(gdn_probe.ENV_DIR):
            kw["forward_hooks"] = [*kw.get("forward_hooks", []), gdn_probe.spec()]

    def _settings(self, kw: dict, run: dict, ddir: Path | None) -> dict[str, Any]:
        """The provenance's engine settings: SGLang's arguments (paths left out) and how the run went."""
        settings = {k: v for k, v in kw.items() if k not in ("model_path", "speculative_draft_model_path")}
        settings.update(algorithm=self.algorithm, pair=self.spec.pair, stop_token_ids=sorted(self.spec.stop_token_ids),
                        engine_start_s=round(run.get("start_s") or 0.0, 2),
                        generate_s=round(run.get("generate_s") or 0.0, 4), drain_s=run.get("drain_s"),
                        repeat_generate_s=[round(t, 4) for t in run.get("repeat_generate_s") or []],
                        repeats_match=run.get("repeats_match"), tree_rules="structural",
                        serving=self.settings.to_json(), serving_label=self.settings.label(),
                        warmup_generate_s=run.get("warmup_generate_s"), warmup_match=run.get("warmup_match"),
                        untraced_diffs=run.get("untraced_diffs") or {},
                        sampled_generate_s=[round(t, 4) for t in run.get("sampled_generate_s") or []],
                        sampled_match=run.get("sampled_match"),
                        full_generate_s=[round(t, 4) for t in run.get("full_generate_s") or []],
                        full_match=run.get("full_match"), round_match=run.get("round_match") or {},
                        round_mismatch=run.get("round_mismatch") or {},
                        capture_behind=run.get("capture_behind") or {},
                        pass_costs=run.get("pass_costs") or {},
                        **({"sampling": self.spec.sampling.to_json(), "rng": sampling_rng(self.algorithm)}
                           if self.spec.sampled and self.spec.sampling is not None else {}),
                        # a fault injected into SGLang's tree sampler (refcheck/sglang/capture/sampler_faults.py)
                        **({"sampler_fault": fault} if (fault := sampler_faults.active()) else {}),
                        # a fault injected into SGLang's DFLASH drafter (refcheck/sglang/capture/dflash_taps.py)
                        **({"draft_fault": dfault} if (dfault := dflash_taps.active()) else {}),
                        draft_rule=draft_rule(self.algorithm), **({"shadow_budget": self.budget}
                                                                   if self.algorithm == SHADOW else {}),
                        draft_dir=str(ddir) if ddir and self.spec.model_dir is not None else None)
        return settings

    def _cost_passes(self, prompts: list[Prompt], rids: dict[str, str]) -> dict[str, list[list[str]]]:
        """With a sampled timing rule (capture only): per timing round, a pass under the rule and, with
        ``full_timing``, a full-capture pass, each under rids of its own (the child interleaves them with the untraced
        ones; their records are written but not assembled: the trace is the captured pass's)."""
        from refcheck.sglang.capture.sample_rule import SampleRule, sampled_rid

        if self.sampled_timing is None or not self.capture:
            return {}
        rounds = range(max(1, self.timing_repeats))
        return {"sampled_rids": [[sampled_rid(self.sampled_timing, f"timing{k}-{rids[p.id]}") for p in prompts]
                                 for k in rounds],
                "full_rids": [[sampled_rid(SampleRule(), f"full{k}-{rids[p.id]}") for p in prompts]
                              for k in range(self.timing_repeats if self.full_timing else 0)]}

    def _job(self, prompts: list[Prompt], rids: dict[str, str], result: Path) -> dict[str, Any]:
        """One workload's part of the engine's job (refcheck/sglang/child.py): its requests, rids, passes, result."""
        from refcheck.sglang.capture.sample_rule import SampleRule, sampled_rid

        return {
            "result": str(result), "input_ids": [list(p.prompt_ids) for p in prompts],
            "rids": [rids[p.id] for p in prompts],
            "timing_rids": [[f"{UNTRACED_RID_PREFIX}{k}-{rids[p.id]}" for p in prompts] for k in range(self.timing_repeats)],
            "sampling_params": [request_sampling_params(p, self.spec, self.algorithm) for p in prompts],
            "stagger_s": self.settings.stagger_ms / 1000.0,
            "warmup_rids": [f"{UNTRACED_RID_PREFIX}warm-{rids[p.id]}" for p in prompts] if self.warmup else [],
            "capture_warm_rids": [sampled_rid(SampleRule(), f"warm-{rids[p.id]}") for p in prompts]
            if self.warmup and self.capture else [],
            "timing_budget_s": self.timing_budget_s, "timing_until": self.timing_until_s,
            **self._cost_passes(prompts, rids)}

    def _run_engine(self, cdir: Path, env: dict, kw: dict,
                    parts: list[tuple[Path, list[Prompt], dict[str, str]]]) -> list[dict]:
        """SGLang in its own process (:func:`~refcheck.sglang.engine_process.run_job`), the parts (directory,
        prompts, rids) run in turn on it; returns each part's last reported stage."""
        from refcheck.sglang.engine_process import run_job

        return run_job(cdir, env, kw, [(d, self._job(prompts, rids, d / "result.json")) for d, prompts, rids in parts],
                       self.timeout_s)

    def _hook_errors(self, cap) -> list[str]:
        if not self.capture:
            return []
        out = missing_hooks(cap.status, required_hooks(self.algorithm, self.spec.sampled))
        for st in cap.status:
            out += settings_changed(self.settings, st)
        return out
