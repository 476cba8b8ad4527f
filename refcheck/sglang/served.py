"""A capture of a serving run refcheck did not start -> a refcheck trace the diff judges.

Contract: an SGLang server started with refcheck installed (its plugin entry point) and ``REFCHECK_CAPTURE_DIR`` set
(with ``REFCHECK_CAPTURE_SAMPLE`` and ``REFCHECK_CAPTURE_MAX_BYTES`` for a run left on) writes a capture directory
that describes itself: each scheduler's status file keeps the server's arguments
(:func:`refcheck.sglang.capture.versions.server_of`), and each record the context tokens and first sampling parameters
of its requests (:mod:`refcheck.sglang.capture.contexts`). :func:`served_trace` reads such a directory: every request
with a recorded step or first token becomes a request of the trace, its id the engine's rid, its prompt and output
those its records carry (the output up to the step recorded where its carried context ends, that step's emitted
tokens included, cut at the request's ``max_new_tokens`` as SGLang cuts it; each request's token limit in the trace
is the length of that output, so a free run compares as many greedy tokens), and the
trace's provenance comes from the server's arguments: the model and draft directories (``model_dir`` / ``draft_dir``
in place of the server's paths, which must be local checkpoint directories), the algorithm, the budget, the dtype
and how SGLang served. A hook the algorithm records through that a scheduler's status says was not live is a capture
error, as in a driven run.

The trace holds one sampling setting, as every trace does: the greedy requests (SGLang's ``top_k == 1``) when there
are any, else the largest group of one temperature, top-k and top-p. Requests refcheck's reference cannot judge are
left out and counted by reason (:attr:`Served.left_out`, also in the trace's ``engine.settings.left_out``): another
sampling setting; penalties, a logit bias, ``min_p``, ``min_new_tokens`` or a grammar (they change the target's
distribution); no sampling parameters in their records (their first record was not written). Requests a scheduler
met that no record read holds are counted too (:data:`UNRECORDED`, from the schedulers' ledgers), so a sampled trace
says how many of the server's requests it does not hold. A request whose context has a hole (a record between was
not written) keeps the steps before it. A directory that is not a capture, or one whose server or models cannot be
read, is a :class:`ServedCaptureError` (exit 2).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ddtree_reference.errors import SamplingError
from ddtree_reference.sampling import Sampling
from refcheck.prompts import Prompt
from refcheck.sglang.capture.assemble import Assembly, assemble_trace, capture_contexts, capture_provenance
from refcheck.sglang.capture.contexts import LOOKS, Contexts
from refcheck.sglang.capture.inventory import CaptureDirError, check_capture_dir
from refcheck.sglang.capture.records import Capture, read_capture
from refcheck.sglang.capture.steps import StepCapture
from refcheck.sglang.ddtree.sampling import distribution_of, is_greedy, unsupported
from refcheck.sglang.pair import DFLASH_DRAFTED, checkpoint_config, draft_block_size, text_config_of
from refcheck.sglang.requests import keyed, missing_hooks, required_hooks, sampling_rng

#: beyond what :func:`refcheck.sglang.ddtree.sampling.unsupported` names, what changes a served request's distribution
#: or prompt in ways the reference does not model, with its neutral value: a minimum length (its end of sequence
#: masked until then), a grammar, and the request's own looks (``contexts.LOOKS``: a LoRA adapter, a custom logit
#: processor, embeddings or images for a prompt, overridden positions; SGLang's abort stub)
_CONSTRAINTS = {"min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
                **dict.fromkeys(LOOKS), "aborted": False}


#: why a request the schedulers met is not in the trace when no record read holds it: the sampling rule passed over
#: each of its batches (a request that ends at its prefill has one), or its records were lost, past the byte budget,
#: rolled out or not read
UNRECORDED = "no batch of it in the records read"


class ServedCaptureError(CaptureDirError):
    """A capture directory that cannot be read as a serving run's capture."""


@dataclass
class Served:
    assembly: Assembly
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> requests left out of the trace
    state_not_judged: str | None = None  # why the trace carries no state (its state checks then say unsupported)


def state_unread(server: dict[str, Any], serving: dict[str, Any]) -> str | None:
    """Why a server's recurrent state cannot be read as the capture reads it, or None: a hybrid target's radix cache
    with the mamba extra buffer (SGLang's choice under overlap or pages > 1 where the architecture has one) keeps the
    state in ping-pong track slots, which the capture does not read (refcheck refuses that setting in the runs it
    drives, ``settings.radix_refusal``)."""
    strategy = str(server.get("mamba_radix_cache_strategy") or "")
    if serving.get("radix_cache") and strategy.startswith("extra_buffer"):
        return (f"the radix cache with the mamba {strategy} strategy keeps the recurrent state in track slots the "
                "capture does not read")
    return None


def served_trace(root: Path, model_dir: Path | None = None, draft_dir: Path | None = None,
                 running: bool = False, last_records: int | None = None) -> Served:
    """The trace of the capture directory ``root`` (module docstring); ``running``: the server is still serving, so
    records queued but not yet written are in flight (counted in the trace's ``capture.stats.in_flight_batches``, the
    requests' steps after them not yet in the directory), not a capture error. ``last_records``: only each
    scheduler process's last records are read (a long run's latest hour, in the memory that needs); a request whose
    first record lies before them is left out."""
    root = Path(root)
    check_capture_dir(root)
    if last_records is not None and last_records < 1:
        raise ServedCaptureError(f"--last-records takes a number of records >= 1, got {last_records}")
    return trace_of(read_capture(root, running=running, last=last_records), str(root), model_dir, draft_dir)


def trace_of(cap: Capture, where: str, model_dir: Path | None = None, draft_dir: Path | None = None) -> Served:
    """The trace of a capture read back (:func:`served_trace`; ``where`` names it in errors)."""
    server = next((st["server"] for st in cap.status if isinstance(st.get("server"), dict)), None)
    if server is None:
        raise ServedCaptureError(f"{where}: no status file carries the server's arguments, so the models and the "
                                 "algorithm are unknown")
    algorithm = str(server.get("speculative_algorithm") or "NONE").upper()
    tdir = _checkpoint(model_dir, server.get("model_path"), "model", "--model-dir")
    ddir = _checkpoint(draft_dir, server.get("speculative_draft_model_path"), "draft model", "--draft-dir") \
        if algorithm in DFLASH_DRAFTED else None
    unread = state_unread(server, cap.status[0].get("serving") or {})
    if unread is not None:  # tokens, log-probs, trees and drafts are judged; the state is not
        for steps in cap.steps.values():
            for step in steps:
                step.state = {}
    contexts = capture_contexts(cap)
    prompts, results, sampling, left_out = _requests(cap, contexts)
    if not prompts:
        raise ServedCaptureError(f"{where}: no request refcheck can judge was recorded"
                                 + (f" ({_said(left_out)} left out)" if left_out else ""))
    longest = max(len(r["output_ids"]) for r in results.values())
    prov = _provenance(server, cap, algorithm, tdir, ddir, prompts, sampling, left_out, max(longest, 1))
    asm = assemble_trace(prompts, {p.id: p.id for p in prompts}, results, cap, prov, sampling, served_rng(algorithm),
                         overlap=bool((cap.status[0].get("serving") or {}).get("overlap")), contexts=contexts)
    st = cap.status[0]
    hooks = missing_hooks(cap.status, required_hooks(algorithm, sampling is not None))
    if cap.in_flight:
        asm.stats["in_flight_batches"] = cap.in_flight
    if cap.not_read:
        asm.stats["records_not_read"] = cap.not_read
    prov["capture"] = capture_provenance(cap, asm, None, hooks, st.get("sample") or {"every": 1, "seed": 0},
                                         st.get("max_bytes"), roll=bool(st.get("roll")))
    if unread is not None:
        prov["engine"]["settings"]["state_not_judged"] = unread
    return Served(asm, left_out, unread)


def served_rng(algorithm: str) -> str:
    """How a served run's uniforms were made (a trace's ``rng``): the algorithm's, except that refcheck's keyed
    generator is keyed by a seed and request word its runner sends, which a server's clients do not: its draws are
    then judged as the engine's own (the distributional test)."""
    return "engine" if keyed(algorithm) else sampling_rng(algorithm)


def _checkpoint(given: Path | None, served: Any, what: str, option: str) -> Path:
    """The checkpoint directory ``given`` here, else the one the server ``served`` from; refused without a config."""
    path = Path(given) if given is not None else Path(str(served)) if served else None
    if path is not None and (path / "config.json").is_file():
        return path
    if given is not None:
        raise ServedCaptureError(f"{option} {given} is not a checkpoint directory (no config.json)")
    raise ServedCaptureError(f"the server's {what} {served!r} is not a local checkpoint directory here (no "
                             f"config.json): pass {option} DIR")


def _sampling_of(params: dict[str, Any]) -> Sampling | str:
    """A request's sampling setting (read as refcheck's DDTree worker reads SGLang's params), or why the reference
    cannot judge it."""
    sp = SimpleNamespace(**{"temperature": 1.0, **{k: v for k, v in params.items() if v is not None}})
    odd = sorted([name for name, _ in unsupported(sp)]
                 + [k for k, neutral in _CONSTRAINTS.items() if params.get(k) not in (neutral, None)])
    if odd:
        return f"{', '.join(odd)} set"
    if is_greedy(sp):
        return Sampling()
    try:
        return distribution_of(sp)
    except SamplingError as exc:
        return f"sampling parameters refcheck cannot take ({exc})"


def _requests(cap: Capture, contexts: Contexts) -> tuple[list[Prompt], dict[str, dict], Sampling | None, dict[str, int]]:
    """The requests the trace keeps (prompts, their outputs), its sampling setting, and the others counted by why."""
    rank = cap.first_rank
    at: dict[tuple[str, int], StepCapture] = {}  # (rid, committed length) -> its step recorded there
    for s in cap.steps.get(rank, []):
        at[(s.rid, s.committed_len)] = s
    firsts = {p.rid: p for p in cap.prefills.get(rank, [])}
    left: Counter[str] = Counter()
    groups: dict[Sampling, list[str]] = {}
    recorded = {s.rid for s in cap.steps.get(rank, [])} | set(firsts)
    if cap.requests_met > len(recorded):  # met by a scheduler, yet in no record read
        left[UNRECORDED] = cap.requests_met - len(recorded)
    for rid in sorted(recorded):
        params = contexts.params.get(rid)
        if rid in contexts.late:
            setting = ("its first records before the records read" if cap.not_read else
                       "its first records rolled out" if cap.rolled_out else "its first record not written")
        elif params is None or rid not in contexts.prompt_lens:
            setting = "no sampling parameters recorded"
        else:
            setting = _sampling_of(params)
        if isinstance(setting, str):
            left[setting] += 1
        else:
            groups.setdefault(setting, []).append(rid)
    if not groups:
        return [], {}, None, dict(left)
    sampling = Sampling() if Sampling() in groups else max(groups, key=lambda g: len(groups[g]))
    for other, rids in groups.items():
        if other != sampling:
            left[f"another sampling setting (temperature {other.temperature:g}, top-k {other.top_k}, "
                 f"top-p {other.top_p:g})"] += len(rids)
    prompts, results = [], {}
    for rid in groups[sampling]:
        ctx, n = contexts.known(rid), contexts.prompt_lens[rid]
        output = ctx[n:]
        s = at.get((rid, len(ctx) - 1))
        if s is not None:  # the step recorded at the end of the context carried: its emitted tokens follow
            output = output + list(s.emitted)
        elif not output and rid in firsts:
            output = [firsts[rid].token]
        limit = (contexts.params.get(rid) or {}).get("max_new_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
            output = output[:limit]  # SGLang emits whole verify blocks and cuts at the request's limit
        # its token limit is what the trace holds of it: the free run compares that many greedy tokens
        prompts.append(Prompt(rid, tuple(ctx[:n]), "served", max(len(output), 1)))
        results[rid] = {"output_ids": output}
    return prompts, results, (None if sampling.greedy else sampling), dict(left)


def _said(left_out: dict[str, int]) -> str:
    return "; ".join(f"{n} with {why}" for why, n in sorted(left_out.items()))


def _provenance(server: dict[str, Any], cap: Capture, algorithm: str, tdir: Path, ddir: Path | None,
                prompts: list[Prompt], sampling: Sampling | None, left_out: dict[str, int],
                max_new_tokens: int) -> dict[str, Any]:
    from refcheck.prompts import prompt_set_hash
    from refcheck.provenance import build_provenance
    from refcheck.sglang.requests import draft_rule

    dtype = str(server.get("dtype") or "auto")
    if dtype == "auto":  # SGLang serves the checkpoint's own dtype
        dtype = str(text_config_of(checkpoint_config(tdir)).get("torch_dtype") or "bfloat16")
    dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)  # SGLang's other names for them
    block = draft_block_size(ddir) if algorithm == "DFLASH" else None
    nodes = server.get("speculative_num_draft_tokens")
    budget = 0 if algorithm == "NONE" else (block - 1) if block else int(nodes) - 1 if nodes else None
    st = cap.status[0]
    settings = {"algorithm": algorithm, "draft_rule": draft_rule(algorithm), "tree_rules": "structural",
                "served": True, "server": server, "serving": st.get("serving") or {}, "left_out": left_out,
                "stop_token_ids": [], "draft_dir": str(ddir) if ddir else None,
                **({"sampling": sampling.to_json(), "rng": served_rng(algorithm)} if sampling is not None else {})}
    return build_provenance(
        engine="sglang", engine_version=str(st.get("sglang", "unknown")), settings=settings, model_dir=tdir,
        draft_dir=ddir, dtype=dtype, device="cuda", budget=budget,
        block_size=block or (budget or 0) + 1, max_new_tokens=max_new_tokens,
        drafter="dflash" if algorithm in DFLASH_DRAFTED else "none", prompt_set_sha256=prompt_set_hash(prompts))
