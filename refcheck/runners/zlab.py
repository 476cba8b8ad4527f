"""The live z-lab runner: the ``dflash`` PyPI package's own decoding (chain DFlash), recorded.

Contract: :class:`ZlabRunner` runs ``dflash.model.dflash_generate`` (greedy) on the same target
(transformers model), draft checkpoint and prompts as the reference, and records a refcheck trace by
observing it from outside, without changing what it computes: a forward hook on the target captures
every verify block's input ids and logits, a wrapper on the drafter's ``compute_logits`` captures its
draft logits. Per step the trace holds the chain (root = the previous bonus, then the drafts), the
target's argmax and top-k log-probs at every node, the accepted prefix, τ (bonus counted), the bonus,
the emitted tokens (``dflash_generate``'s own per-step count) and the drafter's top-k. z-lab does not
expose its KV or recurrent state, so those are recorded as unsupported (an empty state list).

Known upstream behaviour this makes visible: on hybrid targets ``dflash_generate`` rolls the target
cache back with ``Cache.crop``, which in transformers restores KV and conv windows but not the Gated
DeltaNet recurrent state, so after any partially accepted block the next verify starts from a state
that includes rejected drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from refcheck.errors import UsageError
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec, ReferenceRunner
from refcheck.trace.io import RequestRow, StepRow, Trace

TOPK = 5
DRAFT_TOPK = 8


def _import_dflash():
    try:
        import dflash.model as dm
    except ImportError as exc:  # an optional dependency
        raise UsageError("the zlab engine needs z-lab's dflash package: pip install --no-deps dflash==0.1.0") from exc
    return dm


@dataclass(slots=True)
class _Capture:
    verify: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (ids [vs], logits [vs, V])
    drafts: list[torch.Tensor] = field(default_factory=list)  # [vs-1, V]
    prefill_last: torch.Tensor | None = None  # [V] the prefill's last-position logits


class ZlabRunner:
    name = "zlab"

    def __init__(self, spec: EngineSpec) -> None:
        if spec.budget is not None:
            raise UsageError("the zlab engine is chain DFlash only: use --budget chain")
        if spec.drafter != "dflash":
            raise UsageError("the zlab engine runs z-lab's DFlash drafter: use --drafter dflash")
        self.dm = _import_dflash()
        self.ref = ReferenceRunner(spec)  # loads the target (and validates the pair) the reference way
        self.spec = spec
        _, ddir = spec.resolved_dirs()
        dtype = self.ref.target.dtype
        self.draft = self.dm.DFlashDraftModel.from_pretrained(str(ddir), dtype=dtype).to(self.ref.target.device).eval()

    def _generate(self, prompt: list[int], max_new: int, cap: _Capture) -> tuple[list[int], list[int]]:
        model = self.ref.target.model
        calls: list[int] = [0]

        def hook(_mod, args, kwargs, out):
            ids = kwargs.get("input_ids", args[0] if args else None)
            calls[0] += 1
            if calls[0] == 1:  # the prefill
                cap.prefill_last = out.logits[0, -1].detach().float().cpu()
            else:
                cap.verify.append((ids[0].detach().cpu(), out.logits[0].detach().float().cpu()))

        orig = self.draft.compute_logits

        def compute_logits(hidden, head):
            logits = orig(hidden, head)
            cap.drafts.append(logits[0].detach().float().cpu())
            return logits

        handle = model.register_forward_hook(hook, with_kwargs=True)
        self.draft.compute_logits = compute_logits
        timer = self.dm._cuda_time
        if self.ref.target.device.type != "cuda":
            self.dm._cuda_time = time.perf_counter  # z-lab's timer synchronises CUDA unconditionally
        try:
            res = self.dm.dflash_generate(
                self.draft, model, torch.tensor([prompt], device=self.ref.target.device), max_new_tokens=max_new,
                stop_token_ids=sorted(self.spec.stop_token_ids) or None, return_stats=True,
            )
        finally:
            handle.remove()
            self.draft.compute_logits = orig
            self.dm._cuda_time = timer
        return res.output_ids[0, len(prompt):].tolist(), list(res.acceptance_lengths)

    def trace(self, prompts: list[Prompt]) -> Trace:
        requests, steps = [], []
        for p in prompts:
            prompt = list(p.prompt_ids)
            cap = _Capture()
            out, produced = self._generate(prompt, p.max_new_tokens or self.spec.max_new_tokens, cap)
            if len(cap.verify) != len(produced):
                raise RuntimeError(f"captured {len(cap.verify)} verify calls for {len(produced)} z-lab steps")
            out_lps = [float(torch.log_softmax(cap.prefill_last, -1)[out[0]])] if out else []
            done = 1
            draft_iter = iter(cap.drafts)
            for k, ((ids, logits), n_out) in enumerate(zip(cap.verify, produced)):
                vs = ids.shape[0]
                logp = torch.log_softmax(logits, dim=-1)  # [vs, V]
                argmax = logp.argmax(-1)
                acc = int((ids[1:] == argmax[:-1]).long().cumprod(0).sum()) if vs > 1 else 0
                accepted = list(range(acc + 1))
                emitted = out[done : done + n_out]
                lps = [float(logp[i, t]) for i, t in zip(accepted, emitted)]
                draft = next(draft_iter) if vs > 1 else None
                dtop = torch.log_softmax(draft, -1).topk(min(DRAFT_TOPK, draft.shape[-1]), -1) if draft is not None else None
                top = logp.topk(min(TOPK, logp.shape[-1]), -1)
                steps.append(StepRow(
                    request_id=p.id, step=k, committed_len=len(prompt) + done - 1,
                    tree_tokens=ids.tolist(), tree_parents=list(range(-1, vs - 1)), tree_depths=list(range(vs)),
                    tree_ranks=[0] * vs,
                    draft_topk_ids=dtop.indices.tolist() if dtop is not None else [],
                    draft_topk_logprobs=dtop.values.tolist() if dtop is not None else [],
                    topk_ids=top.indices.tolist(), topk_logprobs=top.values.tolist(), target_argmax=argmax.tolist(),
                    accepted=accepted, accept_length=len(accepted), bonus=int(argmax[acc]), emitted=emitted,
                    emitted_logprobs=lps, state=[],
                    timings={"draft": float("nan"), "tree": 0.0, "verify": float("nan"), "commit": float("nan")},
                ))
                out_lps += lps
                done += n_out
            requests.append(RequestRow(p.id, p.kind, prompt, out, out_lps,
                                       max_new_tokens=-1 if p.max_new_tokens is None else p.max_new_tokens))
        prov = self.ref.provenance(prompts, engine="zlab", settings={"dflash": getattr(self.dm, "__version__", "0.1.0")})
        return Trace(provenance=prov, requests=requests, steps=steps)
